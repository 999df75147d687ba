"""The auditor passes honest bundles (a fresh CPU one and the committed GPU ones), re-derives coverage
counts, and its statistics agree with the harness's."""
import json

import numpy as np
import pandas as pd
import pytest

from loopbench.audit import coverage as derive_coverage, derive
from loopbench.audit.auditor import audit
from loopbench.harness import evidence, records as harness_records, stats
from tests.audit.tamper import REPO, edit_json, edit_report, edit_table, failed, raw, rewrite_manifest

GPU_BUNDLES = {"2026-11-30-ouro-1.4b-nogit": 56, "2026-12-01-ouro-1.4b-e4b8faf": 56}   # format version 1


def test_honest_bundle_passes(bundle):
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"]["records"] == 8 and verdict["checked"]["results"] == 2
    manifest = json.loads((bundle / "manifest.json").read_text())["files"]
    for rel in ("plan.json", "environment.json", "prompts.json", "summary.json", "report.md", "pair_ratios.png",
                "children.json", "references/B2C3.schedule.json", *(f"tables/{t}.parquet" for t in evidence.TABLES)):
        assert rel in manifest


def test_coverage_is_recorded_tabled_reported_and_rederived(bundle):
    """Every record carries its arm's coverage counts; arms.parquet and the report show them, and the
    auditor re-derives them from the frozen schedule (the MINI workload's contexts stay inside the first
    32-key tile, so its native-vs-prefix comparison is warned about: no tile was read directly)."""
    verdict = audit(bundle)
    assert verdict["status"] == "pass" and verdict["checked"]["coverage_records"] == 8, verdict["discrepancies"]
    records = [json.loads(p.read_text()) for p in sorted((bundle / "raw" / "cpu0").glob("*.json"))]
    arms = pd.read_parquet(bundle / "tables" / "arms.parquet").sort_values("seq")
    for rec, (_, row) in zip(records, arms.iterrows()):
        assert rec["schema"] == 3 and set(rec["coverage"]) == set(derive_coverage.KEYS)
        assert row["coverage_routed_reads"] == rec["coverage"]["routed_reads"]
        assert list(row["coverage_exits_per_depth"]) == rec["coverage"]["exits_per_depth"]
        assert (rec["coverage"]["routed_reads"] > 0) == (rec["arm_config"]["kv_layout"] == "alias")
        assert (rec["coverage"]["fill_token_planes"] > 0) == (rec["arm_config"]["kv_layout"] == "native")
    report = (bundle / "report.md").read_text()
    section = report.split("## Layout paths per run")[1].split("\n## ")[0]
    assert [line.split(" | ")[3] for line in section.split("\n") if line.startswith("| CPU | 2 / 3 |")] == [
        "alias_prefix", "native"]
    warnings = json.loads((bundle / "summary.json").read_text())["checks"]["warnings"]
    assert warnings == ["cpu0 B2C3 native_vs_alias_prefix: arm 'alias_prefix' read no key tile directly: this "
                        "comparison does not exercise where its arms differ"]
    assert f"- warning: {warnings[0]}" in report


def test_forged_coverage_count_is_named(bundle):
    """Raw record and table alike inflated: the frozen schedule gives the true count."""
    edit_json(raw(bundle, 1), lambda rec: rec["coverage"].update(routed_reads=rec["coverage"]["routed_reads"] + 7))
    edit_table(bundle, "arms", lambda df: df.assign(coverage_routed_reads=df["coverage_routed_reads"].where(
        df["seq"] != 1, df["coverage_routed_reads"] + 7)))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "coverage: record cpu0 seq 1 (" in text and "coverage.routed_reads is " in text, text
    assert "the frozen schedule gives" in text


def test_record_that_drops_its_coverage_is_named(bundle):
    edit_json(raw(bundle, 2), lambda rec: rec.pop("coverage"))
    rewrite_manifest(bundle)
    assert "is not an arm record: coverage is None" in failed(bundle)


def test_dropped_coverage_warning_is_named(bundle):
    edit_json(bundle / "summary.json", lambda s: s["checks"].update(warnings=[]))
    edit_report(bundle, lambda lines: [line for line in lines if not line.startswith("- warning:")])
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "summary.json: checks.warnings has 0 entries, the audit derives 1" in text, text
    assert 'report.md: lacks the re-derived line "- warning: cpu0 B2C3 native_vs_alias_prefix' in text


@pytest.mark.parametrize("name", sorted(GPU_BUNDLES))
def test_committed_gpu_bundle_passes(name):
    """The committed GPU bundles follow format version 1 and are audited by its rules."""
    assert json.loads((REPO / "results" / name / "manifest.json").read_text()).get("layout_version", 1) == 1
    verdict = audit(REPO / "results" / name)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"]["records"] == GPU_BUNDLES[name] and verdict["checked"]["results"] == 4


@pytest.mark.parametrize("ratios", [
    [1.0, 1.0, 1.0], [1.1, 1.1, 0.9, 1.2], [1.0, 1.05, 0.95, 1.1, 1.1], [1.02],
    [1.04, 1.05, 1.06, 1.03, 1.05, 1.07, 1.04], [0.9, 0.95, 0.93, 0.92, 0.96, 0.94], [1.1] * 10 + [0.9] * 9 + [1.0],
    list(np.random.default_rng(0).uniform(0.9, 1.1, 7))])
def test_auditor_statistics_match_the_harness(ratios):
    """The auditor's own statistics (with its DP Wilcoxon for ties) agree with harness/stats.py."""
    vd = {"confidence": 0.95, "n_resamples": 2000, "bootstrap_seed": 3, "min_effect": 0.01, "min_pairs": 6}
    theirs = stats.compare(ratios, [1.0] * len(ratios), confidence=vd["confidence"], n_resamples=vd["n_resamples"],
                           seed=vd["bootstrap_seed"], min_effect=vd["min_effect"], min_pairs=vd["min_pairs"]).to_dict()
    ours = derive.comparison_stats(ratios, vd)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-12) if isinstance(ours[key], float) \
            else ours[key] == theirs[key], key
