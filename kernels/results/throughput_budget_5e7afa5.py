"""What issue 11's targets ask of the decode loop, derived from committed measurements only.

Reads the native arm's runs of results/2026-12-04-ouro-1.4b-5e7afa5 (tables/roofline.parquet: the decode loops'
GPU time and bytes per run; tables/arms.parquet: each run's wall time and tokens/s) and the small-M GEMM table
kernels/results/gemm_h200_9199ea2.csv, and writes throughput_budget_5e7afa5.md beside this file:

1. Per point, the run's wall time split into the decode loops' GPU time (CUDA events, the Roofline table) and
   the rest (prefill, host, sampling between loops), the decode occupancy (rows per loop / max_num_seqs) and the
   tokens/s the run would reach if its loops ran at a given fraction of the copy ceiling with the rest unchanged:
   tokens / (rest + loops * floor_ms / fraction). Medians over the arm's runs.
2. Per point, the loop's time above its floor divided by the kernels of a decode step (the profiles in
   results/profiles/2026-12-04-5e7afa5, same commit): the average cost of one kernel boundary, and what that cost
   or the number of kernels would have to be for the target.
3. Per projection at M 16 and 32: the GEMM's time above its bytes' floor at the table's copy ceiling (the fixed
   cost of one call) and the most that fixed cost may be for 85% of the ceiling: bytes / ceiling * (1/0.85 - 1).

    python kernels/results/throughput_budget_5e7afa5.py      # from the repository root, with pandas + pyarrow
"""
import json
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "results/2026-12-04-ouro-1.4b-5e7afa5/tables"
PROFILES = ROOT / "results/profiles/2026-12-04-5e7afa5"
GEMM = ROOT / "kernels/results/gemm_h200_9199ea2.csv"
FRACTIONS = (0.7, 0.8, 0.9, 1.0)
TARGETS = {"B16C32": 4000, "B32C64": 6000}          # issue 11's must-show tokens/s


def native_runs() -> pd.DataFrame:
    roof = pd.read_parquet(BUNDLE / "roofline.parquet")
    arms = pd.read_parquet(BUNDLE / "arms.parquet")
    runs = roof.merge(arms[["job", "seq", "point", "arm", "elapsed_s", "tokens_per_s", "max_num_seqs"]],
                      on=["job", "seq", "point", "arm"], validate="one_to_one")
    return runs[runs.arm == "native"]


def kernels_per_step(point: str) -> float:
    b, c = point[1:].split("C")
    doc = json.loads((PROFILES / f"profile-b{b}c{c}.json").read_text())
    replay = next(s for s in doc["sections"] if s["params"]["policy"] == "replay")
    return next(p["kernels_per_range"] for p in replay["summary"]["parts"] if p["part"] == "decode")


def need_ms_per_loop(g: pd.DataFrame, target: float) -> float:
    tokens = float((g.tokens_per_s * g.elapsed_s).median())
    rest = float(g.elapsed_s.median()) - float(g.decode_gpu_s.median())
    return (tokens / target - rest) / float(g.decode_loops.median()) * 1e3


def floor_ms_per_loop(g: pd.DataFrame) -> float:
    return float((g.mb_per_loop / g.ceiling_gb_per_s).median())           # MB / (GB/s) = ms


def loop_budget(runs: pd.DataFrame) -> list[str]:
    head = ("| point | runs | tok/s | wall s | decode loops s (share) | rest s | loops | occupancy | ms / loop | "
            "floor ms / loop | % of ceiling | " + " | ".join(f"tok/s at {f:.0%}" for f in FRACTIONS)
            + " | target tok/s | % of ceiling the target needs |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for point, g in runs.groupby("point"):
        tokens = float((g.tokens_per_s * g.elapsed_s).median())
        wall, loops_s = float(g.elapsed_s.median()), float(g.decode_gpu_s.median())
        loops = float(g.decode_loops.median())
        rest = wall - loops_s
        floor_ms = floor_ms_per_loop(g)
        occupancy = float((g.decode_rows / g.decode_loops).median()) / int(g.max_num_seqs.iloc[0])
        at = [tokens / (rest + loops * floor_ms / f / 1e3) for f in FRACTIONS]
        target = TARGETS[point]
        need_ms = need_ms_per_loop(g, target)
        out.append(f"| {point} | {len(g)} | {g.tokens_per_s.median():,.0f} | {wall:.3f} | {loops_s:.3f} "
                   f"({loops_s / wall:.1%}) | {rest:.3f} | {loops:.0f} | {occupancy:.1%} | "
                   f"{g.ms_per_loop.median():.3f} | {floor_ms:.3f} | {g.ceiling_fraction.median():.1%} | "
                   + " | ".join(f"{v:,.0f}" for v in at) + f" | {target:,} | {floor_ms / need_ms:.1%} |")
    return out


def boundary_cost(runs: pd.DataFrame) -> list[str]:
    out = ["| point | ms / loop | floor ms / loop | above the floor us | kernels per decode step | us above the floor "
           "per kernel | target ms / loop | us per kernel for the target (same kernels) | kernels for the target "
           "(same us each) |", "|---|---|---|---|---|---|---|---|---|"]
    for point, g in runs.groupby("point"):
        ms, floor_ms = float(g.ms_per_loop.median()), floor_ms_per_loop(g)
        kernels, need = kernels_per_step(point), need_ms_per_loop(g, TARGETS[point])
        per_kernel = (ms - floor_ms) * 1e3 / kernels
        out.append(f"| {point} | {ms:.3f} | {floor_ms:.3f} | {(ms - floor_ms) * 1e3:.0f} | {kernels:.0f} | "
                   f"{per_kernel:.2f} | {need:.3f} | {(need - floor_ms) * 1e3 / kernels:.2f} | "
                   f"{(need - floor_ms) * 1e3 / per_kernel:.0f} |")
    return out


def gemm_fixed_cost() -> list[str]:
    t = pd.read_csv(GEMM)
    t = t[t.m.isin([16, 32])]
    out = ["| shape | M | MB | floor us | ours us | ours above the floor us | ours % of ceiling | cuBLAS us | "
           "cuBLAS above the floor us | most above the floor for 85% us |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in t.itertuples():
        nbytes = 2 * (r.n * r.k + r.m * r.k + r.m * r.n)
        ceiling = nbytes / (r.ours_us * 1e-6) / (r.ours_pct / 100)            # bytes/s, as the table computed it
        floor_us = nbytes / ceiling * 1e6
        out.append(f"| {r.shape} | {r.m} | {nbytes / 1e6:.1f} | {floor_us:.2f} | {r.ours_us:.2f} | "
                   f"{r.ours_us - floor_us:.2f} | {r.ours_pct:.1f}% | {r.cublas_us:.2f} | {r.cublas_us - floor_us:.2f} | "
                   f"{floor_us * (1 / 0.85 - 1):.2f} |")
    return out


def main() -> None:
    runs = native_runs()
    text = ["# What the decode loop must reach for issue 11's tokens/s (derived from committed measurements)", "",
            "Generated by `throughput_budget_5e7afa5.py` from `results/2026-12-04-ouro-1.4b-5e7afa5` (native arm, "
            "H200) and `gemm_h200_9199ea2.csv`; the method is in the script's docstring.", "",
            "## The loop's share of a run", ""] + loop_budget(runs) + [
            "", "## The loop's distance from its floor per kernel", ""] + boundary_cost(runs) + [
            "", "## The fixed cost of one small-M GEMM call", ""] + gemm_fixed_cost() + [""]
    path = Path(__file__).with_suffix(".md")
    path.write_text("\n".join(text))
    print(path.read_text())


if __name__ == "__main__":
    main()
