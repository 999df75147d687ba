"""Microbenchmark: does a weight region that a prefetch brings into L2 stay there until it is read, and is the read
then faster?

Every cross-kernel L2 prefetch the decode loop has tried made it slower (``prefetch_next`` before the PDL wait,
0.81-0.95x; extra prefetch programs, 0.91x; ``prefetch_at_end``'s bulk prefetch at each program's end, 0.96-0.97x:
kernels/results/README.md). This separates the two ways that can happen: the prefetched lines are gone (or never
came) by the time the next kernel reads them, or they are there and the prefetch itself costs more than it saves.
One bf16 region of ``--region-mb`` is read by ``G`` programs (one per SM, each a contiguous share, the loads of
kernels/bench/sync_cost.py), the read timed alone with CUDA events, after:

- ``cold``: a 256 MB write that evicts L2 (five times the H200's 50 MB), so every byte comes from HBM;
- ``warm``: the same read just before (the most an L2 hit can give, where the region fits);
- ``bulk`` / ``lines``: the eviction, then a prefetch kernel asking L2 for the whole region (one
  ``cp.async.bulk.prefetch.L2`` per ``--chunk-kb`` chunk, as ``GemmConfig.prefetch_at_end``, or one
  ``prefetch.global.L2`` per 128-byte line, as ``prefetch_next``), a wait of ``--wait-cycles`` for the prefetch to
  land, and a read of ``--between-mb`` of other weights (the stream of the kernels between the prefetch and the
  read: 0 for the next kernel, 8-46 MB for one or two projections later);
- ``bulk+read`` / ``lines+read``: the eviction, then the prefetch kernel and the read back to back, both timed: what
  a prefetch issued right before the read costs or saves.

``prefetch alone`` rows time the prefetch kernel by itself (its issue cost; the bytes land later). Every read's sums
must equal the cold read's, bitwise.

Usage: ``PYTHONPATH=<repo> python3 kernels/bench/l2_prefetch.py --out $OUT/l2_prefetch_h200.md`` (CUDA only: the
prefetches are PTX).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from loopbench.kernels import gemm as gm
from loopbench.kernels.bench import sync_cost as sc
from loopbench.kernels.bench.decode_attention import MIN_WORKING_SET, copy_ceiling_bytes_per_s

COLUMNS = ("region_mb", "between_mb", "case", "us", "gb_per_s", "pct_ceiling", "vs_cold")
GROUP = sc.UNROLL * sc.BLOCK            # elements a program loads at once


@triton.jit(do_not_specialize=["iters"])
def _read_kernel(w_ptr, out_ptr, iters, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """out[p] = fp32 sum of program p's share, ``iters`` groups of UNROLL * BLOCK elements from ``p * iters``
    groups (sync_cost's loads and summation order)."""
    pid = tl.program_id(0)
    base = w_ptr + pid.to(tl.int64) * iters * (UNROLL * BLOCK)
    v0 = sc._first_group(base, iters, BLOCK, UNROLL)
    tl.store(out_ptr + pid, sc._share_sum(base, v0, iters, BLOCK, UNROLL))


@triton.jit(do_not_specialize=["chunks", "per_program"])
def _prefetch_kernel(w_ptr, chunks, per_program, CHUNK_ELEMS: tl.constexpr, BULK: tl.constexpr):
    """Program p asks L2 for chunks ``p * per_program ..`` (of ``chunks``) of CHUNK_ELEMS bf16 elements each: one
    bulk prefetch a chunk (``gemm.l2_prefetch_bulk``) or one line prefetch per 128 bytes (``gemm.l2_prefetch``)."""
    LANES: tl.constexpr = 128
    first = tl.program_id(0).to(tl.int64) * per_program
    for c0 in range(0, per_program, LANES):
        chunk = first + c0 + tl.arange(0, LANES)
        live = (chunk < first + per_program) & (chunk < chunks)
        start = w_ptr + tl.where(live, chunk, 0) * CHUNK_ELEMS
        if BULK:
            gm.l2_prefetch_bulk(start, CHUNK_ELEMS * 2, live)
        else:
            for line in tl.static_range(0, CHUNK_ELEMS, 64):
                gm.l2_prefetch_if(start + line, live)


class Region:
    """A bf16 region of ``iters`` groups a program for ``programs`` programs (``region_mb`` rounded up), its sums'
    output [programs] fp32, and a separate buffer of ``between_mb`` read between the prefetch and the timed read."""

    def __init__(self, region_mb: float, programs: int, device="cuda", seed: int = 0):
        if region_mb <= 0:
            raise ValueError(f"region_mb must be > 0, got {region_mb}")
        self.G = programs
        self.iters = -(-int(region_mb * 2 ** 20 / 2) // (GROUP * programs))
        self.bytes = 2 * self.iters * GROUP * programs
        g = torch.Generator(device=device).manual_seed(seed)
        self.w = (torch.rand(self.bytes // 2, generator=g, device=device) - 0.5).to(torch.bfloat16)
        self.out = torch.full((programs,), float("nan"), device=device)

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = self.out if out is None else out
        _read_kernel[(self.G,)](self.w, out, self.iters, BLOCK=sc.BLOCK, UNROLL=sc.UNROLL, num_warps=4, num_stages=1)
        return out

    def reference(self) -> torch.Tensor:
        """``out`` from torch in fp64: each program's share summed."""
        return self.w.double().view(self.G, -1).sum(-1)

    def prefetch(self, chunk_kb: int, bulk: bool) -> None:
        chunk_elems = chunk_kb * 512
        chunks = -(-self.w.numel() // chunk_elems)
        if self.w.numel() % chunk_elems:
            raise ValueError(f"--chunk-kb {chunk_kb} does not divide the region's {self.bytes} bytes")
        _prefetch_kernel[(self.G,)](self.w, chunks, -(-chunks // self.G), CHUNK_ELEMS=chunk_elems, BULK=bulk,
                                    num_warps=4)


def _timed(before, timed, reps: int) -> float:
    """Median us of ``timed()`` over ``reps``, each after ``before()`` on the same stream, timed with CUDA events; a
    sleep first lets the host queue the events and kernels ahead of the GPU, so no launch gap is timed."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        before()
        start.record()
        timed()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure(region_mb: float, between_mb: list[float], programs: int, ceiling: float, chunk_kb: int,
            wait_cycles: int, reps: int) -> tuple[list[dict], bool]:
    """One row per case at one region size, and whether every read gave the cold read's bits."""
    r = Region(region_mb, programs)
    flush = torch.empty(MIN_WORKING_SET, dtype=torch.uint8, device="cuda")
    others = {mb: Region(mb, programs, seed=1) for mb in between_mb if mb > 0}
    sums = {}

    def case(name, before, timed, between=0.0):
        out = torch.full_like(r.out, float("nan"))
        us = _timed(before, lambda: timed(out), reps)
        sums[(name, between)] = out.clone()
        return dict(region_mb=r.bytes / 2 ** 20, between_mb=between, case=name, us=us)

    def evict():
        flush.fill_(1)

    def prefetched(bulk, between):
        def before():
            evict()
            r.prefetch(chunk_kb, bulk)
            torch.cuda._sleep(wait_cycles)
            if between:
                others[between].read()
        return before

    rows = [case("cold", evict, r.read), case("warm", lambda: (evict(), r.read()), r.read)]
    for between in between_mb:
        for bulk in (True, False):
            rows.append(case("bulk" if bulk else "lines", prefetched(bulk, between), r.read, between))
    for bulk in (True, False):
        rows.append(case(("bulk" if bulk else "lines") + "+read", evict,
                         lambda out, b=bulk: (r.prefetch(chunk_kb, b), r.read(out))))
        rows.append(case(("bulk" if bulk else "lines") + " prefetch alone", evict,
                         lambda out, b=bulk: r.prefetch(chunk_kb, b)))
    cold = rows[0]["us"]
    for row in rows:
        alone = row["case"].endswith("alone")
        row["gb_per_s"] = float("nan") if alone else r.bytes / (row["us"] * 1e-6) / 1e9
        row["pct_ceiling"] = float("nan") if alone else 100 * row["gb_per_s"] * 1e9 / ceiling
        row["vs_cold"] = row["us"] / cold
    reference = sums[("cold", 0.0)]
    agree = all(torch.equal(v, reference) for k, v in sums.items() if not k[0].endswith("alone"))
    del r, flush, others
    torch.cuda.empty_cache()
    return rows, agree


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--region-mb", default="8,25", help="region sizes in MB (MiB), comma-separated, each > 0")
    ap.add_argument("--between-mb", default="0,8,25", help="MB read between the prefetch and the timed read, >= 0")
    ap.add_argument("--chunk-kb", type=int, default=4, help="KB per bulk prefetch (a multiple of 1)")
    ap.add_argument("--wait-cycles", type=int, default=100_000, help="GPU clock cycles between the prefetch and the "
                    "rest (torch.cuda._sleep; 100,000 is about 50 us at 2 GHz), >= 0")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per case (median)")
    ap.add_argument("--out", type=Path, help="markdown table here, a .csv beside it")
    args = ap.parse_args(argv)
    try:
        regions, between = sc.numbers(args.region_mb, "--region-mb"), sc.numbers(args.between_mb, "--between-mb")
    except ValueError as e:
        print(f"l2_prefetch: {e}", file=sys.stderr)
        return 2
    if any(v <= 0 for v in regions) or any(v < 0 for v in between):
        print(f"l2_prefetch: --region-mb must be > 0 and --between-mb >= 0, got {args.region_mb!r} and "
              f"{args.between_mb!r}", file=sys.stderr)
        return 2
    if args.chunk_kb < 1 or args.wait_cycles < 0 or args.reps < 1:
        print(f"l2_prefetch: --chunk-kb and --reps must be >= 1 and --wait-cycles >= 0, got {args.chunk_kb}, "
              f"{args.reps} and {args.wait_cycles}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("l2_prefetch: needs a CUDA GPU (the prefetches are PTX)", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    ceiling = copy_ceiling_bytes_per_s()
    rows, checks = [], []
    for mb in regions:
        r, agree = measure(mb, between, props.multi_processor_count, ceiling, args.chunk_kb, args.wait_cycles,
                           args.reps)
        rows += r
        checks.append(f"{mb:g} MB: every read equal to the cold read, bitwise: {'yes' if agree else 'NO'}")
    head = (f"# L2 prefetch of a weight region on {props.name} (torch {torch.__version__}, triton "
            f"{triton.__version__}), {props.multi_processor_count} programs, L2 {props.L2_cache_size / 2 ** 20:.0f} "
            f"MB\n\nCopy ceiling (read + write): {ceiling / 1e9:.0f} GB/s. us: the timed kernel(s) alone, CUDA events, "
            f"median of {args.reps}; bulk chunks of {args.chunk_kb} KB; {args.wait_cycles:,} cycles between a "
            "prefetch and the rest.\n")
    sc.write_table(head, rows, COLUMNS, args.out, checks)
    return 0 if all("NO" not in c for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
