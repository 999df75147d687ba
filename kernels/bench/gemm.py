"""Microbenchmark: our small-M GEMM (kernels/gemm.py, ``CONFIGS``) against cuBLAS at Ouro's projections.

For each Ouro-1.4B decode projection (bf16 weight ``[N, K]``: qkv 6144x2048, o_proj 2048x2048, gate_up
11264x2048, down 2048x5632, lm_head 49152x2048) and M in ``--ms`` rows it times, as the engine runs them,
a CUDA graph of back-to-back calls over distinct weight copies (together >= 256 MB, five times the H200's
L2, so every weight byte comes from HBM) and reports the time per call:

- ``cublas_us``: ``torch.matmul(x, w.t(), out=...)`` (what ``F.linear`` runs);
- ``ours_us``: :func:`kernels.gemm.gemm` with the shape's configuration; for split-K shapes its fp32
  partials, whose in-order sum the engine folds into the next kernel (``fused_ops.add_rms_norm``), and
  ``ours_reduced_us`` the same plus :func:`kernels.gemm.reduce_partials` (a standalone consumer);
- ``*_pct``: (weight + activation + output bytes, bf16, each once) / time as a percentage of a
  device-to-device copy ceiling measured in the same run (read + write bytes);
- ``max_abs_diff`` of ours against cuBLAS at that M.

Prints a markdown table and writes it to ``--out`` with a ``.csv`` beside it. ``--swiglu`` adds a table of
gate_up with its SwiGLU activation: two launches (cuBLAS or ours, then ``fused_ops.silu_mul``) against
:func:`kernels.gemm.gemm_swiglu` at a few configurations; ``--qkv-rope`` one of the qkv projection with RoPE
and the KV write: two launches against :func:`kernels.qkv_rope.qkv_rope_write_kv`.
Usage: ``PYTHONPATH=<repo> python3 kernels/bench/gemm.py --out $OUT/gemm_h200.md``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from loopbench.kernels import gemm as gm
from loopbench.kernels.bench import table_lines, write_report
from loopbench.kernels.bench.decode_attention import MIN_WORKING_SET, copy_ceiling_bytes_per_s, graph_ms_per_call

SHAPES = {"qkv": (6144, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (49152, 2048)}
COLUMNS = ("shape", "n", "k", "m", "config", "cublas_us", "ours_us", "ours_reduced_us", "cublas_pct", "ours_pct",
           "speedup", "max_abs_diff")


def moved_bytes(n: int, k: int, m: int) -> int:
    """Weight, activations and output once each, bf16."""
    return 2 * (n * k + m * k + m * n)


def measure(name: str, m: int, ceiling: float) -> dict:
    n, k = SHAPES[name]
    cfg = gm.CONFIGS[(n, k)]
    copies = max(4, -(-MIN_WORKING_SET // (2 * n * k)))
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [0.02 * torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn((m, k), generator=g, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty((m, n), device="cuda", dtype=torch.bfloat16) for _ in ws]
    cublas = graph_ms_per_call([lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)]) * 1e3
    ours = graph_ms_per_call([lambda w=w: gm.gemm(x, w, cfg) for w in ws]) * 1e3
    reduced = graph_ms_per_call([lambda w=w: gm.linear(x, w, cfg) for w in ws]) * 1e3 if cfg.split_k > 1 else ours
    diff = (gm.linear(x, ws[0], cfg).float() - torch.matmul(x, ws[0].t()).float()).abs().max().item()
    moved = moved_bytes(n, k, m)
    row = dict(shape=name, n=n, k=k, m=m, config=_config_label(cfg), cublas_us=cublas, ours_us=ours,
               ours_reduced_us=reduced, cublas_pct=100 * moved / (cublas * 1e-6) / ceiling,
               ours_pct=100 * moved / (ours * 1e-6) / ceiling, speedup=cublas / ours, max_abs_diff=diff)
    del ws, outs
    torch.cuda.empty_cache()
    return row


SWIGLU_CANDIDATES = [gm.GemmConfig(block_n=bn, block_k=128, num_stages=4, tma=tma, pdl=True)
                     for bn in (32, 64) for tma in (True, False)]


def measure_swiglu(m: int) -> list[dict]:
    """gate_up + SwiGLU at ``m`` rows, us per call: cuBLAS then silu_mul, ours then silu_mul, and
    :func:`kernels.gemm.gemm_swiglu` (one launch) at each candidate configuration, with bitwise checks."""
    from loopbench.kernels import fused_ops as fo
    n, k = SHAPES["gate_up"]
    copies = max(4, -(-MIN_WORKING_SET // (2 * n * k)))
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [0.02 * torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn((m, k), generator=g, device="cuda", dtype=torch.bfloat16)
    plain = gm.CONFIGS[(n, k)]
    rows = [dict(variant="cublas + silu_mul", m=m,
                 us=graph_ms_per_call([lambda w=w: fo.silu_mul(torch.matmul(x, w.t())) for w in ws]) * 1e3,
                 bitwise_two_launch="")]
    rows.append(dict(variant=f"ours {_config_label(plain)} + silu_mul", m=m,
                     us=graph_ms_per_call([lambda w=w: fo.silu_mul(gm.gemm(x, w, plain)) for w in ws]) * 1e3,
                     bitwise_two_launch=""))
    for cfg in SWIGLU_CANDIDATES:
        two = fo.silu_mul(gm.gemm(x, ws[0], cfg))
        same = torch.equal(gm.gemm_swiglu(x, ws[0], cfg), two)
        rows.append(dict(variant=f"gemm_swiglu {_config_label(cfg)}", m=m,
                         us=graph_ms_per_call([lambda w=w, c=cfg: gm.gemm_swiglu(x, w, c) for w in ws]) * 1e3,
                         bitwise_two_launch="yes" if same else "NO"))
    del ws
    torch.cuda.empty_cache()
    return rows


def measure_qkv_rope(m: int) -> list[dict]:
    """qkv + RoPE + KV write at ``m`` rows (Ouro: 16 + 16 + 16 heads of 128, one row per slot at depth 1,
    position 100), us per call: ours then ``rope_write_kv_`` (two launches), cuBLAS then it, and
    :func:`kernels.qkv_rope.qkv_rope_write_kv` (one launch), with the bitwise check against the first."""
    from loopbench.kernels import qkv_rope
    from loopbench.kernels.kv_write import rope_write_kv_
    n, k = SHAPES["qkv"]
    heads, d, page = 16, 128, 16
    copies = max(4, -(-MIN_WORKING_SET // (2 * n * k)))
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [0.02 * torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn((m, k), generator=g, device="cuda", dtype=torch.bfloat16)
    blocks = 8
    caches = [torch.zeros((m * 4 * blocks + 1, page, heads, d), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    tables = (1 + torch.arange(m * 4 * blocks, device="cuda", dtype=torch.int32)).view(m, 4, blocks)
    rows = (torch.arange(m, device="cuda", dtype=torch.int32), torch.ones(m, device="cuda", dtype=torch.int32),
            torch.full((m,), 100, device="cuda", dtype=torch.int32))
    cos = torch.randn((256, d // 2), device="cuda")
    sin = torch.randn((256, d // 2), device="cuda")
    plain, fused = gm.CONFIGS[(n, k)], qkv_rope.CONFIGS[(n, k)]

    def two(w, c=plain):
        return rope_write_kv_(gm.gemm(x, w, c), cos, sin, *caches, tables, *rows, heads)

    def one(w):
        return qkv_rope.qkv_rope_write_kv(x, w, fused, cos, sin, *caches, tables, *rows, heads)

    same = torch.equal(one(ws[0]), two(ws[0], fused))
    out = [dict(variant=f"ours {_config_label(plain)} + rope_write_kv_", m=m,
                us=graph_ms_per_call([lambda w=w: two(w) for w in ws]) * 1e3, bitwise_two_launch=""),
           dict(variant="cublas + rope_write_kv_", m=m, bitwise_two_launch="",
                us=graph_ms_per_call([lambda w=w: rope_write_kv_(torch.matmul(x, w.t()), cos, sin, *caches, tables,
                                                                  *rows, heads) for w in ws]) * 1e3),
           dict(variant=f"qkv_rope_write_kv {_config_label(fused)}", m=m, bitwise_two_launch="yes" if same else "NO",
                us=graph_ms_per_call([lambda w=w: one(w) for w in ws]) * 1e3)]
    del ws, caches
    torch.cuda.empty_cache()
    return out


def _config_label(c: gm.GemmConfig) -> str:
    return (f"n{c.block_n}-k{c.block_k}-s{c.split_k}-st{c.num_stages}-w{c.num_warps}"
            f"{'-tma' if c.tma else ''}{'-pdl' if c.pdl else ''}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="markdown table path (a .csv is written beside it)")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 32, 64, 128], help="rows (batch sizes)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--swiglu", action="store_true", help="also time gate_up + SwiGLU: two launches vs gemm_swiglu")
    ap.add_argument("--qkv-rope", action="store_true",
                    help="also time qkv + RoPE + KV write: two launches vs kernels/qkv_rope.py")
    args = ap.parse_args(argv)
    bad = [m for m in args.ms if not 1 <= m <= gm.MAX_M]
    if bad:
        ap.error(f"--ms {bad[0]} is outside 1..{gm.MAX_M}")
    if not torch.cuda.is_available():
        print("kernels/bench/gemm.py needs a CUDA device", file=sys.stderr)
        return 2
    ceiling = copy_ceiling_bytes_per_s()
    rows = [measure(s, m, ceiling) for s in args.shapes for m in args.ms]
    lines = [f"# Small-M GEMM vs cuBLAS on {torch.cuda.get_device_name()} (torch {torch.__version__}, "
             f"triton {__import__('triton').__version__})", "",
             f"Copy ceiling (read + write): {ceiling / 1e9:.0f} GB/s. Times: CUDA-graph chains, us per call.", "",
             *table_lines(COLUMNS, rows)]
    if args.swiglu:
        lines += ["", "gate_up with SwiGLU (us per call; `bitwise_two_launch`: gemm_swiglu == gemm then silu_mul "
                  "at that configuration)", "", "| variant | m | us | bitwise_two_launch |", "|---|---|---|---|"]
        for m in args.ms:
            lines += [f"| {r['variant']} | {r['m']} | {r['us']:.2f} | {r['bitwise_two_launch']} |"
                      for r in measure_swiglu(m)]
    if args.qkv_rope:
        lines += ["", "qkv with RoPE and the KV write (us per call; `bitwise_two_launch`: the fused kernel == its "
                  "configuration's gemm then rope_write_kv_)", "", "| variant | m | us | bitwise_two_launch |",
                  "|---|---|---|---|"]
        for m in args.ms:
            lines += [f"| {r['variant']} | {r['m']} | {r['us']:.2f} | {r['bitwise_two_launch']} |"
                      for r in measure_qkv_rope(m)]
    write_report(args.out, lines, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
