"""Microbenchmark: kernels/wgmma_gemm.py (weight tiles into shared memory before the PDL wait) against kernels/gemm.py.

Two kinds of CUDA-graph chain, every weight byte from HBM (distinct weight copies, together >= 256 MB):

- **per shape**: back-to-back calls of one Ouro-1.4B projection (qkv 6144x2048, o_proj 2048x2048, gate_up
  11264x2048, down 2048x5632) at M rows, us a call, for ``gemm.gemm`` as configured (``gemm.CONFIGS``) and for
  each wgmma variant at the same split-K;
- **layer**: qkv, o_proj, gate_up, down in the decode loop's order, us a layer (the four launches), so each
  kernel follows another shape as in the engine.

``pct``: weight + activation + output bytes (bf16; fp32 partials where split) over the time, as a percentage of a
device-to-device copy ceiling measured in the same run. ``max_abs_diff``: against ``gemm.gemm`` at the same split
(``bitwise``: equal). A variant is ``WgmmaConfig`` field overrides (``wgmma_gemm.parse_overrides``), e.g. ``pre=0`` or
``block_n=128,stages=3,pre=3,early_trigger=1``; ``split_k`` defaults to the shape's ``gemm.CONFIGS`` split.
Usage: ``PYTHONPATH=<repo> python3 kernels/bench/wgmma_gemm.py --out $OUT/wgmma.md``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from loopbench.kernels import gemm as gm
from loopbench.kernels import wgmma_gemm as wg
from loopbench.kernels.bench.decode_attention import MIN_WORKING_SET, copy_ceiling_bytes_per_s, graph_ms_per_call
from loopbench.kernels.bench.sync_cost import write_table

SHAPES = {"qkv": (6144, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
DEFAULT_VARIANTS = ("pre=0", "", "early_trigger=1", "pre=0,early_trigger=1", "stages=6,pre=6,early_trigger=1",
                    "block_n=128,stages=3,pre=3,early_trigger=1")
COLUMNS = ("chain", "m", "kernel", "variant", "us", "pct", "vs_gemm", "max_abs_diff", "bitwise")


def _moved(n: int, k: int, m: int, split: int) -> int:
    return 2 * (n * k + m * k) + (4 * split * m * n if split > 1 else 2 * m * n)


def _weights(n: int, k: int, copies: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [0.02 * torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, str]:
    return (a.float() - b.float()).abs().max().item(), "yes" if torch.equal(a, b) else "no"


def per_shape(name: str, m: int, variants: list[str], ceiling: float) -> list[dict]:
    n, k = SHAPES[name]
    cfg = gm.CONFIGS[(n, k)]
    ws = _weights(n, k, max(4, -(-MIN_WORKING_SET // (2 * n * k))), 0)
    x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
    ref = gm.gemm(x, ws[0], cfg)
    base = graph_ms_per_call([lambda w=w: gm.gemm(x, w, cfg) for w in ws]) * 1e3
    moved = _moved(n, k, m, cfg.split_k)
    rows = [dict(chain="shape", m=m, kernel=name, variant="gemm as configured", us=base,
                 pct=100 * moved / (base * 1e-6) / ceiling, vs_gemm=1.0, max_abs_diff=0.0, bitwise="yes")]
    for v in variants:
        wc = wg.WgmmaConfig(**{"split_k": cfg.split_k, **wg.parse_overrides(v)})
        diff, same = _compare(wg.gemm(x, ws[0], wc), ref)
        us = graph_ms_per_call([lambda w=w: wg.gemm(x, w, wc) for w in ws]) * 1e3
        rows.append(dict(chain="shape", m=m, kernel=name, variant=v or "default", us=us,
                         pct=100 * moved / (us * 1e-6) / ceiling, vs_gemm=base / us, max_abs_diff=diff, bitwise=same))
    del ws
    torch.cuda.empty_cache()
    return rows


def layer(m: int, variants: list[str], ceiling: float) -> list[dict]:
    """The four projections in the loop's order, one graph node chain of ``copies`` layers."""
    per_layer = sum(2 * n * k for n, k in SHAPES.values())
    copies = max(4, -(-MIN_WORKING_SET // per_layer))
    ws = {s: _weights(*SHAPES[s], copies, i) for i, s in enumerate(SHAPES)}
    xs = {s: torch.randn((m, SHAPES[s][1]), device="cuda", dtype=torch.bfloat16) for s in SHAPES}
    moved = sum(_moved(n, k, m, gm.CONFIGS[(n, k)].split_k) for n, k in SHAPES.values())

    def chain(run):
        return [lambda i=i: [run(s, ws[s][i]) for s in SHAPES] for i in range(copies)]

    base = graph_ms_per_call(chain(lambda s, w: gm.gemm(xs[s], w, gm.CONFIGS[SHAPES[s]]))) * 1e3
    rows = [dict(chain="layer", m=m, kernel="qkv,o_proj,gate_up,down", variant="gemm as configured", us=base,
                 pct=100 * moved / (base * 1e-6) / ceiling, vs_gemm=1.0, max_abs_diff=0.0, bitwise="yes")]
    for v in variants:
        over = wg.parse_overrides(v)
        cfgs = {s: wg.WgmmaConfig(**{"split_k": gm.CONFIGS[SHAPES[s]].split_k, **over}) for s in SHAPES}
        us = graph_ms_per_call(chain(lambda s, w: wg.gemm(xs[s], w, cfgs[s]))) * 1e3
        rows.append(dict(chain="layer", m=m, kernel="qkv,o_proj,gate_up,down", variant=v or "default", us=us,
                         pct=100 * moved / (us * 1e-6) / ceiling, vs_gemm=base / us, max_abs_diff=float("nan"),
                         bitwise=""))
    del ws
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="markdown table path (a .csv is written beside it)")
    ap.add_argument("--ms", type=int, nargs="+", default=[16, 32], help="rows (batch sizes), 1..64")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), metavar="FIELD=INT,...",
                    help="WgmmaConfig overrides per variant ('' for the defaults)")
    args = ap.parse_args(argv)
    bad = [m for m in args.ms if not 1 <= m <= 64]
    if bad:
        ap.error(f"--ms {bad[0]} is outside 1..64")
    for v in args.variants:
        try:
            wg.parse_overrides(v)
        except (ValueError, TypeError) as exc:
            ap.error(str(exc))
    if not torch.cuda.is_available():
        print("kernels/bench/wgmma_gemm.py needs a CUDA device", file=sys.stderr)
        return 2
    ceiling = copy_ceiling_bytes_per_s()
    rows = []
    for m in args.ms:
        rows += layer(m, args.variants, ceiling)
        for s in args.shapes:
            rows += per_shape(s, m, args.variants, ceiling)
    head = (f"# wgmma_gemm vs gemm on {torch.cuda.get_device_name()} (torch {torch.__version__}, triton "
            f"{__import__('triton').__version__})\n\nCopy ceiling (read + write): {ceiling / 1e9:.0f} GB/s. "
            f"CUDA-graph chains over distinct weight copies; us a call (shape) or a layer of four launches (layer).\n")
    write_table(head, rows, COLUMNS, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
