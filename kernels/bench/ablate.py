"""Diagnostic, wrong results: what a decode step's norm, attention or projection launches cost the loop, as an upper
bound on what folding or speeding them up could win.

The switches replace a kernel entry point by a function that launches nothing, then run the throughput probe
(harness/throughput.py) with the remaining arguments:

- ``--no-norm``: ``fused_ops.add_rms_norm`` (after o_proj and after down in every layer but the last, whose norm
  also runs the exit gate: 47 launches a decode step at 24 layers) returns the residual unchanged as both outputs;
- ``--no-attention``: ``decode_attention.decode_attention`` (24 launches a decode step) returns a zero tensor of
  q's shape, made once per shape and reused (the KV write in the qkv projection still runs);
- ``--no-projections``: the decode loop's four small-M projections (``qkv_rope.qkv_rope_write_kv``, whose KV write
  goes with it; ``wgmma_gemm.gemm`` for o_proj and down, and ``gemm.gemm`` where they run there; ``gemm.gemm_swiglu`` and ``wgmma_gemm.gemm_swiglu`` for
  gate_up + SwiGLU: 96 launches a decode step) return zero tensors of their output's shape and dtype, split-K
  partials included, made once per shape. lm_head and the prefill's projections (cuBLAS) still run.

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
from loopbench.kernels import decode_attention, fused_ops, gemm, qkv_rope, wgmma_gemm


def _no_norm(x, y, w1, w2, eps):
    """(x, x): no launch, the residual passed through as both the new residual and the normed state."""
    return x, x


_ZEROS: dict[tuple, torch.Tensor] = {}


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One zero tensor per (shape, dtype, device): one launch the first time, none after."""
    key = (tuple(shape), dtype, device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _ZEROS[key]


def _no_attention(q, *args, **kwargs):
    """Zeros of q's shape [N, H, D]."""
    return _zeros(q.shape, q.dtype, q.device)


def _no_qkv(x, w_qkv, *args, **kwargs):
    """Zeros of the qkv projection's output [N, rows of w_qkv] in x's dtype (no RoPE, no KV write)."""
    return _zeros((x.shape[0], w_qkv.shape[0]), x.dtype, x.device)


def _no_gemm(x, weight, config, *args, **kwargs):
    """Zeros of ``wgmma_gemm.gemm``'s output: [M, N] in x's dtype, or fp32 partials [split_k, M, N]."""
    m, n = x.shape[0], weight.shape[0]
    if config.split_k == 1:
        return _zeros((m, n), x.dtype, x.device)
    return _zeros((config.split_k, m, n), torch.float32, x.device)


def _no_swiglu(x, gate_up, *args, **kwargs):
    """Zeros of gate_up + SwiGLU's output [M, rows of gate_up / 2] in x's dtype."""
    return _zeros((x.shape[0], gate_up.shape[0] // 2), x.dtype, x.device)


SWITCHES = {"--no-norm": [(fused_ops, "add_rms_norm", _no_norm)],
            "--no-attention": [(decode_attention, "decode_attention", _no_attention)],
            "--no-projections": [(qkv_rope, "qkv_rope_write_kv", _no_qkv), (wgmma_gemm, "gemm", _no_gemm),
                                 (gemm, "gemm", _no_gemm), (gemm, "gemm_swiglu", _no_swiglu), (wgmma_gemm, "gemm_swiglu", _no_swiglu)]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for switch, replacements in SWITCHES.items():
        if switch in argv:
            argv.remove(switch)
            for module, name, replacement in replacements:
                setattr(module, name, replacement)
                print(f"ablate: {module.__name__}.{name} launches nothing (diagnostic: wrong tokens)", flush=True)
    return throughput.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
