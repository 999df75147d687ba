"""Roofline accounting (bundle format 7), re-derived by the auditor: the honest CPU bundle carries a roofline
row per measured run, a copy ceiling per session and a Roofline section, and audits PASS; changing a table
cell, a raw loop time, a ceiling, a record's outputs or a report line fails the audit naming it."""
import json

import pandas as pd
import pytest

from loopbench.audit.auditor import audit
from loopbench.harness import controller, evidence
from tests.audit.tamper import edit_json, edit_report, edit_table, failed, raw, rewrite_manifest


def _republish(bundle) -> None:
    """The harness publishes the bundle again from its (edited) raw files: table and report agree with them."""
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)


def test_honest_bundle_has_the_roofline_and_passes(bundle):
    assert audit(bundle)["status"] == "pass"
    roof = pd.read_parquet(bundle / "tables" / "roofline.parquet")
    rec = json.loads(raw(bundle, 0).read_text())
    assert len(roof) == len(list((bundle / "raw" / "cpu0").glob("*.json")))
    row = roof.set_index("seq").loc[0]
    loops = rec["measured"]["work"]["decode_steps"]
    assert row["decode_loops"] == loops == len(rec["decode_timing"]["loop_s"]) and row["timing"] == "wall_clock"
    assert row["ms_per_loop"] == pytest.approx(sum(rec["decode_timing"]["loop_s"]) * 1e3 / loops)
    ceiling = json.loads((bundle / "ceilings" / "cpu0.json").read_text())
    assert row["ceiling_gb_per_s"] == pytest.approx(ceiling["bytes_per_copy"] / min(ceiling["times_s"]) / 1e9)
    text = (bundle / "report.md").read_text()
    assert "## Roofline" in text and "| Device | B / C | P / D | arm | runs | ms / loop | MB / loop: weights |" in text
    assert "| session | Device | buffer MiB | copies | best ms | GB/s |" in text


@pytest.mark.parametrize("column", ["weight_bytes", "lm_head_bytes", "kv_read_bytes", "kv_write_bytes", "context_keys",
                                    "decode_gpu_s", "ms_per_loop", "mb_per_loop", "achieved_gb_per_s",
                                    "ceiling_gb_per_s", "ceiling_fraction", "timing"])
def test_changed_roofline_cell_is_named(bundle, column):
    def change(df):
        v = df.loc[0, column]
        df.loc[0, column] = "cuda_events" if isinstance(v, str) else v * 2 + 1
        return df
    edit_table(bundle, "roofline", change)
    rewrite_manifest(bundle)
    assert f"roofline.parquet: {column} of cpu0 seq 0 is" in failed(bundle)


def test_changed_raw_loop_time_is_named_in_every_figure_it_feeds(bundle):
    edit_json(raw(bundle, 0), lambda r: r["decode_timing"]["loop_s"].__setitem__(0, r["decode_timing"]["loop_s"][0] + 0.01))
    rewrite_manifest(bundle)
    text = failed(bundle)
    for col in ("decode_gpu_s", "ms_per_loop", "achieved_gb_per_s", "ceiling_fraction"):
        assert f"roofline.parquet: {col} of cpu0 seq 0 is" in text, (col, text)


def test_changed_ceiling_is_named(bundle):
    edit_json(bundle / "ceilings" / "cpu0.json", lambda c: c["times_s"].__setitem__(0, min(c["times_s"]) / 2))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "roofline.parquet: ceiling_gb_per_s of cpu0 seq 0 is" in text
    assert "report.md: line" in text and "(## Roofline)" in text   # every row's ceiling, and the ceilings table


@pytest.mark.parametrize("edit, named", [
    (lambda c: c.update(bytes_per_copy=c["bytes_per_copy"] + 2), "roofline: ceilings/cpu0.json: bytes_per_copy"),
    (lambda c: c.update(times_s=[]), "roofline: ceilings/cpu0.json: times_s is []"),
    (lambda c: c.update(session="cpu1"), "roofline: ceilings/cpu0.json: session is 'cpu1'"),
    (lambda c: c.update(speed_gb_s=4150.0), "speed_gb_s is a field that"),
])
def test_malformed_ceiling_is_named(bundle, edit, named):
    edit_json(bundle / "ceilings" / "cpu0.json", edit)
    rewrite_manifest(bundle)
    assert named in failed(bundle)


def test_missing_ceiling_is_named_even_when_republished(bundle):
    (bundle / "ceilings" / "cpu0.json").unlink()
    _republish(bundle)
    text = failed(bundle)
    assert "roofline: ceilings/cpu0.json is missing: session cpu0 measured arms" in text


@pytest.mark.parametrize("edit, named", [
    (lambda t: t["loop_s"].pop(), "entries (of non-negative seconds?), the run has"),
    (lambda t: t.update(loop_s=[10.0] * len(t["loop_s"])), "more than the measured run's"),
    (lambda t: t.update(method="cuda_events"), "decode_timing.method is 'cuda_events', a cpu session times by 'wall_clock'"),
])
def test_implausible_decode_timing_is_named_even_when_republished(bundle, edit, named):
    edit_json(raw(bundle, 1), lambda r: edit(r["decode_timing"]))
    _republish(bundle)
    text = failed(bundle)
    assert "roofline: record cpu0 seq 1 (" in text and named in text, text


def test_outputs_disagreeing_with_the_work_counters_are_named(bundle):
    def deeper(r):
        depths = r["measured"]["outputs"]["r0000"]["exit_depths"]
        depths[1] = 2 if depths[1] == 1 else 1
    edit_json(raw(bundle, 0), deeper)
    _republish(bundle)
    assert "decode rows, its work rows_per_depth" in failed(bundle)


def test_edited_roofline_line_is_named(bundle):
    def edit(lines):
        i = next(j for j in range(lines.index("## Roofline"), len(lines)) if lines[j].startswith("| CPU |"))
        cells = lines[i].split(" | ")
        cells[-1] = "99.9% |"
        lines[i] = " | ".join(cells)
        return lines
    edit_report(bundle, edit)
    rewrite_manifest(bundle)
    assert "(## Roofline) reads" in failed(bundle)
