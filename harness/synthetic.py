"""Seeded synthetic Ouro checkpoints whose exit gate is calibrated on the model's own states.

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

import json
import tempfile
from pathlib import Path

import torch

from loopbench.kernels.prefill_attention import prefill_attention

from .checkpoint import (THREE_LOOP_FRACTION, gate_bias_for_observed_mix, load_checkpoint,
                         write_synthetic_checkpoint)
from .model import OuroModel

CALIBRATION_FILE = "loopbench_calibration.json"


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
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".uncalibrated-") as tmp:
        write_synthetic_checkpoint(Path(tmp) / "ckpt", preset, seed=seed, dtype=dtype)
        cfg, tensors = load_checkpoint(Path(tmp) / "ckpt")
        calc_dtype = torch.float32 if torch.device(device).type == "cpu" else dtype
        model = OuroModel.from_tensors(cfg, tensors, device=device, dtype=calc_dtype, rope_len=256)
        del tensors
        u1, u2 = measure_gate_dots(model, seed=seed)
        del model
    bias = gate_bias_for_observed_mix(u1, u2, target_three_loop_fraction)
    write_synthetic_checkpoint(path, preset, seed=seed, dtype=dtype, max_shard_bytes=max_shard_bytes,
                               gate_bias=bias)
    record = {"preset": preset, "seed": seed, "gate_bias": bias, "target_three_loop_fraction":
              target_three_loop_fraction, "positions_measured": int(u1.numel()),
              "loop1_loop2_correlation": float(torch.corrcoef(torch.stack([u1, u2]))[0, 1])}
    (path / CALIBRATION_FILE).write_text(json.dumps(record, indent=1))
    return path
