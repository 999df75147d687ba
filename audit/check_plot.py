"""``pair_ratios.png``, the figure report.md shows, drawn again from the re-derived summary and compared pixel
for pixel; and alike ``online/latency.png``, the online section's figure, drawn again from the online records and
the online summary the auditor re-derives (audit/check_online.py).

The figure is the auditor's own reading of the writer's (``harness/report.py`` ``plot_ratios``; a test holds the
two equal): one row per result in summary order, each pair's ratio a grey dot (offset over the row by
``linspace(-0.12, 0.12, n)`` in the order of ``stats.ratios``), the median a bar with the interval as whiskers,
a line at 1, and the title naming the interval's level and an incomplete run. It is drawn from the auditor's own
summary, so a plot of other figures, such as the harness's plot of forged ratios, differs from it. Pixels, not
bytes, are compared (a PNG's compression may differ where its image does not). Matplotlib draws the same image
only in the same version, so the pixels are compared only under the version the bundle's environment.json records
(``packages.matplotlib``). Under another, the figure is not compared and the audit's counts say so
(``plot_not_compared_other_matplotlib``): failing every honest bundle whose auditor has another matplotlib would
make the audit depend on an installed plotting library, and the figure only draws figures the audit checks in the
tables and report.md.

``online/latency.png`` is the auditor's own reading of the writer's (``harness/online/report.py``
``plot_latency``; a test holds the two equal): two panels sharing one row per online record in seq order, the
left each completed request's TTFT from its planned arrival (a dot, C0 for the baseline and calibration runs, C1
for the candidate's), the right every inter-token gap (small grey dots jittered over the row by
``default_rng(row).uniform(-0.2, 0.2, n)``), a red line at the SLO's TTFT and TPOT where the SLO has them, each
axis logarithmic where it has a positive value or an SLO line, and the title marking an incomplete track. The
same version rule and the same PNG rule apply; its counts are those of ``pair_ratios.png`` (one per figure).
"""
from __future__ import annotations

import io

import numpy as np

from .context import Audit

FILE = "pair_ratios.png"
LATENCY_FILE = "online/latency.png"


def render(summary: dict) -> bytes:
    """The figure of ``summary`` (its results' ratios, medians, intervals and status) as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = summary["results"]
    fig, ax = plt.subplots(figsize=(8, 0.55 * max(len(results), 1) + 1.4))
    for y, r in enumerate(results):
        st = r["stats"]
        ratios = st.get("ratios") or []
        ax.scatter(ratios, np.full(len(ratios), y) + np.linspace(-0.12, 0.12, len(ratios)), s=14, color="0.45",
                   zorder=2)
        if st["ci"]:
            low, high = st["ci"]
            ax.errorbar([st["speedup"]], [y], xerr=[[st["speedup"] - low], [high - st["speedup"]]], fmt="none",
                        ecolor="C0", capsize=4, zorder=3)
        ax.scatter([st["speedup"]], [y], marker="|", s=300, color="C0", zorder=4)
    ax.axvline(1.0, color="C3", lw=0.8)
    ax.set_yticks(range(len(results)))
    ax.set_yticklabels([f"{r['device']} B{r['max_num_seqs']}/C{r['num_requests']}\n{r['comparison']}"
                        for r in results], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("pair ratio baseline_s / candidate_s (> 1: candidate faster)")
    levels = sorted({r["stats"]["confidence"] for r in results if r["stats"].get("confidence") is not None})
    level = "/".join(f"{c:.0%}" for c in levels) or "no"
    ax.set_title(f"Paired ratios, median and {level} CI" + ("" if summary["status"] == "complete" else " (INCOMPLETE)"))
    return _png(fig)


def render_latency(records: list[dict], summary: dict) -> bytes:
    """The online figure of ``records`` (the online records, in seq order) and ``summary`` (the online summary:
    its SLO and status) as PNG bytes."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .check_online import latencies

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.45 * max(len(records), 1) + 1.6), sharey=True)
    names, drawn = [], {"ttft_s": False, "tpot_s": False}   # a positive value on the TTFT / gap axis
    for y, rec in enumerate(records):
        per = [latencies(q) for q in rec["requests"]]
        firsts = [p["ttft_s"] for p in per if p["ttft_s"] is not None]
        gaps = [g for p in per for g in p["itl_s"]]
        left.scatter(firsts, np.full(len(firsts), y), s=10, color="C1" if rec["position"] == "candidate" else "C0")
        right.scatter(gaps, np.full(len(gaps), y) + np.random.default_rng(y).uniform(-0.2, 0.2, len(gaps)), s=2,
                      color="0.4")
        drawn["ttft_s"] = drawn["ttft_s"] or any(v > 0 for v in firsts)
        drawn["tpot_s"] = drawn["tpot_s"] or any(v > 0 for v in gaps)
        names.append(f"{rec['seq']} {rec['arm']} " + ("closed" if rec["rate_multiple"] is None
                                                     else f"{rec['rate_multiple']:.2f}x"))
    slo = summary["slo"]
    for ax, key in ((left, "ttft_s"), (right, "tpot_s")):
        if slo.get(key) is not None:
            ax.axvline(slo[key], color="C3", lw=0.8)
        if drawn[key] or slo.get(key):   # no log axis of nothing (no request completed); a zero gap is clipped
            ax.set_xscale("log", nonpositive="clip")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_yticks(range(len(records)))
    left.set_yticklabels(names, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("TTFT from planned arrival (s); red: SLO")
    right.set_xlabel("inter-token gaps (s); red: TPOT SLO")
    fig.suptitle("Online latency per run" + ("" if summary["status"] == "complete" else " (INCOMPLETE)"))
    return _png(fig)


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _pixels(data: bytes) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(io.BytesIO(data), format="png")


def check(ctx: Audit, expected: dict, environment) -> None:
    """The bundle's figure is a PNG and, under the matplotlib its environment.json records, the one ``render``
    draws from the re-derived summary ``expected``."""
    _compare(ctx, FILE, lambda: render(expected), environment,
             "the plot of the pair ratios, medians and intervals the audit derives", "the plot of the re-derived summary")


def check_latency(ctx: Audit, environment) -> None:
    """With an online track re-derived (check_online): ``online/latency.png`` is a PNG and, under the matplotlib
    environment.json records, the one ``render_latency`` draws from the online records that load and the
    re-derived online summary."""
    if ctx.online_summary is None:
        return   # no online track, or none re-derived (check_online named why)
    _compare(ctx, LATENCY_FILE, lambda: render_latency(ctx.online_records, ctx.online_summary), environment,
             "the plot of the TTFTs, inter-token gaps and SLO the audit derives from the raw online records",
             "the plot of the re-derived online figures")


def _compare(ctx: Audit, rel: str, draw, environment, plot_of: str, short: str) -> None:
    """``rel`` is a PNG and, under the recorded matplotlib, pixel for pixel the PNG ``draw()`` returns."""
    path = ctx.bundle / rel
    if not path.is_file():
        return   # named by the required-files check
    import matplotlib

    try:
        got = _pixels(path.read_bytes())
    except Exception as exc:
        ctx.fail(rel, f"is not a PNG image that can be read: {type(exc).__name__}: {exc}")
        return
    recorded = ((environment or {}).get("packages") or {}).get("matplotlib") if isinstance(environment, dict) else None
    if recorded != matplotlib.__version__:
        ctx.count("plot_not_compared_other_matplotlib")
        return
    want = _pixels(draw())
    ctx.count("plot_pixels", int(want.shape[0] * want.shape[1]))
    if got.shape == want.shape and np.array_equal(got, want):
        return
    what = (f"an image of {got.shape[1]} x {got.shape[0]} pixels, where {short} has "
            f"{want.shape[1]} x {want.shape[0]}" if got.shape != want.shape else
            f"{int(np.any(got != want, axis=-1).sum()):,} of its {got.shape[0] * got.shape[1]:,} pixels differ from "
            f"{short}")
    ctx.fail(rel, f"is not {plot_of}: {what}")
