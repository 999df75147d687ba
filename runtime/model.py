"""The Ouro looped decoder: configuration, presets, weights and the per-loop math.

Architecture (BRIEF section 1; Ouro, arXiv 2510.25741; tensor names as in the official HF checkpoint):
the same ``num_hidden_layers`` decoder layers run up to ``total_ut_steps`` times ("loops", "depths") per
token. Each layer is a sandwich-norm block::

    h = x + input_layernorm_2(attn(input_layernorm(x)))
    h = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h)))

After the layers of each loop the final ``norm`` is applied; that normed state feeds the next loop, the
exit gate ``early_exit_gate`` (Linear(hidden, 1, bias=True)) and, at exit, ``lm_head``.

This module knows nothing about batching, paging or exit policies: attention is a callable handed in by
the caller (the engine or the naive reference), so one set of layer math serves both.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from .api import Setting, setting_value


@dataclass(frozen=True)
class OuroConfig:
    """The HF ``config.json`` keys the runtime uses (names as in the official Ouro checkpoint)."""

    hidden_size: int = 2048
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 128
    intermediate_size: int = 5632
    vocab_size: int = 49152
    max_position_embeddings: int = 65536
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int):
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"config key {f.name!r} must be a positive integer, got {value!r}")
            elif f.type in ("float", float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"config key {f.name!r} must be a finite number, got {value!r}")
            elif f.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"config key {f.name!r} must be true or false, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, {self.rope_theta}")
        if not 0.0 < self.early_exit_threshold <= 1.0:
            raise ValueError(f"early_exit_threshold must be in (0, 1], got {self.early_exit_threshold}")

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, OuroConfig] = {
    # The exact Ouro-1.4B shape: 1,434,652,673 parameters.
    "ouro-1.4b": OuroConfig(),
    # Small enough that a whole paired benchmark runs in seconds on 2 CPU cores.
    "tiny": OuroConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       head_dim=16, intermediate_size=128, vocab_size=256, max_position_embeddings=1024,
                       rope_theta=10_000.0, total_ut_steps=4),
}


def tensor_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF-layout Ouro checkpoint, name -> shape (the loader validates against this)."""
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nh * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "input_layernorm_2.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "post_attention_layernorm_2.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["model.early_exit_gate.weight"] = (1, h)
    shapes["model.early_exit_gate.bias"] = (1,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def parameter_count(cfg: OuroConfig) -> int:
    return sum(math.prod(s) for s in tensor_shapes(cfg).values())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (or fp64), result cast back to ``x.dtype``. x: [..., hidden]; weight: [hidden]."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(acc) * xf).to(x.dtype)


def rope_tables(cfg: OuroConfig, max_len: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim // 2] with angle p * theta^(-2i/head_dim) (RoFormer, arXiv 2104.09864)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / cfg.head_dim))
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding. x: [N, heads, head_dim]; cos, sin: [N, head_dim // 2] (fp32/fp64)."""
    half = x.shape[-1] // 2
    xf = x.to(cos.dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, gemm_rows: int | None = None) -> torch.Tensor:
    """x @ w.T: x [N, K], w [M, K] -> [N, M] in x's dtype. With ``gemm_rows`` the product runs as N /
    gemm_rows calls of exactly ``gemm_rows`` rows each (raises ValueError unless N is a multiple), so a
    row's result is the same for every N: a matmul's per-row bits depend on its shape (the library picks
    its algorithm, and with it the reduction order, by shape), never on the other rows' values."""
    if gemm_rows is None or x.shape[0] == gemm_rows:
        return F.linear(x, w)
    if x.shape[0] % gemm_rows:
        raise ValueError(f"{x.shape[0]} rows are not a multiple of gemm_rows={gemm_rows}")
    out = x.new_empty((x.shape[0], w.shape[0]))
    for start in range(0, x.shape[0], gemm_rows):
        torch.matmul(x[start:start + gemm_rows], w.t(), out=out[start:start + gemm_rows])
    return out


# attend(layer, q [N, H, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, H, D]; the caller owns the KV cache.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# rope_write(layer, qkv [N, (H + 2 Hkv) * D]): rotate q and k in place and write k, v into the caller's KV
# cache (kernels/kv_write.rope_write_kv_); with it, attend only attends (it must not write the cache again).
# It may also have project(layer, x [N, hidden], w_qkv, gemm.GemmConfig, next_weight=None) -> qkv: the projection
# doing the same in its epilogue (kernels/qkv_rope.py), which the small-M GEMM path uses where it has a config.
RopeWriteFn = Callable[[int, torch.Tensor], None]

# OuroModel(prefetch_next=...): the weights a projection kernel may bring into L2 for the projection after it
# (kernels/gemm.py next_weight_region), keyed by that later weight: o_proj's by qkv (+ RoPE), gate_up's by
# o_proj, down's by gate_up (+ SwiGLU), the next layer's qkv by down (the last layer's down: layer 0's qkv,
# which the next loop reads first).
PREFETCH_TARGETS = ("o_proj", "gate_up", "down", "qkv")


def check_prefetch_next(prefetch_next: Mapping[str, float] | None) -> dict[str, float]:
    """``OuroModel(prefetch_next=...)`` as a dict; ValueError / TypeError naming a bad target or fraction."""
    if prefetch_next is None:
        return {}
    if not isinstance(prefetch_next, Mapping):
        raise TypeError(f"prefetch_next must map a target to a fraction, got {prefetch_next!r}")
    for target, fraction in prefetch_next.items():
        if target not in PREFETCH_TARGETS:
            raise ValueError(f"prefetch_next: unknown target {target!r} (one of {', '.join(PREFETCH_TARGETS)})")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"prefetch_next[{target!r}] must be a fraction in (0, 1], got {fraction!r}")
    return dict(prefetch_next)


@dataclass(frozen=True)
class GemmRole:
    """One projection's entry in the small-M GEMM configuration tables the fused loop reads at every launch
    (kernels/gemm.py ``CONFIGS`` / ``FASTER_UP_TO`` and ``SWIGLU_CONFIGS`` / ``SWIGLU_FASTER_UP_TO``,
    kernels/qkv_rope.py ``CONFIGS`` / ``FASTER_UP_TO``), for one model shape: :func:`gemm_roles`."""

    table_name: str                 # where the configuration lives, as messages name it: "gemm.CONFIGS"
    configs: dict                   # weight [N, K] -> GemmConfig (the module table itself, not a copy)
    faster_up_to: dict              # weight [N, K] -> the most rows that configuration runs at
    shape: tuple[int, int]          # the model's weight [N, K] keying both
    prefetch_target: str | None     # the PREFETCH_TARGETS weight it prefetches; None: lm_head, which prefetches none


def gemm_roles(cfg: OuroConfig) -> dict[str, GemmRole]:
    """Per projection, in loop order, ``cfg``'s entry in the GEMM configuration tables (:class:`GemmRole`): the
    plain qkv / o_proj / gate_up / down / lm_head GEMMs, gate_up with SwiGLU in its epilogue (``swiglu``) and qkv with
    RoPE and the KV write (``qkv_rope``); the fused loop runs the last two where they have a configuration for the
    rows. Keyed by the throughput probe's ``--gemm-config`` roles. Weight shapes as in :class:`LayerWeights`."""
    from loopbench.kernels import gemm, qkv_rope
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h)
    plain = ("gemm.CONFIGS", gemm.CONFIGS, gemm.FASTER_UP_TO)
    swiglu = ("gemm.SWIGLU_CONFIGS", gemm.SWIGLU_CONFIGS, gemm.SWIGLU_FASTER_UP_TO)
    rope = ("qkv_rope.CONFIGS", qkv_rope.CONFIGS, qkv_rope.FASTER_UP_TO)
    return {"qkv": GemmRole(*plain, qkv, "o_proj"),
            "qkv_rope": GemmRole(*rope, qkv, "o_proj"),
            "o_proj": GemmRole(*plain, (h, cfg.num_attention_heads * d), "gate_up"),
            "gate_up": GemmRole(*plain, (2 * i, h), "down"),
            "swiglu": GemmRole(*swiglu, (2 * i, h), "down"),
            "down": GemmRole(*plain, (h, i), "qkv"),
            "lm_head": GemmRole(*plain, (cfg.vocab_size, h), None)}


def check_prefetch_programs(cfg: OuroConfig, prefetch_next: Mapping[str, float] | None) -> None:
    """ValueError naming a small-M GEMM configuration of one of ``cfg``'s projections (:func:`gemm_roles`, the
    tables as they are now) whose ``GemmConfig.prefetch_programs`` > 0 has no next-weight region: ``prefetch_next``
    lacks the target that projection prefetches (qkv and qkv_rope: o_proj, o_proj: gate_up, gate_up and swiglu: down,
    down: qkv; :data:`PREFETCH_TARGETS`), or it is lm_head, which prefetches nothing. Those extra programs only
    prefetch, so without a region they are never launched and a run timed with them measures nothing. Roles are named
    as the throughput probe's ``--gemm-config`` names them. The tables and the plan may change between runs, so the
    fused loop (:meth:`OuroModel.run_loop` of a fused model) checks at every call, before it launches anything;
    the torch loop runs none of these kernels. The throughput probe checks its configurations with it before it
    loads any weight."""
    plan = prefetch_next or {}
    for role, r in gemm_roles(cfg).items():
        c = r.configs.get(r.shape)
        if c is None or not c.prefetch_programs or r.prefetch_target in plan:
            continue
        where = f"{role}'s GemmConfig.prefetch_programs={c.prefetch_programs} ({r.table_name}[{r.shape}])"
        if r.prefetch_target is None:
            raise ValueError(f"{where} needs a next-weight region, and lm_head has no next weight to prefetch: "
                             f"its extra programs would never be launched (set prefetch_programs=0)")
        raise ValueError(f"{where} needs a next-weight region, but prefetch_next has no {r.prefetch_target!r} (the "
                         f"weight {role} prefetches): its extra programs would never be launched (add "
                         f"prefetch_next[{r.prefetch_target!r}], or set prefetch_programs=0)")


@dataclass
class LayerWeights:
    qkv: torch.Tensor       # [(H + 2 Hkv) * D, hidden]: q, k, v projections fused into one matmul
    o: torch.Tensor         # [hidden, H * D]
    gate_up: torch.Tensor   # [2 * intermediate, hidden]: SwiGLU gate and up fused
    down: torch.Tensor      # [hidden, intermediate]
    ln_in: torch.Tensor
    ln_in2: torch.Tensor
    ln_post: torch.Tensor
    ln_post2: torch.Tensor


class OuroModel:
    """Ouro weights on one device in one dtype, with the math of one loop of the recurrent core.

    Built from an HF-layout tensor dict (``load_checkpoint``) by :meth:`from_tensors`. The model holds no
    KV cache and no per-request state; :meth:`run_loop` takes the attention as a callable.
    """

    def __init__(self, cfg: OuroConfig, tensors: dict[str, torch.Tensor], *, device="cpu",
                 dtype: torch.dtype = torch.bfloat16, rope_len: int | None = None, fused: bool | None = None,
                 small_m_gemm: bool = True, prefetch_next: Mapping[str, float] | None = None):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        # Fused Triton elementwise kernels (kernels/fused_ops.py) by default on CUDA; plain torch on CPU.
        self.fused = self.device.type == "cuda" if fused is None else fused
        # Our small-M GEMM (kernels/gemm.py) for the shapes and row counts it was measured faster at
        # (gemm.FASTER_UP_TO), cuBLAS for the rest; CUDA only (TMA, PDL). On by default since the engine
        # ran with it on an H200 (batch invariance at every bucket, faster decode at B16 and B32:
        # kernels/results/README.md); small_m_gemm=False (the throughput probe's --gemm cublas) is cuBLAS.
        # The configurations were measured on an H200 (sm_90) and use TMA and PDL (sm_90 features): other
        # GPUs run cuBLAS until measured.
        self.small_m_gemm = (small_m_gemm and self.fused and self.device.type == "cuda"
                             and torch.version.hip is None and torch.cuda.get_device_capability(self.device) == (9, 0))
        # Cross-kernel L2 prefetch (off by default; measured slower, 0.81-0.95x at B16 / B32 on an H200:
        # kernels/results/README.md): where a projection runs on our small-M GEMM with PDL, its programs bring
        # the first ``fraction`` of the K columns of every row of the next projection's weight into L2 before
        # their PDL wait. No result depends on it. {PREFETCH_TARGETS key: fraction in (0, 1]}. A GEMM configuration
        # with prefetch_programs needs its projection's target here (check_prefetch_programs, at every fused loop).
        self.prefetch_next = check_prefetch_next(prefetch_next)
        # Decode samples from lm_head's per-tile maxima (greedy_partials) where lm_head runs on our GEMM; False
        # writes the logits and samples from them (the same tokens; the throughput probe's --greedy-from-logits).
        self.greedy_tiles = True
        # o_proj and down run their norm step in their own launch (kernels/gemm_norm.py) where they run on our
        # split-K GEMM: one kernel fewer after each. Off by default until it is measured in the decode loop (the
        # throughput probe's --norm-in-gemm); its arrival counters are allocated here, outside any graph capture.
        # One pair serves every loop on one stream: two streams running this model's loops at once would share them.
        self.norm_in_gemm = False
        self._norm_counters = torch.zeros(2, dtype=torch.int32, device=self.device) if self.fused else None
        # Batch-invariant prefill projections (rows in fixed-size calls, ``run_loop``'s gemm_rows) in one launch of
        # kernels/prefill_gemm.py instead of cuBLAS calls of exactly gemm_rows rows: a row's bits do not depend on M
        # there, so a packed prefill of 2,048 rows is one launch, not eight. CUDA and the fused loop only (the
        # throughput probe's --prefill-gemm). Off: no faster in the loop on an H100 (0.996x / 1.001x at B16 / B32;
        # kernels/results/README.md, prefill_gemm): it wins on the first prefill and loses on the small packs.
        self.prefill_gemm = False
        # kernels/mlp_ring.py's arrival counters (its BARRIERS), for the layer half after attention as one persistent
        # launch where mlp_ring.CONFIGS has this layer shape (:meth:`ring_config`); allocated here, outside any
        # capture, and used by one stream at a time (:meth:`ring_on` keeps prefill loops off a second stream).
        self._ring_counters = torch.zeros(4, dtype=torch.int64, device=self.device) if self.fused else None
        expected = tensor_shapes(cfg)
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise ValueError(f"missing tensor {missing[0]!r} ({len(missing)} missing)")

        def t(name: str) -> torch.Tensor:
            w = tensors[name]
            if tuple(w.shape) != expected[name]:
                raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {expected[name]}")
            return w.to(device=self.device, dtype=dtype).contiguous()

        self.embed = t("model.embed_tokens.weight")                   # [V, hidden]
        self.norm = t("model.norm.weight")
        self.gate_w = t("model.early_exit_gate.weight")                # [1, hidden]
        self.gate_b = t("model.early_exit_gate.bias")                  # [1]
        self.lm_head = self.embed if cfg.tie_word_embeddings else t("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                qkv=torch.cat([t(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                o=t(p + "self_attn.o_proj.weight"),
                gate_up=torch.cat([t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")]),
                down=t(p + "mlp.down_proj.weight"),
                ln_in=t(p + "input_layernorm.weight"), ln_in2=t(p + "input_layernorm_2.weight"),
                ln_post=t(p + "post_attention_layernorm.weight"),
                ln_post2=t(p + "post_attention_layernorm_2.weight")))
        rope_len = min(rope_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.rope_dtype = torch.promote_types(dtype, torch.float32)
        self.cos, self.sin = rope_tables(cfg, rope_len, self.device, self.rope_dtype)

    @classmethod
    def from_tensors(cls, cfg: OuroConfig, tensors: dict[str, torch.Tensor], *, device="cpu",
                     dtype: torch.dtype = torch.bfloat16, rope_len: int | None = None,
                     fused: bool | None = None, small_m_gemm: bool = True,
                     prefetch_next: Mapping[str, float] | None = None) -> "OuroModel":
        return cls(cfg, tensors, device=device, dtype=dtype, rope_len=rope_len, fused=fused, small_m_gemm=small_m_gemm,
                   prefetch_next=prefetch_next)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one recurrent-core loop reads (all layers, final norm and gate)."""
        per_layer = sum(w.numel() * w.element_size() for w in vars(self.layers[0]).values())
        return per_layer * len(self.layers) + (self.norm.numel() + self.gate_w.numel()) * self.norm.element_size()

    def num_parameters(self) -> int:
        """Distinct parameters held (fused projections count once; a tied lm_head counts once)."""
        seen = {id(self.lm_head): self.lm_head} if not self.cfg.tie_word_embeddings else {}
        for t in (self.embed, self.norm, self.gate_w, self.gate_b):
            seen[id(t)] = t
        for w in self.layers:
            for t in vars(w).values():
                seen[id(t)] = t
        return sum(t.numel() for t in seen.values())

    # the projections :meth:`settings` names in ``wgmma_projections``, in loop order (gemm_roles' keys but
    # qkv_rope, which runs on kernels/qkv_rope.py only)
    WGMMA_ROLES = ("qkv", "o_proj", "gate_up", "swiglu", "down", "lm_head")

    def settings(self) -> dict[str, Setting]:
        """The switches this model's loops run with, as resolved now on its device: a flat dict of JSON
        scalars (runtime/api.py ``setting_value``; ``LoopEngine.settings`` reports them under ``model_``).

        - ``device_type``: the weights' device type (``"cuda"``, ``"cpu"``); ``dtype``: their dtype's torch name
          (``"bfloat16"``);
        - ``fused``: the fused Triton loop (kernels/fused_ops.py, :meth:`_run_loop_fused`), else plain torch;
        - ``small_m_gemm``: our small-M GEMM (kernels/gemm.py) runs a projection where ``gemm.FASTER_UP_TO`` says it
          is faster at the rows, cuBLAS the rest; as resolved (fused, CUDA, sm_90), so False means cuBLAS only;
        - ``wgmma_projections``: the projections (:data:`WGMMA_ROLES`, comma-separated in loop order; ``""`` none)
          that run on the Gluon wgmma kernel (kernels/wgmma_gemm.py ``CONFIGS``, ``SWIGLU_CONFIGS`` for gate_up +
          SwiGLU) wherever our small-M GEMM runs them at most ``wgmma_gemm.MAX_M`` rows with no L2 prefetch asked
          for (:meth:`wgmma_config`): those with a configuration for this model's weight shape in both tables;
        - ``greedy_tiles``: decode samples from lm_head's per-tile maxima where lm_head runs on our GEMM
          (:meth:`greedy_tiles_config`), else from written logits (the same tokens);
        - ``norm_in_gemm``: o_proj and down run their norm step in their own launch where they can
          (:meth:`norm_gemm_config`);
        - ``prefill_gemm``: prefill projections in fixed-size calls (a batch-invariant engine's; an engine with
          ``batch_invariant=False`` runs one cuBLAS call whatever this says) run in one launch of
          kernels/prefill_gemm.py (:meth:`prefill_gemm_on`), else as cuBLAS calls of exactly
          ``EngineConfig.prefill_call_rows`` rows;
        - ``mlp_ring``: the layer half after attention runs as one persistent launch where it can
          (:meth:`ring_config`; kernels/mlp_ring.py ``CONFIGS`` has this layer shape and our small-M GEMM runs);
        - ``prefetch_next_<target>`` for each of :data:`PREFETCH_TARGETS`: the fraction (0, 1] of that weight's K
          columns the projection before it brings into L2, None where not asked for;
        - ``pdl``: this device's Triton kernels launch with programmatic dependent launch (kernels/pdl.py
          ``active``: its ``ENABLED`` switch, a CUDA GPU of sm_90 or newer); ``pdl_trigger``: where they release
          the next kernel (``pdl.TRIGGER``, ``"late"`` or ``"early"``; a GEMM configuration's ``early_trigger``
          overrides it for its own launches), None without PDL.

        The tables and the PDL switch are process-wide and read at launch, so this is their state now."""
        from loopbench.kernels import pdl
        on = pdl.active(self.embed)
        out = {"device_type": self.device.type, "dtype": str(self.dtype).removeprefix("torch."),
               "fused": self.fused, "small_m_gemm": self.small_m_gemm, "wgmma_projections": self._wgmma_projections(),
               "greedy_tiles": self.greedy_tiles, "norm_in_gemm": self.norm_in_gemm, "mlp_ring": self.ring_on(),
               "prefill_gemm": self.prefill_gemm_on(),
               **{f"prefetch_next_{t}": self.prefetch_next.get(t) for t in PREFETCH_TARGETS},
               "pdl": on, "pdl_trigger": pdl.TRIGGER if on else None}
        return {k: setting_value(k, v) for k, v in out.items()}

    def _wgmma_projections(self) -> str:
        """``settings()["wgmma_projections"]``: the roles whose weight shape has a configuration in both our small-M
        GEMM's table and the wgmma kernel's (``""`` without ``small_m_gemm``, which runs neither)."""
        if not self.small_m_gemm:
            return ""
        from loopbench.kernels import wgmma_gemm
        roles = gemm_roles(self.cfg)
        on = [role for role in self.WGMMA_ROLES if roles[role].shape in roles[role].configs
              and roles[role].shape in (wgmma_gemm.SWIGLU_CONFIGS if role == "swiglu" else wgmma_gemm.CONFIGS)]
        return ",".join(on)

    def run_loop(self, x: torch.Tensor, positions: torch.Tensor, attend: AttendFn, *,
                 gemm_rows: int | None = None, rope_write: RopeWriteFn | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One loop of the recurrent core: every layer, the final norm and the exit gate.

        x: [N, hidden] model dtype (loop input); positions: [N] int (rotary positions); gemm_rows: run
        every projection in calls of exactly this many rows (:func:`linear`; N must be a multiple);
        rope_write: fused RoPE + KV write (:data:`RopeWriteFn`; fused models only, else ValueError).
        A fused model raises ValueError before it launches anything where a GEMM configuration's
        ``prefetch_programs`` has no next-weight region in ``prefetch_next`` (:func:`check_prefetch_programs`).
        Returns (normed loop output [N, hidden] model dtype, hazard [N] fp32 or fp64 =
        sigmoid(early_exit_gate(output)), BRIEF section 1).
        """
        if self.fused:
            return self._run_loop_fused(x, positions, attend, gemm_rows, rope_write)
        if rope_write is not None:
            raise ValueError("rope_write needs the fused loop (OuroModel(fused=True))")
        cfg = self.cfg
        n, H, Hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        pos = positions.long()
        cos, sin = self.cos[pos], self.sin[pos]
        for i, w in enumerate(self.layers):
            qkv = linear(rms_norm(x, w.ln_in, eps), w.qkv, gemm_rows)
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = apply_rope(q.reshape(n, H, D), cos, sin)
            k = apply_rope(k.reshape(n, Hkv, D), cos, sin)
            a = attend(i, q, k, v.reshape(n, Hkv, D).contiguous())
            x = x + rms_norm(linear(a.reshape(n, H * D), w.o, gemm_rows), w.ln_in2, eps)
            gate, up = linear(rms_norm(x, w.ln_post, eps), w.gate_up, gemm_rows).chunk(2, dim=-1)
            x = x + rms_norm(linear(F.silu(gate) * up, w.down, gemm_rows), w.ln_post2, eps)
        x = rms_norm(x, self.norm, eps)
        return x, self.hazard(x)

    def _run_loop_fused(self, x: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                        gemm_rows: int | None, rope_write: RopeWriteFn | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run_loop` with one launch per elementwise stage: each sandwich norm is fused with its
        residual add and with the next pre-norm (the next layer's input norm, or the final norm), RoPE
        rotates q and k in place inside the fused qkv output (together with the KV write when the caller
        gives ``rope_write``), and silu(gate) * up is one kernel. With ``small_m_gemm`` the projections run
        on kernels/gemm.py where it has a configuration: o_proj's and down's split-K partials go straight
        into the norm kernel, and where kernels/qkv_rope.py and ``gemm.gemm_swiglu`` have one, the qkv
        projection does RoPE and the KV write and gate_up does SwiGLU in their epilogues. The last layer's norm
        kernel, which applies the final norm, also runs the exit gate (``fused_ops.add_rms_norm_gate``; an fp64
        model, whose hazard is fp64, keeps :meth:`hazard`)."""
        from loopbench.kernels import fused_ops as fo
        from loopbench.kernels import gemm, qkv_rope
        cfg = self.cfg
        check_prefetch_programs(cfg, self.prefetch_next)       # before any launch: a prefetch that would do nothing
        n, H, Hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        h = fo.rms_norm(x, self.layers[0].ln_in, eps)
        proj = self._project
        qkv_cfg = self._fused_config(qkv_rope.CONFIGS, qkv_rope.FASTER_UP_TO, self.layers[0].qkv, h, gemm_rows)
        glu_cfg = self._fused_config(gemm.SWIGLU_CONFIGS, gemm.SWIGLU_FASTER_UP_TO, self.layers[0].gate_up, h,
                                     gemm_rows)
        for i, w in enumerate(self.layers):
            nxt_layer = self.layers[(i + 1) % len(self.layers)]
            if qkv_cfg is not None and hasattr(rope_write, "project"):
                qkv = rope_write.project(i, h, w.qkv, qkv_cfg, self._prefetch_region("o_proj", w.o))
            else:
                qkv = proj(h, w.qkv, gemm_rows, False, self._prefetch_region("o_proj", w.o))
                if rope_write is None:
                    fo.rope_(qkv, self.cos, self.sin, positions, H + Hkv, D)
                else:
                    rope_write(i, qkv)
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            a = attend(i, q.view(n, H, D), k.view(n, Hkv, D), v.view(n, Hkv, D))
            nxt = self.layers[i + 1].ln_in if i + 1 < len(self.layers) else self.norm
            gate = i + 1 == len(self.layers) and self.rope_dtype == torch.float32
            ring = self.ring_config(a.reshape(n, H * D), gemm_rows)
            if ring is not None:
                from loopbench.kernels import mlp_ring
                out = mlp_ring.mlp_ring(a.reshape(n, H * D), x, w.o, w.gate_up, w.down, w.ln_in2, w.ln_post,
                                        w.ln_post2, nxt, eps, ring, self._ring_counters,
                                        (self.gate_w, self.gate_b) if gate else None)
                x, h, hazard = out if gate else (*out, None)
                continue
            x, h, _ = self._project_norm(a.reshape(n, H * D), w.o, x, w.ln_in2, w.ln_post, gemm_rows,
                                         self._prefetch_region("gate_up", w.gate_up), gate=False)
            pf_down = self._prefetch_region("down", w.down)
            act = (self._swiglu(h, w.gate_up, glu_cfg, pf_down) if glu_cfg
                   else fo.silu_mul(proj(h, w.gate_up, gemm_rows, False, pf_down)))
            x, h, hazard = self._project_norm(act, w.down, x, w.ln_post2, nxt, gemm_rows,
                                              self._prefetch_region("qkv", nxt_layer.qkv), gate)
        # the last norm step ran the exit gate, except for an fp64 model (whose hazard is fp64: the torch gate)
        return h, self.hazard(h) if hazard is None else hazard

    def _swiglu(self, h: torch.Tensor, gate_up: torch.Tensor, glu_cfg, next_weight: torch.Tensor | None
                ) -> torch.Tensor:
        """gate_up + SwiGLU in one launch, where it runs on our small-M GEMM (``glu_cfg``, its configuration there):
        kernels/wgmma_gemm.py where :meth:`wgmma_config` would give a configuration, else ``gemm.gemm_swiglu``."""
        from loopbench.kernels import gemm, wgmma_gemm
        wg = self._wgmma_where_fused(h, gate_up, next_weight, wgmma_gemm.SWIGLU_CONFIGS)
        return wgmma_gemm.gemm_swiglu(h, gate_up, wg) if wg else gemm.gemm_swiglu(h, gate_up, glu_cfg, next_weight)

    def wgmma_config(self, x: torch.Tensor, w: torch.Tensor, gemm_rows: int | None = None,
                     next_weight: torch.Tensor | None = None, swiglu: bool = False):
        """The kernels/wgmma_gemm.py configuration with which the projection of ``w`` runs on rows ``x`` [N, K] (a
        meta tensor will do), or None where kernels/gemm.py or cuBLAS runs it: only where our small-M GEMM would run
        (``gemm.CONFIGS`` / ``FASTER_UP_TO``; with ``swiglu``, gate_up + SwiGLU by ``gemm.SWIGLU_CONFIGS``), at most
        ``wgmma_gemm.MAX_M`` rows, with no L2 prefetch asked for (``next_weight``; that kernel has none) and this
        weight shape in ``wgmma_gemm.CONFIGS`` (``SWIGLU_CONFIGS``). One per weight shape, never per M."""
        from loopbench.kernels import gemm, wgmma_gemm
        configs, faster, table = ((gemm.SWIGLU_CONFIGS, gemm.SWIGLU_FASTER_UP_TO, wgmma_gemm.SWIGLU_CONFIGS) if swiglu
                                  else (gemm.CONFIGS, gemm.FASTER_UP_TO, wgmma_gemm.CONFIGS))
        if self._fused_config(configs, faster, w, x, gemm_rows) is None:
            return None
        return self._wgmma_where_fused(x, w, next_weight, table)

    @staticmethod
    def _wgmma_where_fused(x: torch.Tensor, w: torch.Tensor, next_weight: torch.Tensor | None, table: dict):
        """The rest of :meth:`wgmma_config`'s decision, for a projection already known to run on our small-M GEMM
        (its fused configuration in hand): ``table``'s configuration for w's shape, at most ``wgmma_gemm.MAX_M``
        rows on CUDA (or meta), no L2 prefetch asked for; else None."""
        from loopbench.kernels import wgmma_gemm
        if next_weight is not None or x.shape[0] > wgmma_gemm.MAX_M or x.device.type not in ("cuda", "meta"):
            return None
        return table.get(tuple(w.shape))

    def _project_norm(self, a: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor, gemm_rows: int | None, next_weight: torch.Tensor | None, gate: bool):
        """o_proj or down and the norm step after it: (x_new, h, hazard or None), hazard only with ``gate`` (the
        exit gate on h, ``fused_ops.add_rms_norm_gate``). One launch (``gemm_norm.gemm_add_rms_norm``) with
        ``norm_in_gemm`` where the projection runs on our split-K pointer GEMM, every program fits on the GPU at
        once and no L2 prefetch is asked for (that kernel has none); else the projection, then the norm kernel."""
        from loopbench.kernels import fused_ops as fo
        from loopbench.kernels import gemm_norm
        eps = self.cfg.rms_norm_eps
        gate_wb = (self.gate_w, self.gate_b) if gate else None
        cfg = self.norm_gemm_config(a, weight, gemm_rows, next_weight)
        if cfg is not None:
            out = gemm_norm.gemm_add_rms_norm(a, weight, cfg, x, w1, w2, eps, self._norm_counters, gate_wb)
        else:
            y = self._project(a, weight, gemm_rows, True, next_weight)
            out = fo.add_rms_norm_gate(x, y, w1, w2, eps, *gate_wb) if gate else fo.add_rms_norm(x, y, w1, w2, eps)
        return out if gate else (*out, None)

    def ring_on(self) -> bool:
        """Whether the layer half after attention runs as one persistent launch wherever it can (kernels/mlp_ring.py
        ``CONFIGS`` has this layer shape, our small-M GEMM runs, bf16 weights). Read at every loop: the table is a
        process-wide switch (empty by default; the throughput probe's ``--mlp-ring``)."""
        from loopbench.kernels import mlp_ring
        return (self.small_m_gemm and self.dtype == torch.bfloat16
                and (self.cfg.hidden_size, self.cfg.intermediate_size) in mlp_ring.CONFIGS)

    def ring_config(self, a: torch.Tensor, gemm_rows: int | None = None):
        """The RingConfig with which o_proj, its norm step, gate_up + SwiGLU, down and its norm step run as one
        launch (kernels/mlp_ring.py) on attention output ``a`` [N, H D] (a meta tensor will do), or None: the ring
        off (:meth:`ring_on`), rows in fixed-size calls, more than ``mlp_ring.MAX_M`` rows, or an L2 prefetch asked
        for one of those projections or the next qkv (that kernel has none). One per layer shape, never per M. An
        experiment (kernels/results/README.md, ``mlp_ring``): slower than the five launches it replaces, and its
        norm steps reduce in another order than fused_ops.add_rms_norm, so a run whose batches cross
        ``mlp_ring.MAX_M`` rows is not batch invariant with it on."""
        from loopbench.kernels import mlp_ring
        if not self.ring_on() or gemm_rows is not None or a.shape[0] > mlp_ring.MAX_M:
            return None
        if any(self.prefetch_next.get(t) for t in ("o_proj", "gate_up", "down", "qkv")):
            return None
        return mlp_ring.CONFIGS[(self.cfg.hidden_size, self.cfg.intermediate_size)]

    def norm_gemm_config(self, a: torch.Tensor, weight: torch.Tensor, gemm_rows: int | None = None,
                         next_weight: torch.Tensor | None = None):
        """The GemmConfig with which o_proj or down (``weight``, on rows ``a`` [N, K]; a meta tensor will do) runs
        its norm step in its own launch (``gemm_norm.gemm_add_rms_norm``), or None where it cannot: ``norm_in_gemm``
        off, not on our GEMM at these rows, a TMA or split_k 1 configuration, an L2 prefetch asked for
        (``next_weight``; that kernel has none), more rows than programs, or a grid larger than the SM count."""
        from loopbench.kernels import gemm, gemm_norm
        if not self.norm_in_gemm or next_weight is not None:
            return None
        cfg = self._fused_config(gemm.CONFIGS, gemm.FASTER_UP_TO, weight, a, gemm_rows)
        if cfg is None or cfg.tma or cfg.split_k < 2:
            return None
        programs = -(-weight.shape[0] // cfg.block_n) * cfg.split_k
        return cfg if a.shape[0] <= programs and gemm_norm.fits(self.device, cfg, weight.shape[0]) else None

    def _fused_config(self, configs: dict, faster_up_to: dict, w: torch.Tensor, x: torch.Tensor,
                      gemm_rows: int | None):
        """The GemmConfig of a fused projection kernel (``configs``: its per-weight-shape table,
        ``faster_up_to``: the most rows at which it was measured faster) for weight ``w`` at x's rows, or
        None: run it unfused (small-M GEMM off, rows in fixed-size calls, more rows than it wins at, another
        dtype, or a shape not measured)."""
        from loopbench.kernels import gemm
        if not (self.small_m_gemm and gemm_rows is None and x.dtype in gemm.DTYPES):
            return None
        return gemm.config_for(*w.shape, x.shape[0], configs, faster_up_to)

    def _project(self, x: torch.Tensor, w: torch.Tensor, gemm_rows: int | None, partials: bool = False,
                 next_weight: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T for the fused loop: our small-M GEMM (kernels/gemm.py, or kernels/wgmma_gemm.py where
        :meth:`wgmma_config` says) where it is measured faster for this weight shape and row count
        (``gemm.config_for``) and the rows run in one call, else :func:`linear` (cuBLAS). [N, out] in x's dtype,
        or with ``partials`` possibly the GEMM's fp32 split-K partials [S, N, out] (for ``fused_ops.add_rms_norm``,
        which sums them in order).
        ``next_weight``: a region our GEMM brings into L2 (:meth:`_prefetch_region`; cuBLAS ignores it)."""
        from loopbench.kernels import gemm, wgmma_gemm
        cfg = self._fused_config(gemm.CONFIGS, gemm.FASTER_UP_TO, w, x, gemm_rows)
        if cfg is None:
            if gemm_rows is not None and self.prefill_gemm_on():
                from loopbench.kernels import prefill_gemm
                return prefill_gemm.prefill_gemm(x, w)
            return linear(x, w, gemm_rows)
        wg = self._wgmma_where_fused(x, w, next_weight, wgmma_gemm.CONFIGS)      # cfg: it runs on our GEMM
        if wg is not None:
            out = wgmma_gemm.gemm(x, w, wg)
            return out if partials or wg.split_k == 1 else gemm.reduce_partials(out, x.dtype)
        out = gemm.gemm(x, w, cfg, next_weight)
        return out if partials or cfg.split_k == 1 else gemm.reduce_partials(out, x.dtype)

    def prefill_gemm_on(self) -> bool:
        """Whether batch-invariant prefill projections run in one launch of kernels/prefill_gemm.py (``prefill_gemm``
        asked for, the fused loop on CUDA) rather than as cuBLAS calls of exactly gemm_rows rows."""
        return self.prefill_gemm and self.fused and self.device.type == "cuda"

    def _prefetch_region(self, target: str, w: torch.Tensor) -> torch.Tensor | None:
        """The first ``prefetch_next[target]`` of the K columns of every row of ``w``, rounded up to whole
        128-byte lines (a view), or None where that target is not asked for. Where ``w``'s own small-M GEMM
        configuration splits K into equal ranges (o_proj and down), the first fraction of each split's range
        instead (a ``[rows * split_k, cols]`` view), so every program of that GEMM finds its first K tiles in L2,
        not only the first split's."""
        fraction = self.prefetch_next.get(target)
        if fraction is None:
            return None
        from loopbench.kernels import gemm
        cfg = gemm.CONFIGS.get(tuple(w.shape))
        n, k = w.shape
        split = cfg.split_k if cfg is not None else 1
        if split > 1 and k % (cfg.block_k * split) == 0:           # split s covers columns s k / split ...
            w, k = w.view(n * split, k // split), k // split
        cols = min(k, math.ceil(fraction * k / 64) * 64)
        return w[:, :cols]

    def hazard(self, x: torch.Tensor) -> torch.Tensor:
        """h = sigmoid(early_exit_gate(x)): [N] in fp32 (fp64 for an fp64 model). x: [N, hidden]."""
        logit = F.linear(x, self.gate_w, self.gate_b)[:, 0]
        return torch.sigmoid(logit.to(self.rope_dtype))

    def greedy_partials(self, x: torch.Tensor):
        """lm_head with greedy sampling's first pass in its epilogue, without writing the logits
        (``gemm.gemm_argmax``): a ``gemm.TileArgmax`` of x's N rows, whose token is bitwise
        ``logits(x).argmax(-1)`` (NaN counted as the largest); None where lm_head does not run on our GEMM at N
        rows, its configuration splits K, or ``greedy_tiles`` is off (then use :meth:`logits`). x: [N, hidden]
        model dtype."""
        from loopbench.kernels import gemm
        cfg = self.greedy_tiles_config(x.shape[0])
        return None if cfg is None else gemm.gemm_argmax(x, self.lm_head, cfg)[0]

    def greedy_tiles_config(self, rows: int):
        """lm_head's ``gemm.GemmConfig`` where :meth:`greedy_partials` samples from its tiles at ``rows`` rows:
        ``greedy_tiles`` on, our small-M GEMM, a configuration for lm_head's shape at these rows that does not
        split K; else None."""
        from loopbench.kernels import gemm
        if not (self.greedy_tiles and self.small_m_gemm and self.dtype in gemm.DTYPES):
            return None
        cfg = gemm.config_for(*self.lm_head.shape, rows)
        return cfg if cfg is not None and cfg.split_k == 1 else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head on the rows given: every row of a decode step (runtime/runner.py ``decode_core``, exiting or
        not, padding included; where :meth:`greedy_partials` does not run instead), or a prefill loop's final prompts'
        last rows (batch-invariant: the last of them repeated to ``max_num_seqs`` rows). x: [N, hidden] -> [N, vocab]
        model dtype."""
        if self.fused:
            return self._project(x, self.lm_head, None)
        return F.linear(x, self.lm_head)
