"""Microbenchmark of packed causal prefill attention on CUDA (a script, not a test).

For Ouro-1.4B's attention shape (16 heads, 16 kv heads, head_dim 128, bf16) and packs of prompts
(16x128, 32x128, 16x512, 16x1024, 16x2048, a mixed pack, and 16x128 in a padded 4096-row bucket with a
graph-sized table of ``max_prefill_tiles`` tiles) it reports per pack:

- ``ours_us``: one :func:`packed_prefill_attention` call (which also writes the padding rows' zeros), as
  a CUDA-graph replay: the ``triton.testing.do_bench`` median, L2 flushed before each replay;
- ``sdpa_loop_us``: ``scaled_dot_product_attention(is_causal=True)`` called once per prompt on
  pre-transposed ``[1, H, L, D]`` tensors, all calls in one CUDA graph, timed the same way (what a
  per-prompt prefill costs on the device, without its Python launch overhead);
- ``ratio`` = sdpa_loop_us / ours_us (above 1: ours is faster), the achieved TFLOP/s of both, with causal
  FLOPs ``sum over prompts of 4 * H * D * L * (L + 1) / 2``, and the eager (no-graph) times of both, which
  add the host launch cost;
- ``max_abs_diff`` between ours and SDPA (bf16 outputs).

``--tune`` then times a few (block_m, block_n, num_warps, num_stages) settings on every pack and prints the
best per pack (to choose the module defaults).

Usage: ``PYTHONPATH=<repo> python3 kernels/bench/prefill_attention.py --out X.md [--tune] [--rep-ms 100]``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from loopbench.kernels.bench import markdown_writer
from loopbench.kernels.prefill_attention import (DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, DEFAULT_NUM_STAGES,
                                                 DEFAULT_NUM_WARPS, max_prefill_tiles, packed_prefill_attention,
                                                 prefill_tiles)

HEADS, KV_HEADS, HEAD_DIM = 16, 16, 128
DEVICE = "cuda"
# name -> (prompt lengths, padded bucket rows or None for exactly the prompts' rows)
PACKS = {
    "16x128": ([128] * 16, None),
    "32x128": ([128] * 32, None),
    "16x512": ([512] * 16, None),
    "16x1024": ([1024] * 16, None),
    "16x2048": ([2048] * 16, None),
    "mixed": ([37, 128, 300, 1000, 2048], None),
    "16x128_pad4096": ([128] * 16, 4096),
}
MAX_SEQS_PER_BUCKET = 32
# (block_m, block_n, num_warps, num_stages); the first is the module default.
TUNE_CONFIGS = ((DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES),
                (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3),
                (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (64, 32, 2, 3))


def causal_flops(lens: list[int]) -> int:
    return sum(4 * HEADS * HEAD_DIM * n * (n + 1) // 2 for n in lens)


def make_pack(lens: list[int], bucket: int | None = None, seed: int = 0) -> dict:
    """Packed q/k/v ``[N, H, D]`` bf16 (``N`` = bucket or the prompts' rows) and, for the SDPA loop, each
    prompt's ``[1, H, L, D]`` copies."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n = sum(lens) if bucket is None else bucket
    q, k, v = (torch.randn((n, h, HEAD_DIM), generator=gen, device=DEVICE, dtype=torch.bfloat16)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    starts = [sum(lens[:i]) for i in range(len(lens))]
    per_seq = [tuple(t[a:a + m].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
               for a, m in zip(starts, lens)]
    return dict(lens=lens, bucket=bucket, q=q, k=k, v=v, per_seq=per_seq)


def ours_fn(pack: dict, block_m: int = DEFAULT_BLOCK_M, **kw):
    bucket = pack["bucket"]
    num_tiles = None if bucket is None else max_prefill_tiles(bucket, MAX_SEQS_PER_BUCKET, block_m)
    tiles = torch.from_numpy(prefill_tiles(pack["lens"], block_m=block_m, num_tiles=num_tiles)).to(DEVICE)
    return lambda: packed_prefill_attention(pack["q"], pack["k"], pack["v"], tiles, block_m=block_m, **kw)


def sdpa_loop_fn(pack: dict):
    return lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=True) for q, k, v in pack["per_seq"]]


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after a warm-up (and compile) on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def median_us(fn, rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def graph_us(fn, rep_ms: int) -> float:
    """Median replay time of ``fn`` in a CUDA graph; NaN (reported on stderr) if capture fails."""
    try:
        graph = capture(fn)
    except Exception as exc:       # e.g. an SDPA backend that cannot be captured: report, carry on
        print(f"graph capture failed: {exc!r}", file=sys.stderr)
        torch.cuda.synchronize()
        return float("nan")
    us = median_us(graph.replay, rep_ms)
    del graph
    return us


def bench_pack(name: str, lens: list[int], bucket: int | None, rep_ms: int) -> dict:
    pack = make_pack(lens, bucket)
    ours, sdpa = ours_fn(pack), sdpa_loop_fn(pack)
    ref = torch.cat([o[0].transpose(0, 1) for o in sdpa()])
    got = ours()
    diff = (got[:sum(lens)].float() - ref.float()).abs().max().item()
    if not bool((got[sum(lens):] == 0).all()):
        raise AssertionError(f"{name}: padding rows are not zero")
    row = dict(pack=name, prompts=len(lens), tokens=sum(lens), rows=pack["q"].shape[0],
               ours_us=graph_us(ours, rep_ms),
               sdpa_loop_us=graph_us(sdpa, rep_ms), ours_eager_us=median_us(ours, rep_ms),
               sdpa_loop_eager_us=median_us(sdpa, rep_ms), max_abs_diff=diff)
    flops = causal_flops(lens)
    row["ratio"] = row["sdpa_loop_us"] / row["ours_us"]
    row["ours_tflop_s"] = flops / (row["ours_us"] * 1e-6) / 1e12
    row["sdpa_tflop_s"] = flops / (row["sdpa_loop_us"] * 1e-6) / 1e12
    return row


COLUMNS = ["pack", "prompts", "tokens", "rows", "ours_us", "sdpa_loop_us", "ratio", "ours_tflop_s", "sdpa_tflop_s",
           "ours_eager_us", "sdpa_loop_eager_us", "max_abs_diff"]


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if value < 10 else f"{value:.1f}"
    return str(value)


def tune(rep_ms: int, emit) -> None:
    emit("## Launch settings (ours_us per pack; best marked *)\n")
    emit("| block_m | block_n | warps | stages | " + " | ".join(PACKS) + " |")
    emit("|" + "---|" * (4 + len(PACKS)))
    packs = {name: make_pack(lens, bucket) for name, (lens, bucket) in PACKS.items()}
    times = {}
    for cfg in TUNE_CONFIGS:
        block_m, block_n, warps, stages = cfg
        for name, pack in packs.items():
            try:
                fn = ours_fn(pack, block_m, block_n=block_n, num_warps=warps, num_stages=stages)
                times[cfg, name] = graph_us(fn, rep_ms)
            except Exception as exc:   # a setting that fails to compile (e.g. shared memory) is reported
                print(f"{cfg} on {name}: {exc!r}", file=sys.stderr)
                times[cfg, name] = float("nan")
    best = {name: min((c for c in TUNE_CONFIGS if times[c, name] == times[c, name]),
                      key=lambda c: times[c, name], default=None) for name in PACKS}
    for cfg in TUNE_CONFIGS:
        cells = [f"{times[cfg, name]:.1f}{'*' if best[name] == cfg else ''}" for name in PACKS]
        emit("| " + " | ".join(map(str, cfg)) + " | " + " | ".join(cells) + " |")
    emit("")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="markdown table path")
    parser.add_argument("--tune", action="store_true", help="also time a few launch settings")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels/bench/prefill_attention.py needs a CUDA device", file=sys.stderr)
        return 2
    emit = markdown_writer(args.out)

    started = time.time()
    emit(f"# Packed prefill attention on {torch.cuda.get_device_name()} (torch {torch.__version__}, "
         f"triton {triton.__version__})\n")
    emit(f"Ouro shape: {HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, bf16. Kernel defaults: "
         f"block_m {DEFAULT_BLOCK_M}, block_n {DEFAULT_BLOCK_N}, {DEFAULT_NUM_WARPS} warps, "
         f"{DEFAULT_NUM_STAGES} stages. Times in us: do_bench medians (L2 flushed) of CUDA-graph replays; "
         f"`*_eager_us` without a graph. ratio = sdpa_loop_us / ours_us.\n")
    emit("| " + " | ".join(COLUMNS) + " |")
    emit("|" + "---|" * len(COLUMNS))
    for name, (lens, bucket) in PACKS.items():
        row = bench_pack(name, lens, bucket, args.rep_ms)
        emit("| " + " | ".join(fmt(row[c]) for c in COLUMNS) + " |")
        torch.cuda.empty_cache()
    emit("")
    if args.tune:
        tune(args.rep_ms, emit)
    emit(f"Elapsed {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
