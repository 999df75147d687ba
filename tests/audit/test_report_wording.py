"""report.md's wording per format version: both renderers (harness/report.py, audit/render.py) word a
format-7 bundle alike (Device column, arm roles, the interval's level from verdict.confidence, counts in
their number) and a format-8 bundle's exit statuses alike, and the auditor still words an older bundle
(formats 1-7) as its writer did, so results/ audits PASS."""
import copy
import json
import re
import signal
import sys
from pathlib import Path

import pandas as pd
import pytest

from loopbench.audit import check_settings, contract, derive, render
from loopbench.audit.auditor import audit
from loopbench.harness import report, report_sections, stats
from loopbench.harness.exit_status import exit_status_text
from tests.audit.tamper import (REPO, _reword_as_version_6, edit_json, failed, passes_as_version, rewrite_manifest,
                                strip_version_7, strip_version_8, strip_version_11)

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
    settings = check_settings.section(render.wording(contract.FORMAT["report"], version), plan, records) \
        if version >= check_settings.SINCE else ()
    return render.report(plan, summary["plan_sha256"], plan["prompts"]["sha256"], summary,
                         [derive.arm_row(r) for r in records], env, version, settings=settings)


def _both(docs, records, arms) -> tuple[str, str]:
    """(harness's report.md, the auditor's re-rendering) of the same documents of the current format."""
    return (report.render_report(docs["plan"], docs["summary"], arms, docs["environment"],
                                 settings=report_sections.runtime_settings(docs["plan"], records)), _theirs(docs, records))


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
    assert json.loads((honest_bundle / "manifest.json").read_text())["format_version"] == contract.VERSION == 15
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
                 "the whole 95% CI lies above / below 1", "Each device ran 1 independent session, one after another",
                 "| child | device | state | exit status | wall s |", "| cpu0 | CPU | completed | exit code 0 |"):
        assert line in mine, line
    assert "| GPU |" not in mine and "| cpu |" not in mine and "session(s)" not in mine


def test_a_format_7_report_in_the_older_wording_is_named(bundle):
    _reword_as_version_6(bundle)
    rewrite_manifest(bundle)
    assert "| GPU | B / C | P / D | native tokens/s | alias_prefix tokens/s |" in (bundle / "report.md").read_text()
    assert "report.md" in failed(bundle)


def test_a_format_7_bundle_worded_as_format_6_audits_as_format_6(older_bundle):
    """Without format 7's roofline files and in format 6's wording, the same bundle (its order numpy's, as format 6
    drew it) is a format-6 bundle."""
    strip_version_7(older_bundle)
    passes_as_version(older_bundle, 6)
    edit_json(older_bundle / "manifest.json", lambda m: m.update(format_version=7))
    rewrite_manifest(older_bundle)
    assert "report.md" in failed(older_bundle)


def test_a_format_11_bundle_worded_as_format_10_audits_as_format_10(older_bundle):
    """Format 11 changed the verdict rule and its sentence only: with format 10's sentence and reasons the same
    bundle (its order numpy's, as format 10 drew it) is a format-10 bundle, and claiming 11 with them is named."""
    bundle = older_bundle
    rule = next(line for line in (bundle / "report.md").read_text().split("\n") if line.startswith("Tokens/s are"))
    # the test is not called exact: beyond 16 nonzero differences with ties its p is the normal approximation, as
    # the Statistics section's Wilcoxon p names it
    assert "the Wilcoxon signed-rank test of the log ratios (Wilcoxon p under Statistics) gives p < 0.05" in rule
    strip_version_11(bundle)
    assert rule not in (bundle / "report.md").read_text()
    passes_as_version(bundle, 10)
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=11))
    rewrite_manifest(bundle)
    assert "report.md" in failed(bundle)


def test_the_interval_level_comes_from_verdict_confidence(honest_bundle):
    docs, records, arms = _load(honest_bundle)
    docs["plan"]["config"]["verdict"]["confidence"] = 0.9
    for r in docs["summary"]["results"]:
        r["stats"]["confidence"] = 0.9
    mine, theirs = _both(docs, records, arms)
    # the level's own phrases only: a measured figure such as "+0.95%" may contain "95%" by chance
    assert mine == theirs and not re.search(r"(?<![\d.])95% CI", mine)
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
    assert [render.wording(section, v)["result"]["rule"] for v in (10, 11)] == [result["rule_since_7"],
                                                                              result["rule_since_11"]]
    assert "rule_since_7" in keys(section) and not [k for k in keys(render.wording(section, 7)) if "_since_" in k]
    assert report.wording(section, contract.VERSION) == render.wording(section, contract.VERSION) == report.R
    children = section["children"]
    assert [render.wording(section, v)["children"]["row"] for v in (7, 8)] == [children["row"], children["row_since_8"]]
    codes = contract.FORMAT["status_codes"]
    assert [render.wording(codes, v)["codes"]["child_failed"]["text"] for v in (1, 7, 8)] == [
        "child {child} ended {state} with exit code {exit_code}"] * 2 + ["child {child} ended {state}, {exit_status}"]
    assert report.CODES == render.wording(codes, contract.VERSION)["codes"]


@pytest.mark.parametrize("n_pairs, version, reason", [
    (1, 8, "1 pair, fewer than the minimum 6 for a verdict"),
    (1, 7, "1 pair, fewer than the minimum 6 for a verdict"), (3, 7, "3 pairs, fewer than the minimum 6 for a verdict"),
    (1, 6, "1 pairs, fewer than the minimum 6 for a verdict"), (1, 5, "1 pairs, fewer than the minimum 6 for a verdict")])
def test_verdict_reason_is_worded_as_the_bundles_version_wrote_it(n_pairs, version, reason):
    """From format 7 one pair is singular; results/...-online-69b8d26 (format 5) says "1 pairs" and audits PASS."""
    assert derive.verdict(1.05, None, 0.01, n_pairs, 6, version)[1] == reason
    if version == contract.VERSION:
        assert stats.verdict(1.05, None, 0.01, n_pairs, 6)[1] == reason


@pytest.mark.parametrize("version, p, word, reason", [
    # format 11: the signed-rank p must be below 1 - confidence too
    (11, 38 / 128, "inconclusive", "CI [1.0200, 1.0600] above 1 but signed-rank p 0.2969 >= 0.05"),
    (11, 2 / 128, "faster", "CI [1.0200, 1.0600] above 1, signed-rank p 0.01562 < 0.05 and effect +4.00% >= 1.00%"),
    (11, None, "inconclusive", "CI [1.0200, 1.0600] above 1 but signed-rank p undefined"),
    # formats up to 10: the interval and the effect alone, whatever the p
    (10, 38 / 128, "faster", "CI [1.0200, 1.0600] above 1 and effect +4.00% >= 1.00%"),
    (7, 2 / 128, "faster", "CI [1.0200, 1.0600] above 1 and effect +4.00% >= 1.00%")])
def test_the_verdict_rule_is_the_bundles_versions(version, p, word, reason):
    """The writer (harness/stats.py, current format) and the auditor (audit/derive.py, every format) agree."""
    assert derive.verdict(1.04, [1.02, 1.06], 0.01, 7, 6, version, p, 0.95) == (word, reason)
    if version == contract.VERSION:
        assert stats.verdict(1.04, (1.02, 1.06), 0.01, 7, 6, p, 1 - 0.95) == (word, reason)
    for slower in (derive.verdict(1 / 1.04, [1 / 1.06, 1 / 1.02], 0.01, 7, 6, version, p, 0.95),):
        assert slower[0] == {"faster": "slower"}.get(word, word)


@pytest.mark.slow      # 5-20 s a committed bundle
@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "results").glob("2026-*")))
def test_every_committed_bundle_still_audits_pass(name):
    verdict = audit(REPO / "results" / name)
    assert verdict["status"] == "pass", verdict["discrepancies"]


EXIT_STATUSES = [   # a children.json entry's end -> its words (documents.children.exit_status)
    ({"exit_code": 0, "state": "completed", "wall_s": 1.0}, "exit code 0"),
    ({"exit_code": 1, "state": "failed", "wall_s": 1.0}, "exit code 1"),
    ({"exit_code": 143, "state": "failed", "wall_s": 1.0}, "exit code 143"),   # an exit code, never guessed a signal
    ({"exit_code": -15, "state": "interrupted", "interrupted_by": "SIGTERM", "wall_s": 2.0}, "killed by SIGTERM (15)"),
    ({"exit_code": -9, "state": "killed", "wall_s": 2.0}, "killed by SIGKILL (9)"),
    ({"exit_code": -40, "state": "killed", "wall_s": 2.0}, "killed by signal 40"),
    ({"exit_code": None, "state": "running", "wall_s": None}, "still running"),
    ({"exit_code": None, "state": "interrupted", "interrupted_by": "lost", "wall_s": None},
     "lost: no exit status recorded"),
    ({"exit_code": None, "state": "interrupted", "interrupted_by": "SIGINT", "wall_s": None}, "never started"),
    ({"exit_code": None, "state": "failed", "wall_s": 61.0}, "no exit status recorded"),   # SLURM, scontrol forgot
]


@pytest.mark.parametrize("child, words", EXIT_STATUSES, ids=[w for _, w in EXIT_STATUSES])
def test_writer_and_auditor_word_an_exit_status_alike(child, words):
    assert exit_status_text(child) == render.exit_status(child) == words


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the contract names Linux's signal numbers")
def test_the_contracts_signal_names_are_linuxs():
    names = contract.DOCS["children"]["exit_status"]["signal_names"]
    assert names == {str(n): signal.Signals(n).name for n in range(1, 32)}


def _stopped_run(docs: dict) -> dict:
    """``docs`` as a run whose cpu0 was stopped by SIGTERM, cpu1 never started and cpu2 was lost."""
    docs = copy.deepcopy(docs)
    ref = next(c for c in docs["summary"]["children"] if c["name"] == "reference")
    ends = {"cpu0": (-15, 3.25, "SIGTERM"), "cpu1": (None, None, "SIGTERM"), "cpu2": (None, None, "lost")}
    children = [ref] + [{**ref, "name": n, "session": n, "log": f"{n}.log", "state": "interrupted", "exit_code": code,
                         "wall_s": wall, "interrupted_by": by} for n, (code, wall, by) in ends.items()]
    reasons = [{"code": "stopped", "by": "SIGTERM"}, {"code": "lost"}] + [
        {"code": "child_failed", "child": c["session"], "state": c["state"], "exit_code": c["exit_code"]}
        for c in children[1:]]
    docs["summary"].update(status="incomplete", incomplete_reasons=reasons, children=children)
    return docs


def test_a_stopped_child_is_worded_alike_in_the_table_and_the_banner_by_both_renderers(honest_bundle):
    docs, records, arms = _load(honest_bundle)
    docs = _stopped_run(docs)
    mine, theirs = _both(docs, records, arms)
    assert mine == theirs
    assert ("the controller received SIGTERM and stopped its children; the controller ended without publishing; "
            "its unfinished children were marked interrupted; child cpu0 ended interrupted, killed by SIGTERM (15); "
            "child cpu1 ended interrupted, never started; child cpu2 ended interrupted, lost: no exit status "
            "recorded") in mine
    for row in ("| child | device | state | exit status | wall s |", "| reference | CPU | completed | exit code 0 |",
                "| cpu0 | CPU | interrupted | killed by SIGTERM (15) | 3.2 |",
                "| cpu1 | CPU | interrupted | never started | n/a |",
                "| cpu2 | CPU | interrupted | lost: no exit status recorded | n/a |"):
        assert row in mine, row
    banner = next(line for line in mine.split("\n") if line.startswith("**This run is incomplete"))
    table = mine.split(contract.FORMAT["report"]["headings"]["children"])[1].split("\n## ")[0]
    assert not [t for t in (banner, table) if "None" in t or "-15" in t or "143" in t]


def test_a_format_7_bundle_keeps_its_exit_codes_as_written(honest_bundle):
    """Formats up to 7 printed children.json's exit_code as Python prints it; the auditor re-renders them so."""
    docs, records, _ = _load(honest_bundle)
    older = _theirs(_stopped_run(docs), records, 7)
    for text in ("child cpu0 ended interrupted with exit code -15; child cpu1 ended interrupted with exit code None",
                 "| child | device | state | exit code | wall s |", "| cpu0 | CPU | interrupted | -15 | 3.2 |"):
        assert text in older, text


def test_a_format_8_report_with_format_7_exit_codes_is_named(older_bundle):
    bundle = older_bundle   # its order numpy's, as format 7 drew it
    strip_version_8(bundle)
    assert "| cpu0 | CPU | completed | 0 |" in (bundle / "report.md").read_text()
    rewrite_manifest(bundle)
    assert "(## Children) reads '| cpu0 | CPU | completed | 0 |" in failed(bundle)
    passes_as_version(bundle, 7)


def test_the_drift_sentence_names_the_exact_spearman_limit_each_renderer_computes_by(monkeypatch):
    """Format 12's drift sentence said "up to 8 values ... beyond 8" as a literal, whatever limit the statistics
    (harness stats.TREND_EXACT_UP_TO, the auditor's documents.summary.trend_exact_up_to) took a p exactly by."""
    summary = json.loads((REPO / "results" / "2026-12-07-ouro-1.4b-2cd50364" / "summary.json").read_text())
    limit = stats.TREND_EXACT_UP_TO + 1
    monkeypatch.setattr(stats, "TREND_EXACT_UP_TO", limit)
    monkeypatch.setitem(contract.DOCS["summary"], "trend_exact_up_to", limit)
    ours = report._drift(summary)[3]
    theirs = render._drift(render.wording(contract.FORMAT["report"], contract.VERSION), summary)[3]
    assert ours == theirs
    assert f"A Spearman p of up to {limit} values is exact" in ours and f"beyond {limit}, the t approximation" in ours
