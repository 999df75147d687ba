"""report.md's wording per format version: both renderers (harness/report.py, audit/render.py) word a
format-7 bundle alike (Device column, arm roles, the interval's level from verdict.confidence, counts in
their number), and the auditor still words an older bundle (formats 1-6) as its writer did, so results/
audits PASS."""
import copy
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from loopbench.audit import contract, derive, render
from loopbench.audit.auditor import audit
from loopbench.harness import report, stats
from tests.audit.tamper import REPO, _reword_as_version_6, edit_json, failed, rewrite_manifest, strip_version_7

OLD = REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c"   # format 4, one session of 3 pairs, on a CPU
FIRST_5 = REPO / "results" / "2026-12-01-ouro-1.4b-context-42d529f"   # format 5
NATURAL = REPO / "results" / "2026-12-01-ouro-1.4b-natural-b0940b1"   # format 6, the last before this wording


def _load(bundle: Path):
    docs = {n: json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "summary", "environment")}
    records = [json.loads(p.read_text()) for p in sorted((bundle / "raw").rglob("*.json"))]
    return docs, records, pd.read_parquet(bundle / "tables" / "arms.parquet")


def _theirs(docs, records, version=contract.VERSION) -> str:
    """The auditor's re-rendering of the documents as a bundle of format ``version``."""
    plan, summary, env = docs["plan"], docs["summary"], docs["environment"]
    return render.report(plan, summary["plan_sha256"], plan["prompts"]["sha256"], summary,
                         [derive.arm_row(r) for r in records], env, version)


def _both(docs, records, arms) -> tuple[str, str]:
    """(harness's report.md, the auditor's re-rendering) of the same documents of the current format."""
    return report.render_report(docs["plan"], docs["summary"], arms, docs["environment"]), _theirs(docs, records)


@pytest.mark.parametrize("bundle, version, line", [
    (OLD, 4, "| GPU | B / C | native tokens/s | native tokens/s | Paired speedup [95% CI] | Throughput change |"),
    (FIRST_5, 5, "| GPU | B / C | P / D | native tokens/s | alias tokens/s | Paired speedup [95% CI] | Throughput change |"),
    (NATURAL, 6, "| GPU | B / C | P / D | native tokens/s | native tokens/s | Paired speedup [95% CI] | Throughput change |")])
def test_an_older_wording_is_reworded_as_its_writer_did(bundle, version, line):
    docs, records, _ = _load(bundle)
    assert json.loads((bundle / "manifest.json").read_text())["format_version"] == version
    theirs = _theirs(docs, records, version)
    assert theirs == (bundle / "report.md").read_text() and line in theirs


def test_format_7_wording_is_the_same_in_both_renderers(honest_bundle):
    docs, records, arms = _load(honest_bundle)
    assert json.loads((honest_bundle / "manifest.json").read_text())["format_version"] == 7
    mine, theirs = _both(docs, records, arms)
    # rendered here without the roofline rows (tests/audit/test_roofline.py checks that section)
    published = re.sub(r"\n## Roofline\n.*?(?=\n## )", "", (honest_bundle / "report.md").read_text(), flags=re.S)
    assert mine == theirs == published
    for line in ("| Device | B / C | P / D | native (baseline) tokens/s | alias_prefix (candidate) tokens/s "
                 "| Paired speedup [95% CI] | Throughput change (speedup - 1) | Verdict |",
                 "| CPU | 2 / 3 | 17 / 4 |", "| Device | B / C | comparison | pairs | BCa CI |",
                 "| Device | B / C | P / D | arm | runs | warmup captures |",
                 "- Protocol: 2 balanced pairs per point and comparison",
                 "over 1 independent session per device of 2 pairs each (see Sessions)",
                 "the whole 95% CI lies above / below 1", "Each device ran 1 independent session, one after another"):
        assert line in mine, line
    assert "| GPU |" not in mine and "| cpu |" not in mine and "session(s)" not in mine


def test_a_format_7_report_in_the_older_wording_is_named(bundle):
    _reword_as_version_6(bundle)
    rewrite_manifest(bundle)
    assert "| GPU | B / C | P / D | native tokens/s | alias_prefix tokens/s |" in (bundle / "report.md").read_text()
    assert "report.md" in failed(bundle)


def test_a_format_7_bundle_worded_as_format_6_audits_as_format_6(bundle):
    """Without format 7's roofline files and in format 6's wording, the same bundle is a format-6 bundle."""
    strip_version_7(bundle)
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=6))
    rewrite_manifest(bundle)
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=7))
    rewrite_manifest(bundle)
    assert "report.md" in failed(bundle)


def test_the_interval_level_comes_from_verdict_confidence(honest_bundle):
    docs, records, arms = _load(honest_bundle)
    docs["plan"]["config"]["verdict"]["confidence"] = 0.9
    for r in docs["summary"]["results"]:
        r["stats"]["confidence"] = 0.9
    mine, theirs = _both(docs, records, arms)
    assert mine == theirs and "95%" not in mine
    assert "Paired speedup [90% CI]" in mine and "the whole 90% CI lies above / below 1" in mine
    docs["plan"]["config"]["verdict"]["confidence"] = 0.995
    assert "the whole 99.5% CI lies" in _both(docs, records, arms)[0]


def test_counts_of_one_are_singular(honest_bundle):
    docs, records, arms = _load(honest_bundle)
    docs["plan"]["config"]["pairs"] = 1
    docs["plan"]["config"]["verdict"]["min_pairs"] = 1
    docs["plan"]["detectable_effect"]["n_pairs"] = 1
    docs["summary"]["evidence_rule"]["pairs_per_session"] = 1
    docs["summary"]["checks"].update(arms_checked=1, phases_checked=1, requests_checked=1, tokens_checked=1)
    mine, theirs = _both(docs, records, arms)
    assert mine == theirs
    for text in ("- Protocol: 1 balanced pair per point", "1 independent session per device of 1 pair each",
                 "with at least 1 pair;", "n = 1 pair per comparison and device",
                 "1 arm, 1 run (warmup and measured), 1 request and 1 output token compared"):
        assert text in mine, text
    docs["summary"]["checks"].update(tokens_checked=1024, arms_checked=2)
    assert "2 arms, 1 run (warmup and measured), 1 request and 1,024 output tokens" in _both(docs, records, arms)[0]


def test_a_gpu_is_named_by_its_label(honest_bundle):
    docs, records, arms = _load(honest_bundle)
    for key in ("results", "memory_creep", "children"):
        for x in docs["summary"][key]:
            x["device"] = "H200 #0"
    for r in records:
        r["device"]["label"] = "H200 #0"
    mine, theirs = _both(docs, records, arms.assign(device="H200 #0"))
    assert mine == theirs and "| H200 #0 | 2 / 3 |" in mine and "| CPU |" not in mine


@pytest.mark.parametrize("fill", [report.fill, render.fill], ids=["harness", "audit"])
def test_count_fields(fill):
    assert [fill("{n:pair|pairs}", n=n) for n in (0, 1, 2, 1024)] == ["0 pairs", "1 pair", "2 pairs", "1,024 pairs"]
    assert fill("{x:.2%} of {n:,}", x=0.5, n=1000) == "50.00% of 1,000"


def test_wording_picks_each_versions_templates():
    section = copy.deepcopy(contract.FORMAT["report"])
    result = section["result"]
    rules = [render.wording(section, v)["result"]["rule"] for v in (3, 4, 6, 7)]
    assert rules == [result["rule"], result["rule_since_4"], result["rule_since_4"], result["rule_since_7"]]
    assert [render.wording(section, v)["result"]["columns"] for v in (4, 5, 6, 7)] == [
        result["columns"], result["columns_since_5"], result["columns_since_5"], result["columns_since_7"]]
    assert render.wording(section, 6)["column_names"] == {} and render.wording(section, 7)["column_names"] == {
        "GPU": "Device"}

    def keys(d):
        return [k for key, v in d.items() for k in [key, *(keys(v) if isinstance(v, dict) else [])]]
    assert "rule_since_7" in keys(section) and not [k for k in keys(render.wording(section, 7)) if "_since_" in k]
    assert report.wording(section, 7) == render.wording(section, 7) == report.R


@pytest.mark.parametrize("n_pairs, version, reason", [
    (1, 7, "1 pair, fewer than the minimum 6 for a verdict"), (3, 7, "3 pairs, fewer than the minimum 6 for a verdict"),
    (1, 6, "1 pairs, fewer than the minimum 6 for a verdict"), (1, 5, "1 pairs, fewer than the minimum 6 for a verdict")])
def test_verdict_reason_is_worded_as_the_bundles_version_wrote_it(n_pairs, version, reason):
    """From format 7 one pair is singular; results/...-online-69b8d26 (format 5) says "1 pairs" and audits PASS."""
    assert derive.verdict(1.05, None, 0.01, n_pairs, 6, version)[1] == reason
    if version == contract.VERSION:
        assert stats.verdict(1.05, None, 0.01, n_pairs, 6)[1] == reason


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "results").glob("2026-*")))
def test_every_committed_bundle_still_audits_pass(name):
    verdict = audit(REPO / "results" / name)
    assert verdict["status"] == "pass", verdict["discrepancies"]
