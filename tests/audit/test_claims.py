"""Every summary.json field is re-derived and report.md must equal the auditor's rendering line for line."""
import json

import pytest

from loopbench.harness import evidence
from tests.audit.tamper import edit_json, edit_report, every_leaf_named, failed, rewrite_manifest

pytestmark = pytest.mark.slow      # about 45 s on 2 cores


def test_every_summary_field_is_rederived(bundle):
    """Each leaf of summary.json changed in turn (manifest rewritten): the auditor names its path."""
    paths = every_leaf_named(bundle, "summary.json", lambda leaf: f"summary.json: {leaf} ")
    for named in ("results[0].stats.throughput_change", "results[0].stats.verdict_reason", "results[0].stats.n_pairs",
                  "results[0].stats.confidence", "results[0].pairs[1]", "results[0].baseline", "results[1].candidate",
                  "checks.tokens_checked", "children[1].wall_s", "checks.findings", "incomplete_reasons"):
        assert named in paths


def test_summary_names_must_match_the_plan_comparisons(bundle):
    def swap(s):
        s["results"][0]["baseline"], s["results"][0]["candidate"] = s["results"][0]["candidate"], s["results"][0]["baseline"]
    edit_json(bundle / "summary.json", swap)
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "summary.json: results[0].baseline is 'alias_prefix', the audit derives 'native'" in text


# --------------------------------------------------------------------------------- defect 5: report

def _result_rows(lines):
    return [i for i, line in enumerate(lines) if line.startswith("| CPU | 2 / 3 |") and "×" in line]


def _forge(line: str) -> str:
    return line.replace("| inconclusive |", "| faster |")


def _insert_forged_row(lines):
    i = _result_rows(lines)[0]
    return lines[:i + 1] + [_forge(lines[i])] + lines[i + 1:]


def _hide_genuine_row(lines):
    i = _result_rows(lines)[0]
    return lines[:i] + [f"<!-- {lines[i]} -->", _forge(lines[i])] + lines[i + 1:]


def _row_outside_tables(lines):
    i = _result_rows(lines)[0]
    return lines[:-2] + [_forge(lines[i])] + lines[-2:]


def _swap_result_rows(lines):
    a, b = _result_rows(lines)[:2]   # the Result table's rows (the Sessions table's follow)
    lines[a], lines[b] = lines[b], lines[a]
    return lines


def _replace_in(section: str, old: str, new: str):
    def edit(lines):
        start = lines.index(section) if section else 0
        i = next(i for i in range(start, len(lines)) if old in lines[i])
        lines[i] = lines[i].replace(old, new, 1)
        return lines
    return edit


def _replace_fact(fact: str, new: str):
    """Replace a header fact taken from plan.json / the bundle (code sha, plan sha, checkpoint sha, prompts sha)."""
    def edit(lines, bundle):
        plan = json.loads((bundle / "plan.json").read_text())
        value = {"code": plan["code"]["git_sha"], "plan": evidence.sha256_file(bundle / "plan.json"),
                 "checkpoint": plan["checkpoint"]["sha256"], "prompts": plan["prompts"]["sha256"]}[fact]
        return _replace_in("", f"`{value}`", f"`{new}`")(lines)
    return edit


REPORT_EDITS = {
    "forged row added": (_insert_forged_row, "(## Result) is not in the re-derived report: '| CPU | 2 / 3 |"),
    "genuine row in an HTML comment": (_hide_genuine_row, "(## Result) holds raw HTML"),
    "result row outside the result tables": (_row_outside_tables, "(## Children) is not in the re-derived report"),
    "result rows swapped": (_swap_result_rows, "(## Result) reads '| CPU | 2 / 3 |"),
    "result row removed": (lambda lines: lines[:_result_rows(lines)[0]] + lines[_result_rows(lines)[0] + 1:],
                           "report.md: lacks the re-derived line '| CPU | 2 / 3 |"),
    "statistics row": (_replace_in("## Statistics", "(exact) | 3 |", "(exact) | 1,716 |"), "(## Statistics) reads"),
    "checks line": (_replace_in("## Checks", "PASS: 8 arms", "PASS: 56 arms"), "(## Checks) reads 'PASS: 56 arms"),
    "graph counters row": (_replace_in("## Graph counters and memory", "| native | 6 |", "| native | 7 |"),
                           "(## Graph counters and memory) reads"),
    "children row": (_replace_in("## Children", "| completed | exit code 0 |", "| completed | exit code 1 |"),
                     "(## Children) reads"),
    "coverage row": (_replace_in("## Layout paths per run", "| alias_prefix | 2 |", "| alias_prefix | 3 |"),
                     "(## Layout paths per run) reads"),
}


@pytest.mark.parametrize("edit", sorted(REPORT_EDITS))
def test_edited_report_is_named(bundle, edit):
    fn, expected = REPORT_EDITS[edit]
    edit_report(bundle, fn)
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert expected in text, text


@pytest.mark.parametrize("fact", ["code", "plan", "checkpoint", "prompts"])
def test_edited_report_header_fact_is_named(bundle, fact):
    forged = "0" * (40 if fact == "code" else 64)
    edit_report(bundle, lambda lines: _replace_fact(fact, forged)(lines, bundle))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "report.md: line " in text and "(header) reads" in text and f"`{forged}`" in text, text


def test_html_comment_anywhere_in_the_report_is_named(bundle):
    edit_report(bundle, lambda lines: lines[:-1] + ["<!-- nothing to see -->", ""])
    rewrite_manifest(bundle)
    assert "holds raw HTML" in failed(bundle)
