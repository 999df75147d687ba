"""Seeded synthetic Ouro checkpoints in the exact HF layout, with an exit gate calibrated on the model.

Synthetic checkpoints stand in for real weights wherever none are present (BRIEF section 4): they have
the exact HF layout the loader (``loopbench.runtime.checkpoint``) reads, are a pure function of
(config, seed, dtype), and are initialised so that a forward pass stays O(1) and the exit gate gives a
chosen three-/four-loop mix (``gate_bias_for_mix``).

``write_synthetic_checkpoint`` picks the gate bias analytically, assuming the loop-1 and loop-2 gate
logits are independent N(b, sigma^2); on real synthetic models they are correlated (0.5-0.7 on the
tiny preset) and the resulting three-loop share ranged from 0.62 to 0.77 over seeds. This module measures
instead: it runs the first two loops of the written model over seeded random prompts (full-depth causal
attention, which is exactly what a decode token sees at depths 1 and 2, because under ``ouro_delayed``
min 2 every earlier token exits at depth >= 3 and so is read from planes 1 and 2 unaliased), collects
``w . x_1`` and ``w . x_2`` per position, solves for the bias that gives the target share with
``gate_bias_for_observed_mix`` and rewrites the checkpoint with it. On the tiny preset the engine's
natural decode mix then lands near 0.70 three-loop (target 0.75; generated tokens are not random
prompts, so the match is approximate, as "about 3/4" in BRIEF section 1 allows).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from loopbench.kernels.prefill_attention import prefill_attention
from loopbench.runtime.checkpoint import (CONFIG_NAME, DTYPE_HF_NAMES, HF_DTYPE_NAMES, INDEX_NAME,
                                          SINGLE_FILE_NAME, is_int, is_number, load_checkpoint)
from loopbench.runtime.model import PRESETS, OuroConfig, OuroModel, tensor_shapes

from .progress import mib, say

GATE_SIGMA = 0.5              # std of the gate logit w.x over tokens, x = normed state (RMS ~ 1)
THREE_LOOP_FRACTION = 0.75    # target share of 3-loop tokens under ouro_delayed 0.5/min2/max4
NORM_NOISE_STD = 0.02         # norm weights = 1 + N(0, NORM_NOISE_STD^2)
LOGIT_STD = 2.0               # lm_head scaled so greedy logits are ~N(0, LOGIT_STD^2)
CALIBRATION_FILE = "loopbench_calibration.json"


def hf_config_dict(cfg: OuroConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The ``config.json`` contents for ``cfg`` in the official Ouro layout (``torch_dtype`` = ``dtype``)."""
    if dtype not in DTYPE_HF_NAMES:
        raise ValueError(f"dtype must be one of {sorted(HF_DTYPE_NAMES)}, got {dtype}")
    return {
        **cfg.to_dict(),
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "torch_dtype": DTYPE_HF_NAMES[dtype],
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_hidden_layers,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
    }


# ----------------------------------------------------------------------------------- exit-gate calibration

def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def three_loop_fraction(bias: float, sigma: float = GATE_SIGMA, *, exit_threshold: float = 0.5,
                        grid_points: int = 1201) -> float:
    """P[exit depth 3] under ouro_delayed (threshold ``exit_threshold``, min 2, max 4) for gate logits
    z_1, z_2 iid N(bias, sigma^2): ``P[(1 - sigmoid(z_1)) (1 - sigmoid(z_2)) <= 1 - exit_threshold]``.

    Derivation in ``gate_bias_for_mix``; evaluated as a 1-D integral over z_1 (trapezoid on
    bias +- 12 sigma, ``grid_points`` nodes; converged to ~1e-12 already at 201 nodes).
    """
    if not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"sigma must be a positive finite number, got {sigma!r}")
    if not 0.0 < exit_threshold < 1.0:
        raise ValueError(f"exit_threshold must be in (0, 1), got {exit_threshold!r}")
    q = 1.0 - exit_threshold
    lo, hi = bias - 12.0 * sigma, bias + 12.0 * sigma
    step = (hi - lo) / (grid_points - 1)
    total = 0.0
    for k in range(grid_points):
        z1 = lo + k * step
        s1 = 1.0 / (1.0 + math.exp(z1)) if z1 < 700 else 0.0   # 1 - h_1 = sigmoid(-z_1)
        if s1 <= q:
            p2 = 1.0                                             # triggers whatever h_2 is
        else:
            c = math.log((s1 - q) / q)                           # need z_2 >= c
            p2 = _normal_cdf((bias - c) / sigma)
        weight = 0.5 if k in (0, grid_points - 1) else 1.0
        total += weight * p2 * math.exp(-0.5 * ((z1 - bias) / sigma) ** 2)
    return total * step / (sigma * math.sqrt(2.0 * math.pi))


@functools.lru_cache(maxsize=64)
def gate_bias_for_mix(target_three_loop_fraction: float = THREE_LOOP_FRACTION, sigma: float = GATE_SIGMA,
                      *, exit_threshold: float = 0.5) -> float:
    """Exit-gate bias b giving a target share of 3-loop tokens under ``ouro_delayed`` 0.5 / min 2 / max 4.

    Rule (BRIEF section 1): hazard h_r = sigmoid(w . x_r + b) after loop r, survival
    S_r = prod_{i<=r} (1 - h_i). With min_loops 2 the first possible trigger is r = 2; it fires iff
    1 - S_2 >= threshold, and ouro_delayed then exits one loop later, at depth 3. Otherwise any later
    trigger (r = 3) or the cap (r = 4 = max_loops) exits at depth 4. Hence
    ``P[depth 3] = P[(1 - h_1)(1 - h_2) <= 1 - threshold]``; every token runs 3 or 4 loops.

    Model of the logits: x_r is the final-normed state (RMS ~ 1, so |x_r| ~ sqrt(hidden)) and the
    synthetic gate weight has norm exactly ``sigma`` (w = sigma u / |u|, u ~ N(0, I)), so over tokens
    z_r = w . x_r + b ~ N(b, sigma^2); z_1 and z_2 are *assumed independent* (loops decorrelate the
    state; the true correlation is for the runtime to measure, then re-target with this function).

    Solving: condition on z_1 and put s_1 = 1 - h_1 = sigmoid(-z_1), q = 1 - threshold. If s_1 <= q the
    test passes for any z_2. Otherwise it needs sigmoid(-z_2) <= q / s_1, i.e.
    z_2 >= c(z_1) = log((s_1 - q) / q), with probability Phi((b - c) / sigma). So
    ``P3(b) = E_{z_1 ~ N(b, sigma^2)}[Phi((b - c(z_1)) / sigma)]`` (``three_loop_fraction``), strictly
    increasing in b; b is found by bisection on [-40, 40] to 1e-10.

    With the defaults (sigma = 0.5, target 0.75, threshold 0.5): b ~= -0.6827 (``GATE_SIGMA``,
    ``THREE_LOOP_FRACTION``). For reference, fully correlated logits (z_1 = z_2) would need
    b = logit(1 - sqrt(q)) + sigma Phi^-1(target) ~= -0.54 instead.
    """
    if not 0.0 < target_three_loop_fraction < 1.0:
        raise ValueError(f"target_three_loop_fraction must be in (0, 1), got {target_three_loop_fraction!r}")
    lo, hi = -40.0, 40.0
    while hi - lo > 1e-10:
        mid = 0.5 * (lo + hi)
        if three_loop_fraction(mid, sigma, exit_threshold=exit_threshold) < target_three_loop_fraction:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def gate_bias_for_observed_mix(gate_dot_loop1: torch.Tensor, gate_dot_loop2: torch.Tensor,
                               target_three_loop_fraction: float = THREE_LOOP_FRACTION, *,
                               exit_threshold: float = 0.5) -> float:
    """Re-calibration from measured states: the bias b giving the target 3-loop share on these tokens.

    gate_dot_loop1, gate_dot_loop2: [N] float, ``w . x_r`` (the gate logit *without* its bias) of the
    same N tokens after loops 1 and 2. Drops the independence and N(0, sigma^2) assumptions of
    ``gate_bias_for_mix``: the share of tokens with ``(1 - sigmoid(u_1 + b))(1 - sigmoid(u_2 + b)) <=
    1 - exit_threshold`` is non-decreasing in b; bisection on [-40, 40] returns (to 1e-9) the smallest b
    whose share reaches the target (granularity 1/N).
    """
    u1, u2 = gate_dot_loop1.detach().double().flatten(), gate_dot_loop2.detach().double().flatten()
    if u1.shape != u2.shape or u1.numel() == 0:
        raise ValueError(f"need two equal-length non-empty logit vectors, got {tuple(u1.shape)} and {tuple(u2.shape)}")
    if not 0.0 < target_three_loop_fraction < 1.0:
        raise ValueError(f"target_three_loop_fraction must be in (0, 1), got {target_three_loop_fraction!r}")
    log_q = math.log(1.0 - exit_threshold)

    def share(b: float) -> float:
        log_survival = F.logsigmoid(-(u1 + b)) + F.logsigmoid(-(u2 + b))
        return (log_survival <= log_q).double().mean().item()

    lo, hi = -40.0, 40.0
    while hi - lo > 1e-9:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if share(mid) < target_three_loop_fraction else (lo, mid)
    return hi


# ------------------------------------------------------------------------------- synthetic checkpoints

def _tensor_seed(seed: int, name: str) -> int:
    # One generator per tensor, keyed by (seed, name): values do not depend on order or sharding.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _synthetic_tensor(name: str, shape: tuple[int, ...], seed: int, gate_bias: float,
                      gate_sigma: float) -> torch.Tensor:
    """One fp32 CPU tensor of the synthetic init (see ``write_synthetic_checkpoint``)."""
    g = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
    if name == "model.early_exit_gate.bias":
        return torch.full(shape, gate_bias, dtype=torch.float32)
    t = torch.randn(shape, generator=g, dtype=torch.float32)
    if "norm" in name.split(".")[-2]:   # input_/post_attention_layernorm(_2), model.norm
        return t.mul_(NORM_NOISE_STD).add_(1.0)
    if name == "model.embed_tokens.weight":
        return t
    if name == "model.early_exit_gate.weight":
        return t.mul_(gate_sigma / t.norm())
    if name == "lm_head.weight":
        return t.mul_(LOGIT_STD / math.sqrt(shape[1]))
    return t.mul_(1.0 / math.sqrt(shape[1]))   # projections: [out, in], std 1/sqrt(fan_in)


def plan_shards(cfg: OuroConfig, dtype: torch.dtype, max_shard_bytes: int | None) -> list[list[str]]:
    """Tensor names per output file, in ``tensor_shapes`` order, greedily packed to <= max_shard_bytes
    (a tensor larger than the limit gets a file of its own); one file when ``max_shard_bytes`` is None."""
    shapes = tensor_shapes(cfg)
    if max_shard_bytes is None:
        return [list(shapes)]
    if not is_int(max_shard_bytes) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive integer or None, got {max_shard_bytes!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def config_of(preset_or_config: str | OuroConfig) -> OuroConfig:
    """A preset's OuroConfig (ValueError naming an unknown preset), or the OuroConfig given."""
    if isinstance(preset_or_config, str):
        if preset_or_config not in PRESETS:
            raise ValueError(f"unknown preset {preset_or_config!r}; known: {sorted(PRESETS)}")
        return PRESETS[preset_or_config]
    if isinstance(preset_or_config, OuroConfig):
        return preset_or_config
    raise TypeError(f"preset_or_config must be a preset name or an OuroConfig, got {preset_or_config!r}")


def _write_shards(out: Path, cfg: OuroConfig, shards: list[list[str]], single: bool, seed: int, dtype: torch.dtype,
                  gate_bias: float, gate_sigma: float) -> tuple[dict[str, str], int]:
    """Generate and write each shard's tensors (one file at a time); returns (weight map, total bytes)."""
    shapes = tensor_shapes(cfg)
    # One metadata key only: safetensors keeps metadata in a hash map, so with several keys the header
    # order (and the file bytes) would vary from run to run.
    metadata = {"format": "pt"}
    n = len(shards)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for k, names in enumerate(shards, start=1):
        file_name = SINGLE_FILE_NAME if n == 1 and single else f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for name in names:
            tensors[name] = _synthetic_tensor(name, shapes[name], seed, gate_bias, gate_sigma).to(dtype)
            total_bytes += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = file_name
        save_file(tensors, out / file_name, metadata=metadata)
        say("checkpoint", f"{out.name}/{file_name}: {len(names)} tensors, {mib(total_bytes)} written so far")
        del tensors
    return weight_map, total_bytes


def write_synthetic_checkpoint(path: str | Path, preset_or_config: str | OuroConfig, *, seed: int = 0,
                               dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int | None = None,
                               three_loop_fraction_target: float = THREE_LOOP_FRACTION,
                               gate_sigma: float = GATE_SIGMA, gate_bias: float | None = None) -> Path:
    """Write a seeded synthetic Ouro checkpoint in the exact HF layout; returns the directory.

    Layout: ``config.json`` (``hf_config_dict``: the OuroConfig keys plus architectures
    ["OuroForCausalLM"], model_type "ouro", torch_dtype, ...), and either one ``model.safetensors`` or,
    with ``max_shard_bytes``, ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
    Every tensor of ``tensor_shapes(cfg)``, in ``dtype``.

    Determinism: tensor ``name`` is drawn from its own CPU ``torch.Generator`` seeded by
    sha256(f"{seed}:{name}"), in fp32, then cast; so the values depend only on (config, seed, dtype),
    not on sharding. Tensors are generated one at a time and each file is written as soon as its tensors
    exist, so peak extra memory is about one output file (the whole model when unsharded: ~2.9 GB for
    ouro-1.4b in bf16).

    Init (keeps a forward pass O(1); the sandwich norms renormalise every sublayer output anyway):
      * projections [out, in] ~ N(0, 1/in): unit-RMS inputs give unit-variance outputs;
      * every norm weight = 1 + N(0, NORM_NOISE_STD^2);
      * embed_tokens ~ N(0, 1);
      * lm_head ~ N(0, LOGIT_STD^2 / hidden): logits of a normed state ~ N(0, LOGIT_STD^2), so greedy
        tokens vary with the state;
      * early_exit_gate.weight = gate_sigma u / |u| (u ~ N(0, I)), bias = ``gate_bias_for_mix(
        three_loop_fraction_target, gate_sigma)``: ~3/4 three-loop tokens under ouro_delayed 0.5/2/4
        if the loop logits are independent (see ``gate_bias_for_mix``); ``gate_bias`` overrides it with a
        value calibrated on measured states (``gate_bias_for_observed_mix``).

    Raises ValueError for an unknown preset, a non-floating dtype, a bad shard size, or a ``path`` that
    exists and is not an empty directory.
    """
    cfg = config_of(preset_or_config)
    if dtype not in DTYPE_HF_NAMES:
        raise ValueError(f"dtype must be a floating dtype in {sorted(HF_DTYPE_NAMES)}, got {dtype}")
    if not is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory; refusing to overwrite")
    shards = plan_shards(cfg, dtype, max_shard_bytes)
    if gate_bias is None:
        gate_bias = gate_bias_for_mix(three_loop_fraction_target, gate_sigma)
    elif not is_number(gate_bias):
        raise ValueError(f"gate_bias must be a finite number or None, got {gate_bias!r}")
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total_bytes = _write_shards(out, cfg, shards, max_shard_bytes is None, seed, dtype, gate_bias, gate_sigma)
    if max_shard_bytes is not None:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # config.json last: an interrupted write leaves a directory the loader refuses ("missing config.json").
    (out / CONFIG_NAME).write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2, sort_keys=True) + "\n",
                                   encoding="utf-8")
    return out


# ------------------------------------------------------------------------- calibration on the model


@torch.no_grad()
def measure_gate_dots(model: OuroModel, *, num_prompts: int = 4, prompt_len: int = 64, seed: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w . x_r`` (gate logit without bias) for r = 1, 2 at every position of seeded random prompts.

    Returns two [num_prompts * prompt_len] fp64 CPU tensors.
    """
    g = torch.Generator().manual_seed(seed)
    dots = ([], [])
    positions = torch.arange(prompt_len, device=model.device)
    for _ in range(num_prompts):
        ids = torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=g).to(model.device)
        x = model.embed[ids]
        for r in range(2):
            x, _ = model.run_loop(x, positions, lambda layer, q, k, v: prefill_attention(q, k, v))
            dots[r].append((x.double() @ model.gate_w[0].double()).cpu())
    return torch.cat(dots[0]), torch.cat(dots[1])


def write_calibrated_checkpoint(path: str | Path, preset: str, *, seed: int = 0,
                                dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                                target_three_loop_fraction: float = THREE_LOOP_FRACTION,
                                max_shard_bytes: int | None = None) -> Path:
    """Write a synthetic checkpoint, measure its gate logits on ``device`` and rewrite it with the
    calibrated bias. The bias and the measurement are recorded in ``loopbench_calibration.json``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    say("checkpoint", f"synthesizing {preset} (seed {seed}, {dtype}) into {path.parent}: uncalibrated weights first")
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".uncalibrated-") as tmp:
        write_synthetic_checkpoint(Path(tmp) / "ckpt", preset, seed=seed, dtype=dtype)
        cfg, tensors = load_checkpoint(Path(tmp) / "ckpt")
        calc_dtype = torch.float32 if torch.device(device).type == "cpu" else dtype
        model = OuroModel.from_tensors(cfg, tensors, device=device, dtype=calc_dtype, rope_len=256)
        del tensors
        say("calibration", f"measuring the exit gate's logits on loop-1/2 states ({device})")
        u1, u2 = measure_gate_dots(model, seed=seed)
        del model
    bias = gate_bias_for_observed_mix(u1, u2, target_three_loop_fraction)
    say("calibration", f"gate bias {bias:+.4f}; writing the calibrated weights")
    write_synthetic_checkpoint(path, preset, seed=seed, dtype=dtype, max_shard_bytes=max_shard_bytes,
                               gate_bias=bias)
    record = {"preset": preset, "seed": seed, "gate_bias": bias, "target_three_loop_fraction":
              target_three_loop_fraction, "positions_measured": int(u1.numel()),
              "loop1_loop2_correlation": float(torch.corrcoef(torch.stack([u1, u2]))[0, 1])}
    (path / CALIBRATION_FILE).write_text(json.dumps(record, indent=1))
    return path
