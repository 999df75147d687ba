"""Microbenchmark: the small-M GEMM with its tiles handed out from a work queue, against one program a tile.

kernels/bench/sync_cost.py found that what a kernel boundary adds to a weight stream grows with the bytes
between boundaries: a launch of one share a program ends with its slowest program, whose share is as large as
the others'. ``kernels/gemm.py`` launches one program per (column tile, K split), so its tail is the slowest
tile's. Here the same tiles (the same ``gemm._split_operands`` / ``gemm._k_loop`` code, so the same K order
and bits as the pointer kernel) are computed by ``G`` programs that loop over them:

- ``static``: program p takes tiles p, p + G, ...;
- ``dynamic``: each program takes the next tile from a work queue, an int32 counter per launch site (per
  weight here, per layer and projection in an engine), asking for the one after before it computes the current
  one. Every launch adds exactly tiles + G to its counter (each program's last request is the one past the
  end), so the counter modulo tiles + G starts at 0 in the next launch: no reset.

Which program computes a tile changes no bit, so both are bitwise the pointer kernel at the same configuration
(checked per row of the table) and as batch-invariant. Timed as ``kernels/bench/gemm.py`` times: CUDA-graph
chains over distinct weight copies (>= 256 MB), us per call, against the runtime's configuration
(``gemm.CONFIGS``, TMA for qkv and gate_up) and the same with pointer loads.

Usage: ``PYTHONPATH=<repo> python3 kernels/bench/queue_gemm.py --out $OUT/queue_gemm_h200.md`` (CUDA).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from loopbench.kernels import gemm as gm
from loopbench.kernels import pdl
from loopbench.kernels.bench.decode_attention import MIN_WORKING_SET, copy_ceiling_bytes_per_s, graph_ms_per_call
from loopbench.kernels.bench.sync_cost import write_table

SHAPES = {"qkv": (6144, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
COLUMNS = ("shape", "m", "variant", "tiles", "programs", "us", "pct_ceiling", "vs_runtime", "bitwise_pointer")


@triton.jit(do_not_specialize=["M"])
def _queue_gemm_kernel(x_ptr, w_ptr, out_ptr, queue_ptr, M, N, K, tiles_per_split, stride_xm, stride_wn, stride_om,
                       stride_os, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
                       DYN: tl.constexpr, GLU: tl.constexpr, PREFETCH_K: tl.constexpr):
    G = tl.num_programs(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    units = n_tiles * SPLIT
    if DYN:
        u = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu") % (units + G)
    else:
        u = tl.program_id(0)
    if PREFETCH_K:
        if u < units:
            k_first = (u // n_tiles) * tiles_per_split * BLOCK_K
            gm._prefetch_l2(w_ptr, (u % n_tiles) * BLOCK_N, k_first, N, K, stride_wn, BLOCK_N, PREFETCH_K)
            if GLU:
                gm._prefetch_l2(w_ptr + N.to(tl.int64) * stride_wn, (u % n_tiles) * BLOCK_N, k_first, N, K,
                                stride_wn, BLOCK_N, PREFETCH_K)
    pdl.wait(PDL)
    while u < units:
        if DYN:
            nu = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu") % (units + G)
        else:
            nu = u + G
        pid_n = u % n_tiles
        split = u // n_tiles
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if GLU:
            r = tl.arange(0, 2 * BLOCK_N)
            cols = pid_n * BLOCK_N + r % BLOCK_N
            rows = (r // BLOCK_N) * N + cols
            mask_n = cols[:, None] < N
        else:
            rows = offs_n
            mask_n = offs_n[:, None] < N
        w_ptrs, x_ptrs, offs_m, offs_k, mask_m, k0, num_tiles = gm._split_operands(
            x_ptr, w_ptr, rows, split, M, K, tiles_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_K)
        acc = gm._k_loop(w_ptrs, x_ptrs, mask_n, mask_m, offs_k, k0, K, num_tiles, (1 + GLU) * BLOCK_N, BLOCK_M,
                         BLOCK_K, EVEN, DOT_FP32)
        if GLU:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
            acc = gm._swiglu(gate, up, out_ptr.dtype.element_ty)
        out = out_ptr + split.to(tl.int64) * stride_os + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m & (offs_n[:, None] < N))
        u = nu
    pdl.release(PDL)


def queue_gemm(x: torch.Tensor, weight: torch.Tensor, c: gm.GemmConfig, queue: torch.Tensor, programs: int,
               dynamic: bool, glu: bool = False) -> torch.Tensor:
    """``gemm.gemm`` (or ``gemm.gemm_swiglu`` with ``glu``) at pointer-load config ``c`` by ``programs`` looping
    programs (module docstring); ``queue``: this launch site's int32 [1] counter (zero at first). Same result,
    bitwise, as the pointer kernel at ``c``."""
    m, k = x.shape
    n = weight.shape[0] // (2 if glu else 1)
    block_m = max(16, triton.next_power_of_2(m))
    tiles_per_split = triton.cdiv(triton.cdiv(k, c.block_k), c.split_k)
    shape = (c.split_k, m, n) if c.split_k > 1 else (1, m, n)
    out = torch.empty(shape, device=x.device, dtype=torch.float32 if c.split_k > 1 else x.dtype)
    use_pdl = c.pdl and pdl.active(x)
    stages = gm.num_stages_that_fit(c, block_m, x.device, 2 if glu else 1, x.element_size())
    _queue_gemm_kernel[(programs,)](x, weight, out, queue, m, n, k, tiles_per_split, x.stride(0), weight.stride(0),
                                    out.stride(1), out.stride(0), SPLIT=c.split_k, BLOCK_N=c.block_n,
                                    BLOCK_M=block_m, BLOCK_K=c.block_k,
                                    EVEN=n % c.block_n == 0 and k % c.block_k == 0, DOT_FP32=not x.is_cuda,
                                    PDL=pdl.mode(use_pdl), DYN=dynamic, GLU=glu,
                                    PREFETCH_K=gm.prefetch_elements(c, k, use_pdl, x.element_size()),
                                    **pdl.launch_options(use_pdl, num_warps=c.num_warps, num_stages=stages))
    return out if c.split_k > 1 else out[0]


def _runtime(x, w, c, glu):
    return gm.gemm_swiglu(x, w, c) if glu else gm.gemm(x, w, c)


def measure(name: str, m: int, ceiling: float, sms: int) -> list[dict]:
    n, k = SHAPES[name]
    glu = name == "gate_up"
    runtime_cfg = (gm.SWIGLU_CONFIGS if glu else gm.CONFIGS)[(n, k)]
    pointer = dataclasses.replace(runtime_cfg, tma=False)
    copies = max(4, -(-MIN_WORKING_SET // (2 * n * k)))
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [0.02 * torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn((m, k), generator=g, device="cuda", dtype=torch.bfloat16)
    queues = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in ws]
    moved = 2 * (n * k + m * k + m * (n // 2 if glu else n))
    ref = _runtime(x, ws[0], pointer, glu)
    tiles = triton.cdiv(n // (2 if glu else 1), pointer.block_n) * pointer.split_k
    variants = [("runtime (gemm.CONFIGS)", tiles, tiles, lambda w, q: _runtime(x, w, runtime_cfg, glu), runtime_cfg),
                ("pointer loads", tiles, tiles, lambda w, q: _runtime(x, w, pointer, glu), pointer)]
    splits = [pointer.split_k] + ([2 * pointer.split_k] if pointer.split_k > 1 else [])
    for split in splits:
        cfg = dataclasses.replace(pointer, split_k=split)
        t = triton.cdiv(n // (2 if glu else 1), cfg.block_n) * split
        for per_sm in (1, 2):
            for dyn in (False, True):
                variants.append((f"{'dynamic' if dyn else 'static'} s{split}", t, per_sm * sms,
                                 lambda w, q, c=cfg, p=per_sm * sms, d=dyn: queue_gemm(x, w, c, q, p, d, glu), cfg))
    rows, base = [], None
    for label, t, programs, fn, cfg in variants:
        for q in queues:     # a counter restarts at 0 only for the same tiles + G: fresh ones for each variant
            q.zero_()
        out = fn(ws[0], queues[0])
        same = torch.equal(out, ref) if cfg.split_k == pointer.split_k else \
            torch.equal(gm.reduce_partials(out, x.dtype), gm.reduce_partials(_runtime(x, ws[0], cfg, glu), x.dtype))
        us = graph_ms_per_call([lambda w=w, q=q: fn(w, q) for w, q in zip(ws, queues)]) * 1e3
        base = us if base is None else base
        rows.append(dict(shape=name, m=m, variant=label, tiles=t, programs=programs, us=us,
                         pct_ceiling=100 * moved / (us * 1e-6) / ceiling, vs_runtime=base / us,
                         bitwise_pointer="yes" if same else "NO"))
    del ws
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default="16,32", help="row counts, comma-separated")
    ap.add_argument("--out", type=Path, help="markdown table here, a .csv beside it")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        print(f"queue_gemm: unknown shape(s) {unknown}; known: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    try:
        ms = [int(v) for v in args.ms.split(",")]
    except ValueError:
        ms = []
    if not ms or any(not 1 <= v <= gm.MAX_M for v in ms):
        print(f"queue_gemm: --ms must be comma-separated ints in 1..{gm.MAX_M}, got {args.ms!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("queue_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    ceiling = copy_ceiling_bytes_per_s()
    rows = [r for s in shapes for m in ms for r in measure(s, m, ceiling, props.multi_processor_count)]
    head = (f"# Small-M GEMM tiles from a work queue on {props.name} (torch {torch.__version__}, triton "
            f"{triton.__version__})\n\nCopy ceiling (read + write): {ceiling / 1e9:.0f} GB/s. us per call in "
            "CUDA-graph chains over >= 256 MB of weights; vs_runtime: the runtime configuration's time over this "
            "row's; bitwise_pointer: equal to the pointer kernel at the row's split (summed partials where the "
            "split differs from the runtime's).\n")
    write_table(head, rows, COLUMNS, args.out)
    return 0 if all(r["bitwise_pointer"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
