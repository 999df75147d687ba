"""Microbenchmark: how much of the copy ceiling one isolated read of a projection's weight can reach at all.

Issue 11 asks our small-M GEMMs for >= 85% of the device-to-device copy ceiling at each Ouro projection. A GEMM
at M <= 32 is a weight read with little arithmetic on it, so a kernel that *only* reads the same bytes bounds
what any GEMM of that size can reach when timed the same way. For each weight size (bf16 ``[N, K]``: qkv
6144x2048, o_proj 2048x2048, gate_up 11264x2048, down 2048x5632, lm_head 49152x2048) it times, exactly as
kernels/bench/gemm.py times the GEMMs (a CUDA graph of back-to-back calls over distinct copies together >= 256
MB, so every byte comes from HBM; ``graph_ms_per_call``), the us per call of:

- ``read``: the fastest of a grid of streaming-sum kernels (:func:`_stream_sum_kernel`: each program sums a
  contiguous share in fp32 and writes one value; programs per SM, block, warps and pipeline stages swept);
- ``torch_sum``: ``w.sum(dtype=torch.float32)``;
- ``copy``: ``dst.copy_(w)`` (read + write bytes, as the ceiling counts them).

``*_pct`` = bytes / time over the copy ceiling measured in the same run (``copy_ceiling_bytes_per_s``, 2 GB).
Prints a markdown table and writes it to ``--out`` with a ``.csv`` beside it.
Usage: ``PYTHONPATH=<repo> python3 kernels/bench/read_floor.py --out $OUT/read_floor.md``.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from loopbench.kernels.bench import table_lines, write_report
from loopbench.kernels.bench.decode_attention import MIN_WORKING_SET, copy_ceiling_bytes_per_s, graph_ms_per_call
from loopbench.kernels.bench.gemm import SHAPES

COLUMNS = ("shape", "mb", "ceiling_us", "read_us", "read_pct", "read_config", "torch_sum_us", "torch_sum_pct",
           "copy_us", "copy_pct")
# (programs per SM, block elements, warps, stages): the streaming kernel's sweep
GRID = tuple(itertools.product((1, 2, 4), (4096, 8192), (4, 8), (3, 4)))


@triton.jit
def _stream_sum_kernel(src_ptr, out_ptr, n_elems, per_program, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    start = pid * per_program
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(start, start + per_program, BLOCK, num_stages=NUM_STAGES):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + idx, mask=idx < n_elems, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def stream_sum(w: torch.Tensor, out: torch.Tensor, programs: int, block: int, warps: int, stages: int) -> None:
    """Per-program fp32 sums of ``w`` (contiguous, any dtype) into ``out`` [>= programs] fp32."""
    n = w.numel()
    per_program = -(-n // (programs * block)) * block
    _stream_sum_kernel[(programs,)](w, out, n, per_program, BLOCK=block, NUM_STAGES=stages, num_warps=warps)


def measure(name: str, ceiling: float) -> dict:
    n, k = SHAPES[name]
    size = 2 * n * k
    copies = max(4, -(-MIN_WORKING_SET // size))
    ws = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    outs = [torch.empty(4 * sms, device="cuda", dtype=torch.float32) for _ in ws]
    best = None
    for per_sm, block, warps, stages in GRID:
        us = graph_ms_per_call([lambda w=w, o=o: stream_sum(w, o, per_sm * sms, block, warps, stages)
                                for w, o in zip(ws, outs)], rep_ms=40) * 1e3
        if best is None or us < best[0]:
            best = (us, f"{per_sm}/SM block {block} warps {warps} stages {stages}")
    want = ws[0].float().sum().item()
    stream_sum(ws[0], outs[0], sms, 4096, 4, 3)
    got = outs[0][:sms].double().sum().item()
    if abs(got - want) > 1e-3 * max(1.0, abs(want)) + 1e-2 * (n * k) ** 0.5:
        raise RuntimeError(f"{name}: the streaming sum {got} is not the weight's sum {want}")
    sums = [torch.empty((), device="cuda", dtype=torch.float32) for _ in ws]
    torch_sum = graph_ms_per_call([lambda w=w, s=s: torch.sum(w, dim=(0, 1), dtype=torch.float32, out=s)
                                   for w, s in zip(ws, sums)]) * 1e3
    dsts = [torch.empty_like(w) for w in ws]
    copy = graph_ms_per_call([lambda w=w, d=d: d.copy_(w) for w, d in zip(ws, dsts)]) * 1e3
    pct = lambda moved, us: 100 * moved / (us * 1e-6) / ceiling
    return dict(shape=name, mb=size / 1e6, ceiling_us=size / ceiling * 1e6, read_us=best[0],
                read_pct=pct(size, best[0]), read_config=best[1], torch_sum_us=torch_sum,
                torch_sum_pct=pct(size, torch_sum), copy_us=copy, copy_pct=pct(2 * size, copy))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="markdown table path (a .csv is written beside it)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels/bench/read_floor.py needs a CUDA device", file=sys.stderr)
        return 2
    ceiling = copy_ceiling_bytes_per_s()
    rows = [measure(s, ceiling) for s in args.shapes]
    lines = [f"# One isolated read of each projection's weight on {torch.cuda.get_device_name()} (torch "
             f"{torch.__version__}, triton {triton.__version__})", "",
             f"Copy ceiling (read + write): {ceiling / 1e9:.0f} GB/s. Times: CUDA-graph chains over copies from HBM, "
             "us per call.", "", *table_lines(COLUMNS, rows)]
    write_report(args.out, lines, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
