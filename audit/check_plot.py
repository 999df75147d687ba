"""``pair_ratios.png``, the figure report.md shows, drawn again from the re-derived summary and compared pixel
for pixel.

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
"""
from __future__ import annotations

import io

import numpy as np

from .context import Audit

FILE = "pair_ratios.png"


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
    path = ctx.bundle / FILE
    if not path.is_file():
        return   # named by the required-files check
    import matplotlib

    try:
        got = _pixels(path.read_bytes())
    except Exception as exc:
        ctx.fail(FILE, f"is not a PNG image that can be read: {type(exc).__name__}: {exc}")
        return
    recorded = ((environment or {}).get("packages") or {}).get("matplotlib") if isinstance(environment, dict) else None
    if recorded != matplotlib.__version__:
        ctx.count("plot_not_compared_other_matplotlib")
        return
    want = _pixels(render(expected))
    ctx.count("plot_pixels", int(want.shape[0] * want.shape[1]))
    if got.shape == want.shape and np.array_equal(got, want):
        return
    what = (f"an image of {got.shape[1]} x {got.shape[0]} pixels, where the plot of the re-derived summary has "
            f"{want.shape[1]} x {want.shape[0]}" if got.shape != want.shape else
            f"{int(np.any(got != want, axis=-1).sum()):,} of its {got.shape[0] * got.shape[1]:,} pixels differ from "
            "the plot of the re-derived summary")
    ctx.fail(FILE, f"is not the plot of the pair ratios, medians and intervals the audit derives: {what}")
