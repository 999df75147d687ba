"""Microbenchmark of the depth-aware decode-attention kernel on CUDA (a script, not a test).

For Ouro-1.4B's attention shape (16 heads, head_dim 128, bf16, block_size 16) and every batch ``B`` in
{1, 16, 32, 64, 128} x context in {128, 256, 1024, 4096} it reports:

- time per call of ``native``, ``alias`` and ``alias`` + ``prefix_tiles``, and alias / prefix time relative
  to native. Calls are captured back to back in one CUDA graph (as the engine runs them), over enough
  independent copies of the block tables that the K/V they read (at least 256 MB) cannot sit in L2; the
  time is the ``triton.testing.do_bench`` median of a replay (L2 flushed before each) divided by the copies;
- bytes the call needs to read (K and V of every key once, q, the output write, block tables and row
  metadata; the alias layout's exit-map reads count as its overhead, not as needed bytes) and the achieved
  GB/s of ``native`` against a copy ceiling measured here (a large device-to-device copy, read + write bytes);
- dense ``torch.nn.functional.scaled_dot_product_attention`` on contiguous K/V of the same size (cuDNN /
  flash backends) as an outside yardstick;
- whether the three layouts gave bitwise-identical outputs.

Extra variants (``--variants``) time the same workload with a scheduling knob changed (``noahead``: the
routed loop reads the exit map in the iteration that uses it; ``nocap`` / ``cap``: no register cap / always
128 registers, where the default caps only a grid of more than 3 programs per SM; ``latekv``: the PDL wait
before the first loads, ``early_kv=False``; ``early``: each call releases the next right after its wait, so
with back-to-back calls the next one's loads before its wait overlap this one; ``pf8_early``: that, with the
next 8 K/V tiles asked of L2 before the wait, ``prefetch_kv=8``)
or, with ``--baseline FILE``, with another version of the kernel module (``base_*``: e.g. the previous
commit's ``decode_attention.py``, timed in the same process for a like-for-like before/after). Their
times relative to this kernel's native go into extra columns; every variant must give native's bits.

Workload: one row per request at query depth 4 of 4; the first-alias position is 60% of the context and
half of the later tokens exited after loop 3 (their key is read from plane 3 by the alias layouts). The
native cache is made from the same cache with ``native_fill``, so all three layouts see identical logical KV.
Block tables are shuffled over the pool. Only planes 3 and 4 own physical blocks (planes 1-2 are never read
by a depth-4 query whose keys exited at 3 or 4, so their table entries point at plane 3's blocks).

Usage: ``PYTHONPATH=<repo> python3 kernels/bench/decode_attention.py --out results/decode_attention.md
[--sweep] [--batches ...] [--contexts ...] [--variants ...] [--baseline FILE]``; ``--out`` also gets a
``.csv`` beside it. ``--sweep`` then times a few launch configurations of the kernel on a few shapes (to
choose the module defaults).
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

from loopbench.kernels.bench import markdown_writer
from loopbench.kernels.decode_attention import (DEFAULT_BLOCK_N, MIN_SPLIT_TOKENS, decode_attention,
                                                launch_config)
from loopbench.kernels.kv_write import native_fill

HEADS, KV_HEADS, HEAD_DIM, PAGE, PLANES, DEPTH = 16, 16, 128, 16, 4, 4
BATCHES = (1, 16, 32, 64, 128)
CONTEXTS = (128, 256, 1024, 4096)
FIRST_ALIAS_FRACTION = 0.6
DEVICE = "cuda"
MIN_WORKING_SET = 256 << 20      # bytes of K/V per timed graph: five times the H200's 50 MB L2


def copy_ceiling_bytes_per_s(size_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting the read and the write (the BRIEF's 4.15 TB/s anchor)."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    return 2 * size_bytes / (ms * 1e-3)


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * KV_HEADS * HEAD_DIM * 2


def make_workload(batch: int, context: int, seed: int = 0) -> dict:
    """Caches, metadata and query for ``batch`` requests of ``context`` keys each (see module docstring).

    Holds ``copies`` independent sets of block tables over one pool, together at least MIN_WORKING_SET
    bytes of K/V, so that timing back-to-back calls over the copies reads from HBM, not L2 (as the 24
    layers of a real loop do).
    """
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    copies = max(1, -(-MIN_WORKING_SET // kv_bytes(batch, context)))
    blocks_per_seq = context // PAGE
    num_blocks = copies * 2 * batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).int()
    perm = perm.view(copies, batch, 2, blocks_per_seq)
    k_cache = torch.randn((num_blocks, PAGE, KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE,
                          dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)

    first_alias = int(FIRST_ALIAS_FRACTION * context)
    exit_map = torch.full((batch, context), PLANES, dtype=torch.int32, device=DEVICE)
    exit_map[:, first_alias:context - 1:2] = PLANES - 1        # half of the later tokens exited at 3
    aliased = torch.nonzero(exit_map[0] < PLANES).flatten().int()
    fill = [torch.arange(batch, device=DEVICE, dtype=torch.int32).repeat_interleave(len(aliased)),
            aliased.repeat(batch)]
    fill += [torch.full_like(fill[0], PLANES - 1), torch.full_like(fill[0], PLANES)]
    k_native, v_native = k_cache.clone(), v_cache.clone()
    rows = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    metas = []
    for c in range(copies):
        block_tables = torch.empty((batch, PLANES, blocks_per_seq), dtype=torch.int32, device=DEVICE)
        block_tables[:, :3] = perm[c, :, :1]           # planes 1-3 share plane 3's blocks (1-2 unread)
        block_tables[:, 3] = perm[c, :, 1]
        native_fill(k_native[None], v_native[None], block_tables, *fill)
        metas.append(dict(block_tables=block_tables, row_slot=rows, row_depth=torch.full_like(rows, DEPTH),
                          row_pos=torch.full_like(rows, context - 1), exit_map=exit_map,
                          row_first_alias=torch.full_like(rows, first_alias)))
    q = torch.randn((batch, HEADS, HEAD_DIM), generator=gen, device=DEVICE, dtype=torch.bfloat16)
    return dict(q=q, native=(k_native, v_native), alias=(k_cache, v_cache), metas=metas, copies=copies)


def needed_bytes(batch: int, context: int) -> int:
    """K and V of every key once, q read and out written, block-table entries and the four row vectors."""
    q_out = 2 * batch * HEADS * HEAD_DIM * 2
    metadata = batch * (context // PAGE) * 4 + 4 * batch * 4
    return kv_bytes(batch, context) + q_out + metadata


def calls(work: dict, layout: str, prefix: bool, fn=decode_attention, **kw) -> list:
    k, v = work[layout]
    return [lambda meta=meta: fn(work["q"], k, v, **meta, layout=layout, prefix_tiles=prefix, **kw)
            for meta in work["metas"]]


# Extra variants: name -> (module key, layout, prefix_tiles, keyword arguments). "new" is this checkout's
# kernel, "base" the module given with --baseline.
VARIANTS = {
    "alias_noahead": ("new", "alias", False, dict(exit_ahead=False)),
    "prefix_noahead": ("new", "alias", True, dict(exit_ahead=False)),
    "native_nocap": ("new", "native", False, dict(maxnreg=0)),
    "alias_nocap": ("new", "alias", False, dict(maxnreg=0)),
    "prefix_nocap": ("new", "alias", True, dict(maxnreg=0)),
    "native_cap": ("new", "native", False, dict(maxnreg=128)),
    "alias_cap": ("new", "alias", False, dict(maxnreg=128)),
    "prefix_cap": ("new", "alias", True, dict(maxnreg=128)),
    "native_pipe2": ("new", "native", False, dict(pipe_stages=2)),
    "native_pipe3": ("new", "native", False, dict(pipe_stages=3)),
    "native_pipe4": ("new", "native", False, dict(pipe_stages=4)),
    "native_pipe3_n64": ("new", "native", False, dict(pipe_stages=3, block_n=64)),
    "native_latekv": ("new", "native", False, dict(early_kv=False)),
    "alias_latekv": ("new", "alias", False, dict(early_kv=False)),
    "prefix_latekv": ("new", "alias", True, dict(early_kv=False)),
    "native_early": ("new", "native", False, dict(early_trigger=True)),
    "native_pf8_early": ("new", "native", False, dict(prefetch_kv=8, early_trigger=True)),
    "prefix_pf8_early": ("new", "alias", True, dict(prefetch_kv=8, early_trigger=True)),
    "base_native": ("base", "native", False, {}),
    "base_alias": ("base", "alias", False, {}),
    "base_prefix": ("base", "alias", True, {}),
}


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"bench_baseline_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graph_ms_per_call(fns: list, rep_ms: int = 100) -> float:
    """Median time of one call when ``fns`` run back to back inside one CUDA graph (as in the engine).

    Timing the graph excludes the Python launch cost, which would otherwise dominate small shapes.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                # compile and warm up outside the capture
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median")
    del graph
    return ms / len(fns)


def dense_sdpa_ms(batch: int, context: int) -> float:
    """torch SDPA over contiguous K/V of the same size, same copies-in-a-graph timing; NaN if it fails."""
    copies = max(1, -(-MIN_WORKING_SET // kv_bytes(batch, context)))
    try:
        qkv = [(torch.randn((batch, HEADS, 1, HEAD_DIM), device=DEVICE, dtype=torch.bfloat16),
                torch.randn((batch, KV_HEADS, context, HEAD_DIM), device=DEVICE, dtype=torch.bfloat16),
                torch.randn((batch, KV_HEADS, context, HEAD_DIM), device=DEVICE, dtype=torch.bfloat16))
               for _ in range(copies)]
        fns = [lambda t=t: torch.nn.functional.scaled_dot_product_attention(*t) for t in qkv]
        return graph_ms_per_call(fns)
    except Exception as exc:       # a yardstick, not the subject: report and carry on
        print(f"dense SDPA failed at B{batch}/ctx{context}: {exc!r}", file=sys.stderr)
        return float("nan")


SWEEP_SHAPES = ((16, 128), (16, 256), (32, 256), (32, 1024), (128, 1024), (64, 4096))
# (block_n, num_warps, num_stages, min_split_tokens); the first is the module default.
SWEEP_CONFIGS = ((32, 4, 1, MIN_SPLIT_TOKENS), (32, 4, 1, 256), (32, 4, 1, 128), (32, 4, 1, 64), (32, 4, 1, 32),
                 (16, 1, 1, 64), (16, 2, 1, 64), (16, 1, 1, 32), (16, 2, 1, 32), (32, 2, 1, 64), (64, 4, 1, 64),
                 (32, 4, 2, 64))


def sweep(ceiling: float, emit) -> None:
    emit("## Launch-configuration sweep (native time, % of copy ceiling, [alias+prefix / native])\n")
    shapes = " | ".join(f"B{b}/ctx{c}" for b, c in SWEEP_SHAPES)
    emit(f"| block_n | warps | stages | min_split | {shapes} |")
    emit("|" + "---|" * (4 + len(SWEEP_SHAPES)))
    works = {shape: make_workload(*shape) for shape in SWEEP_SHAPES}
    for block_n, warps, stages, min_split in SWEEP_CONFIGS:
        kw = dict(block_n=block_n, num_warps=warps, num_stages=stages, min_split_tokens=min_split)
        cells = []
        for shape, work in works.items():
            try:
                ms = graph_ms_per_call(calls(work, "native", False, **kw), rep_ms=50)
                ms_prefix = graph_ms_per_call(calls(work, "alias", True, **kw), rep_ms=50)
                pct = needed_bytes(*shape) / (ms * 1e-3) / ceiling * 100
                cells.append(f"{ms * 1e3:.1f} us {pct:.0f}% [{ms_prefix / ms:.3f}]")
            except Exception as exc:      # a config that fails to compile is reported, not fatal
                cells.append(f"error: {type(exc).__name__}")
        emit(f"| {block_n} | {warps} | {stages} | {min_split} | " + " | ".join(cells) + " |")
    del works
    torch.cuda.empty_cache()
    emit("")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="markdown table path; a .csv goes beside it")
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations")
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="*", default=list(CONTEXTS))
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="extra variants to time (base_* need --baseline)")
    parser.add_argument("--baseline", type=Path, help="another decode_attention.py to time as base_*")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the dense SDPA yardstick")
    args = parser.parse_args(argv)
    if any(VARIANTS[v][0] == "base" for v in args.variants) and args.baseline is None:
        parser.error("base_* variants need --baseline")
    if not torch.cuda.is_available():
        print("bench_decode_attention needs a CUDA device", file=sys.stderr)
        return 2
    emit = markdown_writer(args.out)

    started = time.time()
    ceiling = copy_ceiling_bytes_per_s()
    cfg = launch_config(HEAD_DIM)
    emit(f"# Decode attention on {torch.cuda.get_device_name()} (torch {torch.__version__}, "
         f"triton {triton.__version__})\n")
    emit(f"Ouro shape: {HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, bf16, block_size {PAGE}; "
         f"query depth {DEPTH}, first alias at {FIRST_ALIAS_FRACTION:.0%} of the context, half of the later "
         f"tokens aliased. Copy ceiling (read+write) {ceiling / 1e9:.0f} GB/s. Kernel defaults: block_n "
         f"{DEFAULT_BLOCK_N}, min split {MIN_SPLIT_TOKENS} tokens, {cfg}. Times are per call: a CUDA-graph "
         f"replay of `copies` back-to-back calls (do_bench median) divided by `copies`.\n")
    modules = {"new": decode_attention}
    if args.baseline is not None:
        modules["base"] = load_module(args.baseline).decode_attention
        emit(f"Baseline (`base_*` columns): `{args.baseline.name}`, timed in the same process.\n")
    emit("## Native vs alias vs alias+prefix\n")
    columns = ["batch", "context", "native_us", "alias_us", "prefix_us", "alias_rel", "prefix_rel",
               "sdpa_dense_us", "bytes_read", "native_gb_s", "pct_of_copy_ceiling", "bitwise_equal", "copies"]
    columns += [f"{name}_rel" for name in args.variants]
    emit("| " + " | ".join(columns) + " |")
    emit("|" + "---|" * len(columns))
    records = []
    for context in args.contexts:
        for batch in args.batches:
            work = make_workload(batch, context)
            variants = {"native": ("new", "native", False, {}), "alias": ("new", "alias", False, {}),
                        "prefix": ("new", "alias", True, {})}
            variants.update({name: VARIANTS[name] for name in args.variants})
            fns = {name: calls(work, layout, prefix, fn=modules[mod], **kw)
                   for name, (mod, layout, prefix, kw) in variants.items()}
            outs = {name: f[0]() for name, f in fns.items()}
            bitwise = all(torch.equal(outs["native"], o) for o in outs.values())
            ms = {name: graph_ms_per_call(f, rep_ms=args.rep_ms) for name, f in fns.items()}
            copies = work["copies"]
            del work, outs, fns
            torch.cuda.empty_cache()
            sdpa_ms = float("nan") if args.no_sdpa else dense_sdpa_ms(batch, context)
            torch.cuda.empty_cache()
            nbytes = needed_bytes(batch, context)
            native_ms = ms["native"]
            gbs = nbytes / (native_ms * 1e-3) / 1e9
            rec = dict(batch=batch, context=context, native_us=native_ms * 1e3, alias_us=ms["alias"] * 1e3,
                       prefix_us=ms["prefix"] * 1e3, alias_rel=ms["alias"] / native_ms,
                       prefix_rel=ms["prefix"] / native_ms, sdpa_dense_us=sdpa_ms * 1e3, bytes_read=nbytes,
                       native_gb_s=gbs, pct_of_copy_ceiling=gbs * 1e9 / ceiling * 100, bitwise_equal=bitwise,
                       copies=copies)
            rec.update({f"{name}_rel": ms[name] / native_ms for name in args.variants})
            records.append(rec)
            emit("| " + " | ".join(_fmt(rec[c]) for c in columns) + " |")
    emit("")
    if args.sweep:
        sweep(ceiling, emit)
    emit(f"(total {time.time() - started:.0f} s)")
    with args.out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)
    return 0


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
