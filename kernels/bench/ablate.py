"""Diagnostic, wrong results: what a decode step's norm launches or attention launches cost the loop, as an upper
bound on what folding or speeding them up could win.

The switches replace a kernel entry point by a function that launches nothing, then run the throughput probe
(harness/throughput.py) with the remaining arguments:

- ``--no-norm``: ``fused_ops.add_rms_norm`` (after o_proj and after down in every layer but the last, whose norm
  also runs the exit gate: 47 launches a decode step at 24 layers) returns the residual unchanged as both outputs;
- ``--no-attention``: ``decode_attention.decode_attention`` (24 launches a decode step) returns a zero tensor of
  q's shape, made once per shape and reused (the KV write in the qkv projection still runs).

Every layer then reads bounded activations of the right shape, dtype and device. The probe's schedule is captured
under the same replacement, so its token checks hold; its tokens are not the model's, and its schedule differs, so
compare time per decode step, not tokens/s. Without a switch it is the probe unchanged, the baseline to run
alternately in separate processes::

    python3 kernels/bench/ablate.py --preset ouro-1.4b --max-num-seqs 16 --num-requests 32
    python3 kernels/bench/ablate.py --no-norm --preset ouro-1.4b --max-num-seqs 16 --num-requests 32

The difference bounds a change from above: a fold adds work to the kernels it joins, a faster kernel still costs
something.
"""
from __future__ import annotations

import sys

import torch

from loopbench.harness import throughput
from loopbench.kernels import decode_attention, fused_ops


def _no_norm(x, y, w1, w2, eps):
    """(x, x): no launch, the residual passed through as both the new residual and the normed state."""
    return x, x


_ZEROS: dict[tuple, torch.Tensor] = {}


def _no_attention(q, *args, **kwargs):
    """Zeros of q's shape [N, H, D], one tensor per shape: one launch the first time, none after."""
    key = (tuple(q.shape), q.dtype, q.device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    return _ZEROS[key]


SWITCHES = {"--no-norm": (fused_ops, "add_rms_norm", _no_norm),
            "--no-attention": (decode_attention, "decode_attention", _no_attention)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for switch, (module, name, replacement) in SWITCHES.items():
        if switch in argv:
            argv.remove(switch)
            setattr(module, name, replacement)
            print(f"ablate: {module.__name__}.{name} launches nothing (diagnostic: wrong tokens)", flush=True)
    return throughput.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
