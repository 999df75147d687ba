"""Diagnostic, wrong results: how much of a decode step the sandwich-norm launches cost, as an upper bound on what
folding them into their neighbours could win.

The fused decode loop (runtime/model.py ``_run_loop_fused``) launches ``fused_ops.add_rms_norm`` after o_proj and
after down in every layer but the last (whose norm also runs the exit gate): 47 launches a decode step at 24 layers.
With ``--no-norm`` this script replaces ``fused_ops.add_rms_norm`` by a function that launches nothing and returns
the residual unchanged as both outputs (so every layer reads bounded activations of the right shape, dtype and
device), then runs the throughput probe (harness/throughput.py) with the remaining arguments. The probe's schedule
is captured under the same replacement, so its token checks hold; its tokens are not the model's. Without
``--no-norm`` it is the probe unchanged, the baseline to run alternately in separate processes:

    python3 kernels/bench/norm_bound.py --preset ouro-1.4b --max-num-seqs 16 --num-requests 32
    python3 kernels/bench/norm_bound.py --no-norm --preset ouro-1.4b --max-num-seqs 16 --num-requests 32

The difference in ms per engine step bounds a fold from above: a fold also adds work to the kernels it joins.
"""
from __future__ import annotations

import sys

from loopbench.harness import throughput
from loopbench.kernels import fused_ops


def _no_norm(x, y, w1, w2, eps):
    """(x, x): no launch, the residual passed through as both the new residual and the normed state."""
    return x, x


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--no-norm" in argv:
        argv.remove("--no-norm")
        fused_ops.add_rms_norm = _no_norm
        print("norm_bound: fused_ops.add_rms_norm launches nothing (diagnostic: wrong tokens)", flush=True)
    return throughput.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
