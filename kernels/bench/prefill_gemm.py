"""Microbenchmark: the prefill projections as the batch-invariant engine runs them today, and in one launch.

For each Ouro projection shape (bf16 weight ``[N, K]``: qkv 6144x2048, o_proj 2048x2048, gate_up 11264x2048, down
2048x5632) and packed-prefill row count M, the us per call and TFLOP/s (2 M N K flops) of:

- ``calls_256``: cuBLAS in calls of exactly 256 rows (runtime/model.py ``linear`` with ``gemm_rows=256``, the
  engine's batch-invariant prefill today; M is rounded up to whole calls, as the engine pads);
- ``cublas``: one cuBLAS call of M rows (not batch invariant: its algorithm depends on M);
- ``ours <config>``: kernels/prefill_gemm.py in one launch, for each configuration of ``CONFIGS``.

Timed as kernels/bench/gemm.py times (a CUDA graph of back-to-back calls, ``graph_ms_per_call``), on 4 weight
copies. Each of ours is checked against the fp32 reference (a few bf16 ulps) and for batch invariance (rows 0..127
alone equal the same rows of the M-row call, bitwise) before it is timed. Prints a markdown table and writes it to
``--out`` with a ``.csv`` beside it.
Usage: ``PYTHONPATH=<repo> python3 kernels/bench/prefill_gemm.py --out $OUT/prefill_gemm.md``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from loopbench.kernels import prefill_gemm as pg
from loopbench.kernels.bench import markdown_writer, table_lines, write_csv
from loopbench.kernels.bench.decode_attention import graph_ms_per_call
from loopbench.runtime.model import linear

SHAPES = {"qkv": (6144, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
CONFIGS = {
    "128x128x64 s4 w8": pg.PrefillGemmConfig(128, 128, 64, 8, 4, 8),
    "128x128x64 s3 w4": pg.PrefillGemmConfig(128, 128, 64, 8, 3, 4),
    "128x256x64 s3 w8": pg.PrefillGemmConfig(128, 256, 64, 8, 3, 8),
    "64x128x64 s4 w4": pg.PrefillGemmConfig(64, 128, 64, 8, 4, 4),
    "128x64x64 s4 w4": pg.PrefillGemmConfig(128, 64, 64, 8, 4, 4),
}
COLUMNS = ("shape", "m", "calls_256_us", "calls_256_tflops", "cublas_us", "cublas_tflops", "best_ours",
           "best_ours_us", "best_ours_tflops", "ours_vs_calls_256")


def measure(name: str, m: int, copies: int = 4) -> dict:
    n, k = SHAPES[name]
    ws = [(0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16) for _ in range(copies)]
    padded = -(-m // 256) * 256
    x = torch.randn(padded, k, device="cuda").to(torch.bfloat16)
    outs = [torch.empty(padded, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
    flops = 2.0 * m * n * k
    row = {"shape": name, "m": m}
    calls = graph_ms_per_call([lambda w=w: linear(x, w, 256) for w in ws]) * 1e3
    one = graph_ms_per_call([lambda w=w: torch.nn.functional.linear(x[:m], w) for w in ws]) * 1e3
    row.update(calls_256_us=calls, calls_256_tflops=flops / calls * 1e-6, cublas_us=one,
               cublas_tflops=flops / one * 1e-6)
    ref = pg.prefill_gemm_ref(x[:m], ws[0])
    best = None
    for label, cfg in CONFIGS.items():
        got = pg.prefill_gemm(x[:m], ws[0], cfg)
        diff = (got.float() - ref.float()).abs()
        if not bool((diff <= 4 * 2 ** -7 * ref.float().abs().clamp(min=1.0)).all()):
            raise RuntimeError(f"{name} M{m} {label}: max diff {diff.max().item():.3e} from the fp32 reference")
        if not torch.equal(pg.prefill_gemm(x[:min(m, 128)].contiguous(), ws[0], cfg), got[:128]):
            raise RuntimeError(f"{name} M{m} {label}: rows 0..127 alone differ from the same rows of M {m}")
        us = graph_ms_per_call([lambda w=w, o=o: pg.prefill_gemm(x[:m], w, cfg, o[:m]) for w, o in zip(ws, outs)]) * 1e3
        row[label] = us
        if best is None or us < best[1]:
            best = (label, us)
    row.update(best_ours=best[0], best_ours_us=best[1], best_ours_tflops=flops / best[1] * 1e-6,
               ours_vs_calls_256=calls / best[1])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="markdown report (a .csv is written beside it)")
    ap.add_argument("--ms", type=int, nargs="+", default=[128, 256, 512, 2048, 4096], help="packed prefill rows")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_gemm bench: needs CUDA", file=sys.stderr)
        return 2
    emit = markdown_writer(args.out)
    emit(f"# Prefill projections, {torch.cuda.get_device_name()}: cuBLAS in 256-row calls, one cuBLAS call, ours")
    rows = []
    for name in args.shapes:
        for m in args.ms:
            rows.append(measure(name, m))
            r = rows[-1]
            emit(f"- {name} M{m}: calls_256 {r['calls_256_us']:.1f} us ({r['calls_256_tflops']:.0f} TF/s), cublas "
                 f"{r['cublas_us']:.1f} ({r['cublas_tflops']:.0f}), " + ", ".join(
                     f"{c} {r[c]:.1f}" for c in CONFIGS) + f"; best {r['best_ours_tflops']:.0f} TF/s")
    columns = COLUMNS + tuple(CONFIGS)
    for line in table_lines(columns, rows):
        emit(line)
    write_csv(args.out.with_suffix(".csv"), columns, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
