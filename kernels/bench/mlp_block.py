"""Microbenchmark: the layer's half after attention as one persistent launch (kernels/mlp_block.py) against the five
launches the fused decode loop runs today.

For each M in ``--ms`` it times, as the engine runs them, a CUDA graph of back-to-back layers over distinct weight
copies (together >= 256 MB, five times the H200's L2, so every weight byte comes from HBM), PDL as configured:

- ``five``: o_proj (``gemm.gemm``, split-K partials), ``fused_ops.add_rms_norm``, ``gemm.gemm_swiglu``, down
  (partials), ``fused_ops.add_rms_norm``: runtime/model.py's ``_run_loop_fused`` with its default switches, and in
  ``stage_us`` each of the five alone, as a chain of its own;
- ``block:<label>``: :func:`kernels.mlp_block.mlp_block` at each configuration of ``VARIANTS``, and ``stage_us``
  each of its stages alone, as a chain of its own (``staged``, ``only``: no barrier, no PDL).

Per layer: microseconds, bytes (o_proj, gate_up and down weights once, bf16) over time as a percentage of a
device-to-device copy ceiling measured in the same run (read + write bytes), and for each block the largest
difference of (x2, h2) from ``five`` (not bitwise: two kernels' orders) and whether the one launch is bitwise its
staged form (``staged=True``, five launches of the same code).

Prints a markdown table and writes it to ``--out`` with a ``.csv`` beside it (``sync_cost.write_table``).
Usage: ``PYTHONPATH=<repo> python3 kernels/bench/mlp_block.py --out $OUT/mlp_block_h100.md`` (CUDA only).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

from loopbench.kernels import fused_ops as fo
from loopbench.kernels import gemm as gm
from loopbench.kernels import mlp_block as mb
from loopbench.kernels import mlp_ring as mr
from loopbench.kernels import wgmma_gemm as wg
from loopbench.kernels.bench import sync_cost as sc
from loopbench.kernels.bench.decode_attention import MIN_WORKING_SET, copy_ceiling_bytes_per_s, graph_ms_per_call

HIDDEN, INTER, EPS = 2048, 5632, 1e-6
VARIANTS = {       # the configuration kept (mb.CONFIGS), then one change each
    "kept": mb.CONFIGS[(HIDDEN, INTER)],
    "no_l2_prefetch": mb.MlpBlockConfig(pre_o=0, pre_u=0, pre_d=0),
    "l2_prefetch_512": mb.MlpBlockConfig(pre_o=512, pre_u=512, pre_d=512),
    "u_bn16": mb.MlpBlockConfig(u_bn=16),
    "u_block_k128": mb.MlpBlockConfig(u_block_k=None),
    "warps8": mb.MlpBlockConfig(num_warps=8),
    "stages3": mb.MlpBlockConfig(num_stages=3),
    "u_bn16_stages5": mb.MlpBlockConfig(u_bn=16, num_stages=5),
    "2_per_sm": mb.MlpBlockConfig(o_bn=32, d_bn=32, u_bn=16, programs_per_sm=2),
}
RING_VARIANTS = {   # kernels/mlp_ring.py: ring depth (weight tiles of 16 KB) and activation tiles in flight
    "s12x4": mr.RingConfig(stages=12, x_stages=4),
    "s8x4": mr.RingConfig(stages=8, x_stages=4),
    "s10x2": mr.RingConfig(stages=10, x_stages=2),
    "s4x2": mr.RingConfig(stages=4, x_stages=2),
}
STAGE_NAMES = ("O", "N1", "U", "D", "N2")
COLUMNS = ("m", "path", "us_per_layer", "gb_per_s", "pct_ceiling", "speedup", "max_abs_diff", "bitwise_staged",
           "stage_us")


def weight_bytes() -> int:
    return 2 * (HIDDEN * HIDDEN + 2 * INTER * HIDDEN + HIDDEN * INTER)


def _layers(copies: int):
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, scale):
        return scale * torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    return [dict(w_o=r(HIDDEN, HIDDEN, scale=0.02), gate_up=r(2 * INTER, HIDDEN, scale=0.02),
                 down=r(HIDDEN, INTER, scale=0.015),
                 lns=[1 + r(HIDDEN, scale=0.1) for _ in range(4)]) for _ in range(copies)]


def _half(a, x, layer, project):
    """This half of a layer as the fused loop launches it, o_proj and down by ``project(rows, weight)`` (split-K
    partials), the norms and gate_up + SwiGLU as configured: (x2, h2)."""
    ln_in2, ln_post, ln_post2, ln_next = layer["lns"]
    x1, h1 = fo.add_rms_norm(x, project(a, layer["w_o"]), ln_in2, ln_post, EPS)
    act = gm.gemm_swiglu(h1, layer["gate_up"], gm.SWIGLU_CONFIGS[(2 * INTER, HIDDEN)])
    return fo.add_rms_norm(x1, project(act, layer["down"]), ln_post2, ln_next, EPS)


def five(a, x, layer):
    """The fused loop's five launches for this half of a layer, o_proj and down on kernels/gemm.py: (x2, h2)."""
    return _half(a, x, layer, lambda t, w: gm.gemm(t, w, gm.CONFIGS[tuple(w.shape)]))


def now(a, x, layer):
    """The decode loop's path as configured today: o_proj and down on kernels/wgmma_gemm.py (split-K partials,
    releasing early), gate_up + SwiGLU on gemm.gemm_swiglu: (x2, h2)."""
    return _half(a, x, layer, lambda t, w: wg.gemm(t, w, wg.CONFIGS[tuple(w.shape)]))


def ring(a, x, layer, cfg, counters, diag=0):
    return mr.mlp_ring(a, x, layer["w_o"], layer["gate_up"], layer["down"], *layer["lns"], EPS, cfg, counters,
                       _diag=diag)


TRACE_POINTS = ("start", "pdl_wait", "O_done", "bar0", "N1_done", "bar1", "U_done", "bar2", "D_done", "bar3",
                "end")


def trace_summary(a, x, layers, cfg, counters, diag=0) -> str:
    """One traced launch after a chain of untraced ones (layers 0-2 then layer 3 traced, eagerly; ``diag``: the ring's
    timing switches for all four): per stage point the median and max over programs of its %globaltimer minus the
    earliest start, in us (points a program skips: none)."""
    trace = torch.full((gm.sm_count("cuda"), 16), -1, dtype=torch.int64, device="cuda")
    for w in layers[:3]:
        ring(a, x, w, cfg, counters, diag)
    mr.mlp_ring(a, x, layers[3]["w_o"], layers[3]["gate_up"], layers[3]["down"], *layers[3]["lns"], EPS, cfg,
                counters, _diag=diag, _trace=trace)
    torch.cuda.synchronize()
    t = trace[:, :len(TRACE_POINTS)].double()
    t0 = t[:, 0].min()
    parts = []
    for i, name in enumerate(TRACE_POINTS):
        col = t[:, i][t[:, i] >= 0]
        if col.numel():
            us = (col - t0) / 1e3
            parts.append(f"{name} {us.median().item():.2f}/{us.max().item():.2f}")
    return "us from first start (median/max over programs): " + ", ".join(parts)


def block(a, x, layer, cfg, counters, staged=False, only=None):
    return mb.mlp_block(a, x, layer["w_o"], layer["gate_up"], layer["down"], *layer["lns"], EPS, cfg, counters,
                        staged=staged, only=only)


def measure(m: int, layers: list, ceiling: float, paths: tuple[str, ...] = ("five", "now", "ring", "block")) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(m)
    a = torch.randn((m, HIDDEN), generator=g, device="cuda", dtype=torch.bfloat16)
    x = torch.randn((m, HIDDEN), generator=g, device="cuda", dtype=torch.bfloat16)
    base = five(a, x, layers[0])
    rows = []
    base_us = graph_ms_per_call([lambda w=w: five(a, x, w) for w in layers]) * 1e3
    o = gm.gemm(a, layers[0]["w_o"], gm.CONFIGS[(HIDDEN, HIDDEN)])
    h1 = fo.add_rms_norm(x, o, *layers[0]["lns"][:2], EPS)[1]
    act = gm.gemm_swiglu(h1, layers[0]["gate_up"], gm.SWIGLU_CONFIGS[(2 * INTER, HIDDEN)])
    d = gm.gemm(act, layers[0]["down"], gm.CONFIGS[(HIDDEN, INTER)])
    alone = [                                           # each of the five launches as a chain of its own
        lambda w: gm.gemm(a, w["w_o"], gm.CONFIGS[(HIDDEN, HIDDEN)]),
        lambda w: fo.add_rms_norm(x, o, *w["lns"][:2], EPS),
        lambda w: gm.gemm_swiglu(h1, w["gate_up"], gm.SWIGLU_CONFIGS[(2 * INTER, HIDDEN)]),
        lambda w: gm.gemm(act, w["down"], gm.CONFIGS[(HIDDEN, INTER)]),
        lambda w: fo.add_rms_norm(x, d, *w["lns"][2:], EPS)]
    per_kernel = [graph_ms_per_call([lambda w=w, f=f: f(w) for w in layers]) * 1e3 for f in alone]
    rows.append(dict(m=m, path="five", us_per_layer=base_us, max_abs_diff=0.0, bitwise_staged="",
                     stage_us=" ".join(f"{n}={t:.2f}" for n, t in zip(STAGE_NAMES, per_kernel))))
    if "now" in paths:
        got = now(a, x, layers[0])
        us = graph_ms_per_call([lambda w=w: now(a, x, w) for w in layers]) * 1e3
        rows.append(dict(m=m, path="now", us_per_layer=us, bitwise_staged="", stage_us="",
                         max_abs_diff=max((o.float() - b.float()).abs().max().item() for o, b in zip(got, base))))
    for label, cfg in (RING_VARIANTS.items() if "ring" in paths else ()):
        counters = mr.new_counters("cuda")
        try:
            got = ring(a, x, layers[0], cfg, counters)
        except ValueError as e:
            rows.append(dict(m=m, path=f"ring:{label}", us_per_layer=float("nan"), max_abs_diff=float("nan"),
                             bitwise_staged=f"does not fit: {e}", stage_us=""))
            continue
        torch.cuda.synchronize()
        us = graph_ms_per_call([lambda w=w: ring(a, x, w, cfg, counters) for w in layers]) * 1e3
        again = ring(a, x, layers[0], cfg, counters)
        rows.append(dict(m=m, path=f"ring:{label}", us_per_layer=us, stage_us="",
                         bitwise_staged=f"repeat bitwise {all(torch.equal(o, b) for o, b in zip(got, again))}",
                         max_abs_diff=max((o.float() - b.float()).abs().max().item() for o, b in zip(got, base))))
        if label == "s8x4":      # where the ring's time goes: the stage trace, lean barriers, without barriers and
            # norms, without the norms alone (barriers kept), without MMAs, neither
            print(f"M={m} {label}: " + trace_summary(a, x, layers, cfg, counters), flush=True)
            print(f"M={m} {label} lean barriers: " + trace_summary(a, x, layers, cfg, counters, 4), flush=True)
            lean = ring(a, x, layers[0], cfg, counters, 4)
            us = graph_ms_per_call([lambda w=w: ring(a, x, w, cfg, counters, 4) for w in layers]) * 1e3
            rows.append(dict(m=m, path=f"ring:{label}:lean_barriers", us_per_layer=us, stage_us="",
                             bitwise_staged=f"bitwise the measured barriers' {all(torch.equal(o, b) for o, b in zip(lean, got))}",
                             max_abs_diff=max((o.float() - b.float()).abs().max().item() for o, b in zip(lean, base))))
            for diag, what in ((1, "no_sync"), (8, "barriers_no_norms"), (12, "lean_barriers_no_norms"),
                               (2, "no_mma"), (3, "stream_only")):
                us = graph_ms_per_call([lambda w=w: ring(a, x, w, cfg, counters, diag) for w in layers]) * 1e3
                rows.append(dict(m=m, path=f"ring:{label}:{what}", us_per_layer=us, stage_us="",
                                 bitwise_staged="timing only", max_abs_diff=float("nan")))
    for label, cfg in (VARIANTS.items() if "block" in paths else ()):
        counters = mb.new_counters("cuda")      # one grid a counters tensor (mb.claim_counters)
        try:
            block(a, x, layers[0], cfg, counters)
        except (triton.runtime.errors.OutOfResources, ValueError) as e:     # a configuration that does not fit: say so
            rows.append(dict(m=m, path=f"block:{label}", us_per_layer=float("nan"), max_abs_diff=float("nan"),
                             bitwise_staged=f"does not fit: {e}", stage_us=""))
            continue
        us = graph_ms_per_call([lambda w=w: block(a, x, w, cfg, counters) for w in layers]) * 1e3
        one = block(a, x, layers[0], cfg, counters)
        staged = block(a, x, layers[0], cfg, counters, staged=True)
        diff = max((o.float() - b.float()).abs().max().item() for o, b in zip(one, base))
        bitwise = all(torch.equal(o, s) for o, s in zip(one, staged))
        per_stage = [graph_ms_per_call([lambda w=w: block(a, x, w, cfg, None, True, (s,)) for w in layers]) * 1e3
                     for s in range(len(STAGE_NAMES))]
        rows.append(dict(m=m, path=f"block:{label}", us_per_layer=us, max_abs_diff=diff, bitwise_staged=bitwise,
                         stage_us=" ".join(f"{n}={t:.2f}" for n, t in zip(STAGE_NAMES, per_stage))))
    for row in rows:
        row["gb_per_s"] = weight_bytes() / (row["us_per_layer"] * 1e-6) / 1e9
        row["pct_ceiling"] = 100 * row["gb_per_s"] * 1e9 / ceiling
        row["speedup"] = base_us / row["us_per_layer"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--paths", nargs="+", default=["five", "now", "ring", "block"],
                    choices=["five", "now", "ring", "block"], help="what to time beside five (always timed)")
    args = ap.parse_args(argv)
    bad = [m for m in args.ms if not 1 <= m <= mb.MAX_M]
    if bad:
        ap.error(f"--ms must lie in 1..{mb.MAX_M}, got {bad}")
    if not torch.cuda.is_available():
        print("mlp_block bench needs CUDA", file=sys.stderr)
        return 2
    ceiling = copy_ceiling_bytes_per_s()
    layers = _layers(max(4, -(-MIN_WORKING_SET // weight_bytes())))
    rows = [r for m in args.ms for r in measure(m, layers, ceiling, tuple(args.paths))]
    head = (f"{torch.cuda.get_device_name()}, copy ceiling {ceiling / 1e9:.0f} GB/s, {len(layers)} weight copies of "
            f"{weight_bytes() / 1e6:.1f} MB, graph-chain time per layer\n")
    sc.write_table(head, rows, COLUMNS, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
