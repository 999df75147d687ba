"""Microbenchmark: what a kernel boundary costs a weight stream, against a grid barrier inside one kernel.

Issue 11's open question. The decode loop sits about 2.7 us a kernel above its bytes' floor
(kernels/results/throughput_budget_5e7afa5.md), and the lever left is fewer, longer kernels: one persistent
kernel per layer or per loop whose stages are separated by grid barriers instead of kernel boundaries. This
measures the two separators alone, on a stand-in for a chain of projections: ``S`` slices of ``--slice-mb``
each of one bf16 buffer (distinct memory, together at least 256 MB, five times the H200's L2, so every byte
comes from HBM), read by ``G`` programs, one per SM, three ways:

- ``chain``: one launch per slice. Each program waits for the previous launch (``griddepcontrol.wait`` with
  PDL, stream order without), reads one value that launch wrote, streams its share of the slice and stores
  its sum plus that value: a projection whose input is the previous kernel's output. ``prewait`` issues the
  share's first loads before the wait (the GEMMs' ``prefetch_tiles``).
- ``barrier``: one launch; between slices every program arrives on a grid barrier (the arrival-counter
  protocol of kernels/gemm_norm.py: CTA barrier, release-acquire atomic add at GPU scope, acquire spin),
  then reads the same value. ``prewait`` issues the next share's first loads before it arrives.
- ``split``: ``barrier`` with the barrier in two halves: a program arrives (release), then issues its next
  share's first loads (with ``prewait``), then waits for the others (acquire), so its loads and the others'
  arrival overlap (a split-phase barrier, as an arrive / wait pair of mbarriers or CUDA's ``barrier.arrive`` and
  ``barrier.wait``), where ``barrier``'s ``prewait`` loads must land before the release lets the program arrive.
- ``stream``: one launch, no barrier, no dependency: this kernel's own floor for the same bytes.

Every program owns a contiguous share of each slice (a multiple of ``UNROLL * BLOCK`` elements, so the slices
are the nominal size rounded up; the table gives the bytes read). The time per slice and ``(time - stream's
time)`` give what one boundary or barrier adds; ``--slice-mb 0`` leaves only the separators (no bytes). Two
more chain variants split each slice into chunks of one group (32 KB): ``chunks`` hands program p the chunks
p, p + G, ...; ``dynamic`` lets each program take the next chunk from a work queue (an atomic counter), so a
program on a slower path to memory takes fewer (the tail of a static split is its slowest program's share).
The chain, barrier and split results must be bitwise equal (same sums, same dependency; this also checks that the
barrier makes the previous slice's stores visible, as the output starts as NaN), and so must chunks and
dynamic.

Usage: ``PYTHONPATH=<repo> python3 kernels/bench/sync_cost.py --out $OUT/sync_cost_h200.md`` (CUDA only:
a program that waits for a later one would wait for ever on the interpreter, which runs them in turn).
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from loopbench.kernels import pdl
from loopbench.kernels.bench.decode_attention import MIN_WORKING_SET, copy_ceiling_bytes_per_s, graph_ms_per_call
from loopbench.kernels.mlp_block import arrive as _arrive          # the split-phase halves, as the kernel runs them
from loopbench.kernels.mlp_block import wait_arrived as _wait_all

BLOCK = 4096            # elements per load per program (4 warps: 32 bf16, four 16-byte loads a thread)
UNROLL = 4              # loads in flight per program before their sum: 32 KB
CHAIN, BARRIER, STREAM, SPLIT = 0, 1, 2, 3
MODES = {"chain": CHAIN, "barrier": BARRIER, "stream": STREAM, "split": SPLIT}
COLUMNS = ("mode", "pdl", "prewait", "slice_mb", "slices", "us_per_slice", "gb_per_s", "pct_ceiling",
           "added_us")


@triton.jit
def _grid_barrier(cnt_ptr, G):
    """Every program of the grid arrives before any leaves (all ``G`` resident: one per SM). The counter only
    grows, by ``G`` a barrier, so a launch that starts at a multiple of ``G`` leaves one: no reset needed."""
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    target = (old // G + 1) * G
    while tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _share_sum(base, v0, iters, BLOCK: tl.constexpr, UNROLL: tl.constexpr, START: tl.constexpr = 1):
    """fp32 sum of a program's share: ``v0`` (its first ``START`` groups of UNROLL * BLOCK elements, already
    loaded and summed in order) and its groups ``START .. iters - 1`` from ``base``."""
    offs = tl.arange(0, BLOCK)
    acc = v0
    for i in range(START, iters):
        p = base + i * (UNROLL * BLOCK)
        a = tl.load(p + offs)
        b = tl.load(p + BLOCK + offs)
        c = tl.load(p + 2 * BLOCK + offs)
        d = tl.load(p + 3 * BLOCK + offs)
        acc += (a.to(tl.float32) + b.to(tl.float32)) + (c.to(tl.float32) + d.to(tl.float32))
    return tl.sum(acc)


@triton.jit
def _first_group(base, iters, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """The share's first UNROLL * BLOCK elements summed pairwise in fp32 (zeros for an empty share)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    if iters > 0:
        a = tl.load(base + offs)
        b = tl.load(base + BLOCK + offs)
        c = tl.load(base + 2 * BLOCK + offs)
        d = tl.load(base + 3 * BLOCK + offs)
        acc = (a.to(tl.float32) + b.to(tl.float32)) + (c.to(tl.float32) + d.to(tl.float32))
    return acc


@triton.jit
def _first_groups(base, iters, BLOCK: tl.constexpr, UNROLL: tl.constexpr, GROUPS: tl.constexpr):
    """The share's first ``GROUPS`` (1 or 2) groups, all their loads issued before any sum, summed in
    :func:`_share_sum`'s order (zeros for the groups past the share)."""
    acc = _first_group(base, iters, BLOCK, UNROLL)
    if GROUPS == 2:
        acc += _first_group(base + UNROLL * BLOCK, iters - 1, BLOCK, UNROLL)
    return acc


@triton.jit(do_not_specialize=["first", "count"])
def _stream_kernel(w_ptr, out_ptr, cnt_ptr, iters, first, count, G, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                   MODE: tl.constexpr, PDL: tl.constexpr, PREWAIT: tl.constexpr, START: tl.constexpr = 1):
    pid = tl.program_id(0)
    per = iters * (UNROLL * BLOCK)
    slice_elems = per.to(tl.int64) * G
    nxt = (pid + 1) % G
    base = w_ptr + first * slice_elems + pid * per
    if PREWAIT:
        v0 = _first_group(base, iters, BLOCK, UNROLL)
    if MODE == 0:   # CHAIN: one slice, after the previous launch
        pdl.wait(PDL)
        dep = tl.load(out_ptr + (first - 1) * G + nxt, cache_modifier=".cg", mask=first > 0, other=0.0)
        if not PREWAIT:
            v0 = _first_group(base, iters, BLOCK, UNROLL)
        total = _share_sum(base, v0, iters, BLOCK, UNROLL)
        pdl.release(PDL)
        tl.store(out_ptr + first * G + pid, total + dep)
    else:
        if not PREWAIT:
            v0 = _first_group(base, iters, BLOCK, UNROLL)
        total = _share_sum(base, v0, iters, BLOCK, UNROLL)
        for j in range(first + 1, first + count):
            tl.store(out_ptr + (j - 1) * G + pid, total)
            base = w_ptr + j * slice_elems + pid * per
            if MODE == 3:   # SPLIT: arrive, then the next share's first loads, then wait for the others
                target = _arrive(cnt_ptr, G)
            if PREWAIT:
                v0 = _first_groups(base, iters, BLOCK, UNROLL, PREWAIT)
            dep = 0.0
            if MODE == 1:   # BARRIER
                _grid_barrier(cnt_ptr, G)
                dep = tl.load(out_ptr + (j - 1) * G + nxt, cache_modifier=".cg")
            if MODE == 3:
                _wait_all(cnt_ptr, target)
                dep = tl.load(out_ptr + (j - 1) * G + nxt, cache_modifier=".cg")
            if not PREWAIT:
                v0 = _first_group(base, iters, BLOCK, UNROLL)
            total = _share_sum(base, v0, iters, BLOCK, UNROLL, START) + dep     # START: the groups v0 holds
        tl.store(out_ptr + (first + count - 1) * G + pid, total)


@triton.jit(do_not_specialize=["first"])
def _chunk_kernel(w_ptr, outc_ptr, queue_ptr, chunks, first, G, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                  DYN: tl.constexpr, PDL: tl.constexpr):
    """Chain mode over chunks of one group (UNROLL * BLOCK elements) instead of one share a program: chunk u of
    slice ``first`` stores its sum plus chunk u of the previous slice. Static (program p takes p, p + G, ...) or
    ``DYN``: each program takes the next chunk from the slice's work queue (an atomic counter), asking for the
    one after before it reads the current one. Every launch adds exactly chunks + G to the counter (each program's
    last request is the one past the end), so the counter modulo chunks + G restarts at 0 in the next launch:
    no reset."""
    pid = tl.program_id(0)
    base = w_ptr + first.to(tl.int64) * chunks * (UNROLL * BLOCK)
    pdl.wait(PDL)
    if DYN:
        u = tl.atomic_add(queue_ptr + first, 1, sem="relaxed", scope="gpu") % (chunks + G)
    else:
        u = pid
    while u < chunks:
        if DYN:
            nu = tl.atomic_add(queue_ptr + first, 1, sem="relaxed", scope="gpu") % (chunks + G)
        else:
            nu = u + G
        dep = tl.load(outc_ptr + (first - 1) * chunks + u, mask=first > 0, other=0.0, cache_modifier=".cg")
        total = tl.sum(_first_group(base + u.to(tl.int64) * (UNROLL * BLOCK), 1, BLOCK, UNROLL))
        tl.store(outc_ptr + first * chunks + u, total + dep)
        u = nu
    pdl.release(PDL)


class Stream:
    """One bf16 buffer of ``slices`` slices of ``iters`` groups of UNROLL * BLOCK elements per program, the output
    ``out`` [slices, G] fp32 (program p's sum of slice j, plus in chain and barrier modes out[j - 1, (p + 1) % G]),
    and the barrier's int32 counter. ``slices``: enough for MIN_WORKING_SET bytes, at least 8 (64 without bytes)."""

    def __init__(self, slice_mb: float, programs: int, device="cuda", seed: int = 0, min_bytes: int = MIN_WORKING_SET):
        group = UNROLL * BLOCK
        self.G = programs
        self.iters = -(-int(slice_mb * 2 ** 20 / 2) // (group * programs)) if slice_mb > 0 else 0
        slice_bytes = 2 * self.iters * group * programs
        self.slices = max(8, -(-min_bytes // slice_bytes)) if slice_bytes else 64
        self.slice_bytes = slice_bytes
        g = torch.Generator(device=device).manual_seed(seed)
        self.w = (torch.rand(max(1, self.slices * slice_bytes // 2), generator=g, device=device) - 0.5
                  ).to(torch.bfloat16)
        self.out = torch.full((self.slices, programs), float("nan"), device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.chunks = self.iters * programs      # chunk modes: one group a chunk
        self.outc = torch.full((self.slices, max(1, self.chunks)), float("nan"), device=device)
        self.queue = torch.zeros(self.slices, dtype=torch.int32, device=device)

    def launch(self, mode: str, use_pdl: bool, prewait: bool | int, first: int, count: int) -> None:
        _stream_kernel[(self.G,)](self.w, self.out, self.counter, self.iters, first, count, self.G, BLOCK=BLOCK,
                                  UNROLL=UNROLL, MODE=MODES[mode], PDL=pdl.mode(use_pdl), PREWAIT=int(prewait),
                                  START=max(int(prewait), 1),
                                  **pdl.launch_options(use_pdl, num_warps=4, num_stages=1))

    def run(self, mode: str, use_pdl: bool, prewait: bool) -> None:
        if mode in ("chunks", "dynamic"):
            for j in range(self.slices):
                _chunk_kernel[(self.G,)](self.w, self.outc, self.queue, self.chunks, j, self.G, BLOCK=BLOCK,
                                         UNROLL=UNROLL, DYN=mode == "dynamic", PDL=pdl.mode(use_pdl),
                                         **pdl.launch_options(use_pdl, num_warps=4, num_stages=1))
        elif mode == "chain":
            for j in range(self.slices):
                self.launch(mode, use_pdl, prewait, j, 1)
        else:
            self.launch(mode, False, prewait, 0, self.slices)

    def result(self, mode: str, use_pdl: bool, prewait: bool) -> torch.Tensor:
        out = self.outc if mode in ("chunks", "dynamic") else self.out
        out.fill_(float("nan"))
        self.run(mode, use_pdl, prewait)
        if out.is_cuda:
            torch.cuda.synchronize()
        return out.clone()

    def reference(self, dependent: bool) -> torch.Tensor:
        """``out`` from torch (fp64 sums): each program's share of each slice, plus the neighbour's previous value
        where ``dependent`` (chain, barrier)."""
        shares = self.w[:self.slices * self.slice_bytes // 2].double().view(self.slices, self.G, -1).sum(-1)
        if not dependent:
            return shares
        out = shares.clone()
        for j in range(1, self.slices):
            out[j] += out[j - 1].roll(-1)
        return out

    def chunk_reference(self) -> torch.Tensor:
        """``outc`` from torch (fp64): each chunk's sum plus the same chunk of the previous slice."""
        sums = self.w[:self.slices * self.slice_bytes // 2].double().view(self.slices, max(1, self.chunks), -1).sum(-1)
        return sums.cumsum(0)


VARIANTS = [("stream", False, False), ("stream", False, True), ("chain", False, False), ("chain", True, False),
            ("chain", True, True), ("barrier", False, False), ("barrier", False, True), ("split", False, False),
            ("split", False, True), ("split", False, 2), ("chunks", True, False), ("dynamic", True, False)]


def measure(slice_mb: float, programs: int, ceiling: float) -> tuple[list[dict], bool]:
    """One row per variant at one slice size, and whether every chain and barrier variant gave the same bits."""
    s = Stream(slice_mb, programs)
    reference = s.result("chain", False, False)
    agree = all(torch.equal(s.result(m, p, w), reference) for m, p, w in VARIANTS if m in ("chain", "barrier", "split"))
    agree = agree and (not s.chunks or torch.equal(s.result("dynamic", True, False), s.result("chunks", True, False)))
    rows, floor = [], {}
    for mode, use_pdl, prewait in VARIANTS:
        us = graph_ms_per_call([lambda m=mode, p=use_pdl, w=prewait: s.run(m, p, w)]) * 1e3 / s.slices
        if mode == "stream":
            floor[bool(prewait)] = us
        gbs = s.slice_bytes / (us * 1e-6) / 1e9
        rows.append(dict(mode=mode, pdl="on" if use_pdl else "off", prewait="no" if not prewait else "yes" if prewait is True else f"{prewait} groups",
                         slice_mb=s.slice_bytes / 2 ** 20, slices=s.slices, us_per_slice=us, gb_per_s=gbs,
                         pct_ceiling=100 * gbs * 1e9 / ceiling, added_us=us - floor[bool(prewait)]))
    del s
    torch.cuda.empty_cache()
    return rows, agree


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def write_table(head: str, rows: list[dict], columns: tuple[str, ...], out: Path | None, notes: list[str] = ()) -> None:
    """Print ``head``, the markdown table of ``rows`` over ``columns`` and ``notes`` (one bullet each); with ``out``,
    write the same text there and the rows as a .csv beside it."""
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rows]
    text = "\n".join([head, *table, "", *(f"- {n}" for n in notes), ""])
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        with out.with_suffix(".csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)


def numbers(text: str, name: str) -> list[float]:
    """A bench's comma-separated option, ``"8,25"`` -> [8.0, 25.0]; ValueError naming the option and its value."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slice-mb", default="0,8,23,46", help="slice sizes in MB (MiB), comma-separated; 0: no bytes")
    ap.add_argument("--out", type=Path, help="markdown table here, a .csv beside it")
    args = ap.parse_args(argv)
    try:
        sizes = numbers(args.slice_mb, "--slice-mb")
    except ValueError as e:
        print(f"sync_cost: {e}", file=sys.stderr)
        return 2
    if any(v < 0 for v in sizes):
        print(f"sync_cost: --slice-mb must be >= 0, got {args.slice_mb!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sync_cost: needs a CUDA GPU (its barrier waits for programs the interpreter runs later)",
              file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    ceiling = copy_ceiling_bytes_per_s()
    rows, checks = [], []
    for mb in sizes:
        r, agree = measure(mb, props.multi_processor_count, ceiling)
        rows += r
        checks.append(f"{mb:g} MB: chain == barrier and chunks == dynamic, bitwise: {'yes' if agree else 'NO'}")
    head = (f"# Kernel boundary vs grid barrier on {props.name} (torch {torch.__version__}, triton "
            f"{triton.__version__}), {props.multi_processor_count} programs\n\nCopy ceiling (read + write): "
            f"{ceiling / 1e9:.0f} GB/s. Times: CUDA graph of the whole stream, us per slice; added_us: minus "
            "stream's time at the same prewait.\n")
    write_table(head, rows, COLUMNS, args.out, checks)
    return 0 if all("NO" not in c for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
