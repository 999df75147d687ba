"""pair_ratios.png, shown in report.md, is the plot of the re-derived pair ratios, medians and intervals: a forged
plot (the harness's own plotting of other figures), or a file that is no PNG, is named even with the manifest
rewritten to match."""
import json

import pandas as pd
import pytest

from loopbench.harness.report import plot_ratios
from tests.audit.tamper import failed, rewrite_manifest


def _forged_plot(bundle):
    """The harness's plot of ratios 20% higher than measured: the plot a reader sees says the candidate is faster."""
    summary = json.loads((bundle / "summary.json").read_text())
    pairs = pd.read_parquet(bundle / "tables" / "pairs.parquet")
    for r in summary["results"]:
        st = r["stats"]
        st["speedup"], st["ci"] = st["speedup"] * 1.2, [c * 1.2 for c in st["ci"]] if st["ci"] else st["ci"]
    plot_ratios(summary, pairs.assign(ratio=pairs["ratio"] * 1.2), bundle / "pair_ratios.png")


def _not_a_png(bundle):
    (bundle / "pair_ratios.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")


@pytest.mark.parametrize("forge", [_forged_plot, _not_a_png])
def test_forged_pair_ratios_plot_is_named(bundle, forge):
    before = (bundle / "pair_ratios.png").read_bytes()
    forge(bundle)
    assert (bundle / "pair_ratios.png").read_bytes() != before
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "pair_ratios.png: " in text, text
    assert [d for d in text.split("\n") if not d.startswith("pair_ratios.png: ")] == []   # nothing else was changed


@pytest.mark.parametrize("case", ["complete", "incomplete", "no interval", "no pairs"])
def test_writer_and_auditor_draw_one_figure(honest_bundle, tmp_path, case):
    """The auditor's drawing (audit/check_plot.py render) is the writer's (harness/report.py plot_ratios), byte for
    byte, from the same summary: also for an incomplete run, a result without an interval or without pairs."""
    from loopbench.audit.check_plot import render

    summary = json.loads((honest_bundle / "summary.json").read_text())
    pairs = pd.read_parquet(honest_bundle / "tables" / "pairs.parquet")
    first = summary["results"][0]
    if case == "incomplete":
        summary["status"] = "incomplete"
    elif case == "no interval":
        first["stats"]["ci"] = None
    elif case == "no pairs":
        first["stats"]["ratios"] = []
        pairs = pairs[~((pairs["job"] == first["job"]) & (pairs["point"] == first["point"])
                        & (pairs["comparison"] == first["comparison"]))]
    plot_ratios(summary, pairs, tmp_path / "writer.png")
    assert render(summary) == (tmp_path / "writer.png").read_bytes()


def test_plot_under_another_matplotlib_is_counted_not_compared(bundle):
    """A bundle written under another matplotlib (its environment.json says so) is not failed for its figure's
    pixels, which that version may draw differently; the audit's counts say the figure was not compared. A file
    that is no PNG is still named."""
    from loopbench.audit.auditor import audit

    env = json.loads((bundle / "environment.json").read_text())
    env["packages"]["matplotlib"] = "0.0-other"
    (bundle / "environment.json").write_text(json.dumps(env, indent=1))
    _forged_plot(bundle)
    rewrite_manifest(bundle)
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"].get("plot_not_compared_other_matplotlib") == 1
    assert "plot_pixels" not in verdict["checked"]
    _not_a_png(bundle)
    rewrite_manifest(bundle)
    assert "pair_ratios.png: is not a PNG" in failed(bundle)
