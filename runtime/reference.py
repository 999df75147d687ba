"""The naive reference generator: one request at a time, dense per-plane KV, plain Python loops.

It is slow and obvious on purpose, and shares with the engine only the model's weight tensors and the
small numeric primitives (RMSNorm, rotary tables). No batching, no paging, no fused projections, no
vectorised exit rule. LAST_EXITED (BRIEF section 1): a query at depth d reads earlier position q from
plane ``min(d, e_q)``; prompt positions exit at ``max_loops``; the exit rule is written out per token.
Tests hold the engine to it token for token and exit for exit.

:class:`ReferenceEngine` puts the same generator behind the ``Engine`` protocol (runtime/api.py), so the
benchmark can run it as an arm (``engine: loopbench.runtime.reference:make_engine``). It steps requests
as the engine's scheduler does (FIFO admission into ``max_num_seqs`` slots; per step one full-prompt loop
per prefilling request and one loop per decode row), so its work counters are the engine's; every row
is still computed alone by :class:`NaiveOuro`. It keeps no row trace, no KV pool and no graphs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .api import EngineConfig, EngineStats, Request, RequestOutput
from .model import OuroConfig, OuroModel, apply_rope, rms_norm, rope_tables
from .schedule import Schedule


def exit_decision(policy: str, d: int, survival: float, triggered: bool, *, min_loops: int, max_loops: int,
                  threshold: float, forced: int | None = None) -> tuple[bool, bool]:
    """(stop after loop ``d``, triggered) of one token, written out per policy (BRIEF section 1);
    ``survival`` is prod(1 - h_i) over loops 1..d, ``forced`` the replayed exit depth."""
    test = threshold < 1.0 and d >= min_loops and 1.0 - survival >= threshold
    if policy == "replay":
        return d == forced, triggered
    if policy == "fixed":
        return d >= max_loops, triggered
    if policy == "ouro":
        return d >= max_loops or test, triggered
    if policy == "ouro_delayed":
        return d >= max_loops or triggered, triggered or test
    raise ValueError(f"unknown policy {policy!r}")


@dataclass
class NaiveState:
    """One request's generation: per-plane KV (depth -> layer -> position -> (k, v)), exits so far."""

    prompt: list[int]
    max_loops: int
    planes: dict[int, list[dict]]
    x: torch.Tensor                   # the current loop's rows: [T, hidden] in prefill, [1, hidden] in decode
    depth: int = 0                    # loops run for the current rows
    exits_of: list[int] = field(default_factory=list)   # e_q per position, once the prompt has run
    tokens: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    survival: float = 1.0
    triggered: bool = False

    @property
    def prefilling(self) -> bool:
        return not self.tokens


class NaiveOuro:
    """Per-request Ouro generation from an HF-layout tensor dict."""

    def __init__(self, cfg: OuroConfig, tensors: dict[str, torch.Tensor], *, dtype=torch.float64, device="cpu"):
        self.cfg = cfg
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        self.acc = torch.promote_types(dtype, torch.float32)
        self.cos, self.sin = rope_tables(cfg, cfg.max_position_embeddings, device, self.acc)

    def _loop(self, x, positions, kv_plane, reads):
        """One loop for rows ``x`` [T, hidden] at ``positions``; fresh K/V go into ``kv_plane[layer]``
        (a dict position -> (k, v)); ``reads(layer, p)`` gives the key positions' (k, v) for row p."""
        cfg, w = self.cfg, self.w
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = apply_rope(F.linear(h, w[p + "self_attn.q_proj.weight"]).view(-1, H, D), cos, sin)
            k = apply_rope(F.linear(h, w[p + "self_attn.k_proj.weight"]).view(-1, Hkv, D), cos, sin)
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(-1, Hkv, D)
            for j, pos in enumerate(positions.tolist()):
                kv_plane[i][pos] = (k[j], v[j])
            outs = []
            for j, pos in enumerate(positions.tolist()):
                keys, vals = zip(*reads(i, pos))
                K = torch.stack(keys).to(self.acc)                         # [ctx, Hkv, D]
                V = torch.stack(vals).to(self.acc)
                K = K.repeat_interleave(H // Hkv, dim=1)
                V = V.repeat_interleave(H // Hkv, dim=1)
                s = torch.einsum("hd,khd->hk", q[j].to(self.acc), K) / math.sqrt(D)
                outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), V).to(x.dtype))
            a = torch.stack(outs).reshape(-1, H * D)
            x = x + rms_norm(F.linear(a, w[p + "self_attn.o_proj.weight"]), w[p + "input_layernorm_2.weight"],
                             cfg.rms_norm_eps)
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            m = F.linear(F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"]),
                         w[p + "mlp.down_proj.weight"])
            x = x + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], cfg.rms_norm_eps)
        return rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)

    def _hazard(self, x) -> float:
        logit = F.linear(x, self.w["model.early_exit_gate.weight"], self.w["model.early_exit_gate.bias"])
        return float(torch.sigmoid(logit.to(self.acc)).reshape(()))

    def _token(self, x) -> int:
        head = self.w["model.embed_tokens.weight"] if self.cfg.tie_word_embeddings else self.w["lm_head.weight"]
        return int(F.linear(x.reshape(1, -1), head).argmax(-1))

    def start(self, prompt: list[int], max_loops: int) -> NaiveState:
        """A request before its first loop: the prompt's embeddings, empty planes 1..max_loops."""
        planes = {d: [dict() for _ in range(self.cfg.num_hidden_layers)] for d in range(1, max_loops + 1)}
        return NaiveState(list(prompt), max_loops, planes, self.w["model.embed_tokens.weight"][torch.tensor(prompt)])

    def prefill_loop(self, st: NaiveState) -> None:
        """The next full-prompt loop; after loop ``max_loops`` the first token is sampled (it exits there)."""
        d = st.depth = st.depth + 1
        st.x = self._loop(st.x, torch.arange(len(st.prompt)), st.planes[d],
                          lambda i, p, d=d: [st.planes[d][i][q] for q in range(p + 1)])
        if d == st.max_loops:
            st.exits_of = [st.max_loops] * len(st.prompt)
            self._emit(st)

    def decode_loop(self, st: NaiveState) -> float:
        """The next loop of the token at position ``len(exits_of)``; returns that loop's hazard."""
        d = st.depth = st.depth + 1
        p, exits_of = len(st.exits_of), st.exits_of
        reads = lambda i, pos, d=d: [st.planes[min(d, exits_of[q]) if q < pos else d][i][q] for q in range(pos + 1)]
        st.x = self._loop(st.x, torch.tensor([p]), st.planes[d], reads)
        return self._hazard(st.x)

    def exit_token(self, st: NaiveState) -> None:
        """The decoding token exits at the current depth: record it, sample, start the next token."""
        st.exits_of.append(st.depth)
        self._emit(st)

    def _emit(self, st: NaiveState) -> None:
        st.tokens.append(self._token(st.x[-1]))
        st.exit_depths.append(st.depth)
        st.x = self.w["model.embed_tokens.weight"][st.tokens[-1]].reshape(1, -1)
        st.depth, st.survival, st.triggered = 0, 1.0, False

    def generate(self, prompt: list[int], max_tokens: int, *, policy: str = "fixed", min_loops: int = 1,
                 max_loops: int = 4, threshold: float = 1.0, forced_exits: list[int] | None = None,
                 eos_token_id: int | None = None) -> tuple[list[int], list[int]]:
        """Greedy generation. Returns (output token ids, exit depth of each output token)."""
        st = self.start(prompt, max_loops)
        while st.prefilling:
            self.prefill_loop(st)
        while len(st.tokens) < max_tokens and not (eos_token_id is not None and st.tokens[-1] == eos_token_id):
            while True:
                st.survival *= 1.0 - self.decode_loop(st)
                stop, st.triggered = exit_decision(
                    policy, st.depth, st.survival, st.triggered, min_loops=min_loops, max_loops=max_loops,
                    threshold=threshold, forced=forced_exits[len(st.tokens)] if policy == "replay" else None)
                if stop:
                    break
            self.exit_token(st)
        return st.tokens, st.exit_depths


def hf_tensors(model: OuroModel) -> dict[str, torch.Tensor]:
    """The HF-layout tensor dict of an ``OuroModel`` (its fused qkv and gate_up split back; views)."""
    cfg = model.cfg
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm,
           "model.early_exit_gate.weight": model.gate_w, "model.early_exit_gate.bias": model.gate_b}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head
    for i, w in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = w.qkv.split([H * D, Hkv * D, Hkv * D])
        gate, up = w.gate_up.chunk(2)
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": w.o,
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": w.down,
                    p + "input_layernorm.weight": w.ln_in, p + "input_layernorm_2.weight": w.ln_in2,
                    p + "post_attention_layernorm.weight": w.ln_post,
                    p + "post_attention_layernorm_2.weight": w.ln_post2})
    return out


@dataclass
class _Slot:
    req: Request
    state: NaiveState
    forced: tuple[int, ...] | None    # the schedule's exit depths under replay


class ReferenceEngine:
    """:class:`NaiveOuro` behind the ``Engine`` protocol, stepped as the engine schedules (module docstring).

    Accepts the ``EngineConfig`` fields that change what is computed (``max_num_seqs``, ``max_model_len``,
    ``exit_policy``, ``schedule``, ``eos_token_id``); layout, backend, graph and descriptor settings
    describe how an optimised engine computes the same values and are ignored here.
    """

    def __init__(self, naive: NaiveOuro, config: EngineConfig):
        self.naive, self.config = naive, config
        self.stats = EngineStats(rows_per_depth=[0] * naive.cfg.total_ut_steps)
        self._queue: list[Request] = []
        self._slots: list[_Slot | None] = [None] * config.max_num_seqs
        self._finished: dict[str, RequestOutput] = {}
        self._ids: set[str] = set()

    def add_request(self, request: Request) -> None:
        """Queue a request (FIFO). ValueError names the offending field."""
        if request.request_id in self._ids:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        if not 1 <= request.min_loops <= request.max_loops <= self.naive.cfg.total_ut_steps:
            raise ValueError(f"request {request.request_id!r}: need 1 <= min_loops <= max_loops <= total_ut_steps")
        need = len(request.prompt_token_ids) + request.max_tokens - 1
        if need > self.config.max_model_len:
            raise ValueError(f"request {request.request_id!r}: prompt + max_tokens - 1 = {need} positions exceed "
                             f"max_model_len={self.config.max_model_len}")
        if self.config.schedule is not None:
            self.config.schedule.check_fits(request)
        self._ids.add(request.request_id)
        self._queue.append(request)

    def abort(self, request_id: str) -> None:
        for i, r in enumerate(self._queue):
            if r.request_id == request_id:
                del self._queue[i]
                self._finished[request_id] = RequestOutput(request_id, (), (), "abort")
                return
        for s, slot in enumerate(self._slots):
            if slot is not None and slot.req.request_id == request_id:
                self._finish(s, "abort")
                return
        raise ValueError(f"unknown or finished request {request_id!r}")

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; returns all outputs."""
        while self._queue or any(s is not None for s in self._slots):
            self.step()
        return dict(self._finished)

    def step(self) -> None:
        """Admit into free slots, one loop per prefilling request, one loop per decode row (those decoding
        when the step began, in slot order)."""
        decoding = [i for i, s in enumerate(self._slots) if s is not None and not s.state.prefilling]
        for i in range(len(self._slots)):
            if self._queue and self._slots[i] is None:
                req = self._queue.pop(0)
                entry = self.config.schedule.check_fits(req) if self.config.schedule is not None else None
                self._slots[i] = _Slot(req, self.naive.start(req.prompt_token_ids, req.max_loops),
                                       entry.exit_depths if entry is not None else None)
                self.stats.prefill_tokens += len(req.prompt_token_ids)
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.state.prefilling:
                self.naive.prefill_loop(slot.state)
                self.stats.prefill_rows += len(slot.req.prompt_token_ids)
                if not slot.state.prefilling:
                    self._after_token(i)
        for i in decoding:
            self._decode_row(i)
        if decoding:
            self.stats.decode_steps += 1
        self.stats.steps += 1

    def _decode_row(self, i: int) -> None:
        slot = self._slots[i]
        st, req = slot.state, slot.req
        st.survival *= 1.0 - self.naive.decode_loop(st)
        self.stats.rows_per_depth[st.depth - 1] += 1
        stop, st.triggered = exit_decision(
            self.config.exit_policy, st.depth, st.survival, st.triggered, min_loops=req.min_loops,
            max_loops=req.max_loops, threshold=req.exit_threshold,
            forced=slot.forced[len(st.tokens)] if slot.forced is not None else None)
        if stop:
            self.naive.exit_token(st)
            self.stats.decode_tokens += 1
            self._after_token(i)

    def _after_token(self, i: int) -> None:
        slot = self._slots[i]
        n_out, eos = len(slot.state.tokens), self.config.eos_token_id
        if n_out >= slot.req.max_tokens:
            self._finish(i, "length")
        elif slot.forced is None and not slot.req.ignore_eos and eos is not None and slot.state.tokens[-1] == eos:
            self._finish(i, "stop")
        elif slot.forced is not None and n_out >= len(slot.forced):
            self._finish(i, "stop")     # the natural run stopped here (EOS) and the replay follows it

    def _finish(self, i: int, reason: str) -> None:
        slot = self._slots[i]
        self._finished[slot.req.request_id] = RequestOutput(slot.req.request_id, tuple(slot.state.tokens),
                                                            tuple(slot.state.exit_depths), reason)
        self._slots[i] = None

    def reset_run(self) -> None:
        """Forget finished requests so the same ids can run again; the cumulative ``stats`` stay."""
        if self._queue or any(s is not None for s in self._slots):
            raise RuntimeError("reset_run needs a drained engine")
        self._finished.clear()
        self._ids.clear()

    @property
    def trace_sha256(self) -> None:
        """None: this engine keeps no row trace."""
        return None

    def capture_schedule(self) -> Schedule:
        raise NotImplementedError("the reference engine keeps no row trace, so it cannot freeze a schedule; "
                                  "capture the reference with the default engine")


def make_engine(model: OuroModel, config: EngineConfig) -> ReferenceEngine:
    """The ``Engine`` factory of the reference generator (an arm's ``engine`` key): it computes in the
    model's own dtype and device (float64 on the CPU for token equality with the engine, BRIEF section 5)."""
    return ReferenceEngine(NaiveOuro(model.cfg, hf_tensors(model), dtype=model.dtype, device=model.device), config)
