"""The independent auditor: passes an honest bundle, and on a tampered one fails naming what changed.

Every tamper below rewrites manifest.json as well (every file, dotfiles included), so it is the
auditor's re-derivation that must catch it, not the manifest's hashes. The auditor never imports the
harness.
"""
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from loopbench.audit import coverage as derive_coverage, derive
from loopbench.audit.__main__ import main as audit_main
from loopbench.audit import auditor
from loopbench.audit.auditor import audit
from loopbench.harness import conf, controller, evidence, stats

REPO = Path(__file__).resolve().parents[2]
GPU_BUNDLE = REPO / "results" / "2026-11-30-ouro-1.4b-nogit"
MINI = ["name=mini", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=17", "workload.prompt_lens=null",
        "workload.output_len=4", "pairs=2",
        "comparisons=[{baseline:native,candidate:alias_prefix},{baseline:native,candidate:native}]", "executor.poll_s=0.1"]


@pytest.fixture(scope="module")
def honest_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("audit")
    cfg = conf.compose("cpu-smoke", MINI + [f"results_dir={root / 'results'}", f"cache_dir={root / 'cache'}"])
    result = controller.run(cfg)
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    assert result.summary["checks"]["ok"], result.summary["checks"]["findings"]
    return result.bundle


@pytest.fixture
def bundle(honest_bundle, tmp_path) -> Path:
    copy = tmp_path / honest_bundle.name
    shutil.copytree(honest_bundle, copy)
    return copy


# ------------------------------------------------------------------------------------------ helpers

def _rewrite_manifest(bundle: Path) -> None:
    """A forger's manifest: every file now in the bundle, dotfiles included, with its true sha256."""
    files = {}
    for p in sorted(bundle.rglob("*")):
        rel = p.relative_to(bundle).as_posix()
        if p.is_file() and rel not in ("manifest.json", "audit.json"):
            files[rel] = {"sha256": evidence.sha256_file(p), "bytes": p.stat().st_size}
    evidence.atomic_write_json(bundle / "manifest.json", {"schema_version": 1, "files": files})


def _edit_table(bundle: Path, name: str, fn) -> None:
    df = pd.read_parquet(bundle / "tables" / f"{name}.parquet")
    evidence.write_table(bundle / "tables" / f"{name}.parquet", fn(df))


def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _edit_report(bundle: Path, fn) -> None:
    path = bundle / "report.md"
    path.write_text("\n".join(fn(path.read_text().split("\n"))))


def _raw(bundle: Path, seq: int) -> Path:
    return next((bundle / "raw" / "cpu0").glob(f"{seq:05d}-*.json"))


def _failed(bundle: Path) -> str:
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    return "\n".join(verdict["discrepancies"])


def _tampered(value):
    """A different value of the same kind."""
    if isinstance(value, (bool, np.bool_)):
        return not value
    if isinstance(value, (int, np.integer)):
        return int(value) + 1
    if isinstance(value, (float, np.floating)):
        return 1.0 if np.isnan(value) else float(value) * 1.5 + 1
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return 1
    return [int(v) + 1 for v in value]


def _leaves(data, path=""):
    """(path, value) of every leaf of a JSON document, paths spelt as the auditor spells them."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(data, list) and data:
        for i, v in enumerate(data):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, data


def _set(data, path: str, value) -> None:
    keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
    for k in keys[:-1]:
        data = data[k]
    data[keys[-1]] = value


# ----------------------------------------------------------------------------------------- honest

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
        assert rec["schema"] == 2 and set(rec["coverage"]) == set(derive_coverage.KEYS)
        assert row["coverage_routed_reads"] == rec["coverage"]["routed_reads"]
        assert list(row["coverage_exits_per_depth"]) == rec["coverage"]["exits_per_depth"]
        assert (rec["coverage"]["routed_reads"] > 0) == (rec["arm_config"]["kv_layout"] == "alias")
        assert (rec["coverage"]["fill_token_planes"] > 0) == (rec["arm_config"]["kv_layout"] == "native")
    report = (bundle / "report.md").read_text()
    section = report.split("## Layout paths per run")[1].split("## Children")[0]
    assert [line.split(" | ")[2] for line in section.split("\n") if line.startswith("| cpu | 2 / 3 |")] == [
        "alias_prefix", "native"]
    warnings = json.loads((bundle / "summary.json").read_text())["checks"]["warnings"]
    assert warnings == ["cpu0 B2C3 native_vs_alias_prefix: arm 'alias_prefix' read no key tile directly: this "
                        "comparison does not exercise where its arms differ"]
    assert f"- warning: {warnings[0]}" in report


def test_forged_coverage_count_is_named(bundle):
    """Raw record and table alike inflated: the frozen schedule gives the true count."""
    _edit_json(_raw(bundle, 1), lambda rec: rec["coverage"].update(routed_reads=rec["coverage"]["routed_reads"] + 7))
    _edit_table(bundle, "arms", lambda df: df.assign(coverage_routed_reads=df["coverage_routed_reads"].where(
        df["seq"] != 1, df["coverage_routed_reads"] + 7)))
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "coverage: record cpu0 seq 1 (" in text and "coverage.routed_reads is " in text, text
    assert "the frozen schedule gives" in text


def test_record_that_drops_its_coverage_is_named(bundle):
    _edit_json(_raw(bundle, 2), lambda rec: rec.pop("coverage"))
    _rewrite_manifest(bundle)
    assert "is not an arm record: coverage is None" in _failed(bundle)


def test_dropped_coverage_warning_is_named(bundle):
    _edit_json(bundle / "summary.json", lambda s: s["checks"].update(warnings=[]))
    _edit_report(bundle, lambda lines: [line for line in lines if not line.startswith("- warning:")])
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "summary.json: checks.warnings has 0 entries, the audit derives 1" in text, text
    assert 'report.md: lacks the re-derived line "- warning: cpu0 B2C3 native_vs_alias_prefix' in text


def test_committed_gpu_bundle_passes():
    verdict = audit(GPU_BUNDLE)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"]["records"] == 56 and verdict["checked"]["results"] == 4


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


# ------------------------------------------------------------------------ tokens, timings, references

@pytest.mark.parametrize("rewrite_manifest", [False, True])
def test_changed_token_in_tokens_table_is_named(bundle, rewrite_manifest):
    def change(df):
        i = df.index[(df["seq"] == 3) & (df["phase"] == "measured") & (df["request_id"] == "r0001")
                     & (df["position"] == 2)][0]
        df.loc[i, "token_id"] = (df.loc[i, "token_id"] + 1) % 256
        return df
    _edit_table(bundle, "tokens", change)
    if rewrite_manifest:
        _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "tokens.parquet: token_id of cpu0 seq 3 measured request r0001 position 2" in text
    assert ("manifest: tables/tokens.parquet changed" in text) != rewrite_manifest


@pytest.mark.parametrize("rewrite_manifest", [False, True])
def test_changed_exit_depth_is_named(bundle, rewrite_manifest):
    def change(rec):
        d = rec["measured"]["outputs"]["r0002"]["exit_depths"]
        d[1] = 4 if d[1] != 4 else 3
    _edit_json(_raw(bundle, 5), change)
    if rewrite_manifest:
        _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "exit_depths: cpu0 seq 5" in text and "request 'r0002' position 1" in text
    assert "tokens.parquet: exit_depth of cpu0 seq 5 measured request r0002 position 1" in text
    assert ("manifest: raw/cpu0/" in text) != rewrite_manifest


@pytest.mark.parametrize("rewrite_manifest", [False, True])
def test_changed_timing_in_arms_table_is_named(bundle, rewrite_manifest):
    def change(df):
        df.loc[df["seq"] == 2, "elapsed_s"] *= 0.9
        return df
    _edit_table(bundle, "arms", change)
    if rewrite_manifest:
        _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "arms.parquet: elapsed_s of cpu0 seq 2" in text
    assert ("manifest: tables/arms.parquet changed" in text) != rewrite_manifest


def test_changed_timing_in_raw_record_is_named(bundle):
    _edit_json(_raw(bundle, 6), lambda rec: rec["measured"].update(elapsed_s=rec["measured"]["elapsed_s"] * 1.5))
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "record cpu0 seq 6" in text and "tokens_per_s" in text
    assert "arms.parquet: elapsed_s of cpu0 seq 6" in text


def test_changed_token_in_raw_record_and_table_is_caught_by_the_reference(bundle):
    """A forger who edits the raw record and the table alike still differs from the frozen reference."""
    def change_rec(rec):
        rec["warmup"]["outputs"]["r0000"]["token_ids"][3] = (rec["warmup"]["outputs"]["r0000"]["token_ids"][3] + 1) % 256
    _edit_json(_raw(bundle, 1), change_rec)
    _edit_table(bundle, "tokens", lambda df: df.assign(token_id=df["token_id"].where(
        ~((df["seq"] == 1) & (df["phase"] == "warmup") & (df["request_id"] == "r0000") & (df["position"] == 3)),
        (df["token_id"] + 1) % 256)))
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "tokens: cpu0 seq 1 B2C3" in text and "request 'r0000' position 3" in text
    assert "summary.json: checks.ok is True, the audit derives False" in text


def test_changed_plan_is_named(bundle):
    _edit_json(bundle / "plan.json", lambda p: p["config"].update(pairs=3))
    text = _failed(bundle)
    assert "manifest: plan.json changed" in text and "plan: config sha256" in text


# ------------------------------------------------------------------- defects 1-3: every table column

ROWS = {  # table -> (row selector, the row's key as the auditor names it)
    "arms": (lambda df: (df["seq"] == 2), "cpu0 seq 2"),
    "pairs": (lambda df: (df["comparison"] == "native_vs_alias_prefix") & (df["pair"] == 1),
              "cpu0 B2C3 native_vs_alias_prefix pair 1"),
    "requests": (lambda df: (df["seq"] == 3) & (df["phase"] == "measured") & (df["request_id"] == "r0001"),
                 "cpu0 seq 3 measured request r0001"),
    "tokens": (lambda df: (df["seq"] == 3) & (df["phase"] == "measured") & (df["request_id"] == "r0001")
               & (df["position"] == 2), "cpu0 seq 3 measured request r0001 position 2"),
}


@pytest.mark.parametrize("table", sorted(ROWS))
def test_every_table_column_is_compared_with_the_raw_records(bundle, table):
    """Each column of one row changed in turn (manifest rewritten): the auditor names column and row."""
    select, where = ROWS[table]
    path = bundle / "tables" / f"{table}.parquet"
    original = path.read_bytes()
    df = pd.read_parquet(path)
    i = int(np.flatnonzero(select(df))[0])
    must_cover = {"arms": {"arm_kv_layout", "arm_prefix_tiles", "arm_cuda_graphs", "work_rows_per_depth",
                           "work_decode_tokens", "kv_blocks_used", "trace_sha256", "warmup_elapsed_s"},
                  "pairs": {"baseline_seq", "candidate_seq", "first", "ratio"},
                  "requests": {"finish_reason", "num_tokens", "mean_exit_depth"},
                  "tokens": {"token_id", "exit_depth"}}[table]
    assert must_cover <= set(df.columns)
    for col in df.columns:
        changed = df.copy()
        changed[col] = [(_tampered(v) if j == i else v) for j, v in enumerate(df[col])]
        evidence.write_table(path, changed)
        _rewrite_manifest(bundle)
        text = _failed(bundle)
        if col in derive.TABLE_KEYS[table]:
            assert f"{table}.parquet: lacks the row of {where}" in text, (col, text)
        else:
            assert f"{table}.parquet: {col} of {where} is " in text, (col, text)
        path.write_bytes(original)


def test_missing_extra_and_repeated_table_rows_are_named(bundle):
    _edit_table(bundle, "requests", lambda df: df[~ROWS["requests"][0](df)])
    _edit_table(bundle, "pairs", lambda df: pd.concat([df, df.iloc[[0]]]))
    _edit_table(bundle, "arms", lambda df: pd.concat([df, df.iloc[[0]].assign(seq=99)]))
    _edit_table(bundle, "arms", lambda df: df.drop(columns=["work_steps"]))
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "requests.parquet: lacks the row of cpu0 seq 3 measured request r0001" in text
    assert "pairs.parquet: repeats the row of cpu0 B2C3" in text
    assert "arms.parquet: has a row for cpu0 seq 99 that the raw records do not give" in text
    assert "arms.parquet: lacks column 'work_steps'" in text


# ---------------------------------------------------------------------- defect 4: every summary field

def test_every_summary_field_is_rederived(bundle):
    """Each leaf of summary.json changed in turn (manifest rewritten): the auditor names its path."""
    path = bundle / "summary.json"
    original = path.read_text()
    leaves = list(_leaves(json.loads(original)))
    paths = {p for p, _ in leaves}
    for named in ("results[0].stats.throughput_change", "results[0].stats.verdict_reason", "results[0].stats.n_pairs",
                  "results[0].stats.confidence", "results[0].pairs[1]", "results[0].baseline", "results[1].candidate",
                  "checks.tokens_checked", "children[1].wall_s", "checks.findings", "incomplete_reasons"):
        assert named in paths
    for leaf, value in leaves:
        data = json.loads(original)
        _set(data, leaf, ["forged"] if value == [] else _tampered(value) if value is not None else "forged")
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        _rewrite_manifest(bundle)
        text = _failed(bundle)
        assert f"summary.json: {leaf} " in text, (leaf, text)
    path.write_text(original)


def test_summary_names_must_match_the_plan_comparisons(bundle):
    def swap(s):
        s["results"][0]["baseline"], s["results"][0]["candidate"] = s["results"][0]["candidate"], s["results"][0]["baseline"]
    _edit_json(bundle / "summary.json", swap)
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "summary.json: results[0].baseline is 'alias_prefix', the audit derives 'native'" in text


# --------------------------------------------------------------------------------- defect 5: report

def _result_rows(lines):
    return [i for i, line in enumerate(lines) if line.startswith("| cpu | 2 / 3 |") and "×" in line]


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
    a, b = _result_rows(lines)
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
    "forged row added": (_insert_forged_row, "(## Result) is not in the re-derived report: '| cpu | 2 / 3 |"),
    "genuine row in an HTML comment": (_hide_genuine_row, "(## Result) holds raw HTML"),
    "result row outside the result tables": (_row_outside_tables, "(## Children) is not in the re-derived report"),
    "result rows swapped": (_swap_result_rows, "(## Result) reads '| cpu | 2 / 3 |"),
    "result row removed": (lambda lines: lines[:_result_rows(lines)[0]] + lines[_result_rows(lines)[0] + 1:],
                           "report.md: lacks the re-derived line '| cpu | 2 / 3 |"),
    "statistics row": (_replace_in("## Statistics", "(exact) | 3 |", "(exact) | 1,716 |"), "(## Statistics) reads"),
    "checks line": (_replace_in("## Checks", "PASS: 8 arms", "PASS: 56 arms"), "(## Checks) reads 'PASS: 56 arms"),
    "graph counters row": (_replace_in("## Graph counters and memory", "| native | 6 |", "| native | 7 |"),
                           "(## Graph counters and memory) reads"),
    "children row": (_replace_in("## Children", "| completed | 0 |", "| completed | 1 |"), "(## Children) reads"),
    "coverage row": (_replace_in("## Layout paths per run", "| alias_prefix | 2 |", "| alias_prefix | 3 |"),
                     "(## Layout paths per run) reads"),
}


@pytest.mark.parametrize("edit", sorted(REPORT_EDITS))
def test_edited_report_is_named(bundle, edit):
    fn, expected = REPORT_EDITS[edit]
    _edit_report(bundle, fn)
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert expected in text, text


@pytest.mark.parametrize("fact", ["code", "plan", "checkpoint", "prompts"])
def test_edited_report_header_fact_is_named(bundle, fact):
    forged = "0" * (40 if fact == "code" else 64)
    _edit_report(bundle, lambda lines: _replace_fact(fact, forged)(lines, bundle))
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "report.md: line " in text and "(header) reads" in text and f"`{forged}`" in text, text


def test_html_comment_anywhere_in_the_report_is_named(bundle):
    _edit_report(bundle, lambda lines: lines[:-1] + ["<!-- nothing to see -->", ""])
    _rewrite_manifest(bundle)
    assert "holds raw HTML" in _failed(bundle)


# ----------------------------------------------------------------------- defect 6: required files

@pytest.mark.parametrize("rel", [
    "environment.json", "logs/cpu0.log", "logs/reference.log", "jobs/session-cpu0.json", "jobs/reference-cpu0.json",
    "children.json", "report.md", "pair_ratios.png", "references/B2C3.schedule.json", "references/B2C3.meta.json",
    "prompts.json", "summary.json", "plan.json", "tables/telemetry.parquet", "manifest.json"])
def test_missing_required_file_is_named(bundle, rel):
    (bundle / rel).unlink()
    if rel != "manifest.json":
        _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert f"files: required file {rel} is missing" in text, text


def test_deleted_raw_record_makes_the_claims_wrong(bundle):
    _raw(bundle, 7).unlink()
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert "summary.json: status is 'complete', the audit derives 'incomplete'" in text
    assert "summary.json: counts.arms_recorded is 8, the audit derives 7" in text


def test_record_device_must_be_the_planned_device(bundle):
    _edit_json(_raw(bundle, 3), lambda rec: rec["device"].update(label="H200 #0", gpu_index=0))
    _edit_json(bundle / "children.json", lambda ch: ch[1].update(device="H200 #1"))
    _rewrite_manifest(bundle)
    text = _failed(bundle)
    assert ("devices: record cpu0 seq 3: device (kind, label, gpu_index) ('cpu', 'H200 #0', 0) is not the plan's "
            "('cpu', 'cpu', None)") in text
    assert "devices: children.json: child cpu0 ran on 'H200 #1', the plan says 'cpu'" in text
    assert "summary.json: children[1].device is 'cpu', the audit derives 'H200 #1'" in text


# ------------------------------------------------------------------ defect 7: load errors, dotfiles

def _truncate(rel):
    def edit(bundle):
        p = bundle / rel if rel != "raw" else _raw(bundle, 3)
        p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
        return p.relative_to(bundle).as_posix()
    return edit


def _write(rel, text):
    def edit(bundle):
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_text(text)
        return rel
    return edit


def _copy_record_to(rel):
    def edit(bundle):
        shutil.copy(_raw(bundle, 3), bundle / rel)
        return rel
    return edit


def _drop_measured(bundle):
    path = _raw(bundle, 4)
    _edit_json(path, lambda rec: rec.pop("measured"))
    return path.relative_to(bundle).as_posix()


LOAD_ERRORS = {
    "truncated raw record": (_truncate("raw"), "raw: {rel} could not be read: JSONDecodeError"),
    "stray dotfile record": (_write("raw/cpu0/.x.json", "{"), "raw: {rel} could not be read: JSONDecodeError"),
    "dotfile copy of a record": (_copy_record_to("raw/cpu0/.x.json"), "raw: {rel} holds cpu0 seq 3, whose file is"),
    "record that is a list": (_write("raw/cpu0/00099-x.json", "[]"), "raw: {rel} is not an arm record: a JSON list"),
    "record without a measured run": (_drop_measured, "raw: {rel} is not an arm record: measured is missing"),
    "file outside raw/<job>/": (_write("raw/stray.json", "{}"), "raw: {rel} is not a raw/<job>/<arm>.json record"),
    "unreadable table": (_write("tables/arms.parquet", "not parquet"), "tables: {rel} could not be read"),
    "truncated summary": (_truncate("summary.json"), "files: {rel} could not be read: JSONDecodeError"),
    "truncated plan": (_truncate("plan.json"), "files: {rel} could not be read: JSONDecodeError"),
    "truncated children": (_truncate("children.json"), "files: {rel} could not be read: JSONDecodeError"),
    "truncated reference": (_truncate("references/B2C3.schedule.json"), "reference: {rel} could not be read"),
    "truncated manifest": (_truncate("manifest.json"), "files: {rel} could not be read: JSONDecodeError"),
}


@pytest.mark.parametrize("case", sorted(LOAD_ERRORS))
def test_unreadable_file_is_a_named_discrepancy_with_a_written_verdict(bundle, case, capsys):
    edit, expected = LOAD_ERRORS[case]
    rel = edit(bundle)
    if rel != "manifest.json":
        _rewrite_manifest(bundle)
    assert audit_main([str(bundle)]) == 1
    verdict = json.loads((bundle / "audit.json").read_text())
    assert verdict["status"] == "fail"
    assert any(expected.format(rel=rel) in d for d in verdict["discrepancies"]), verdict["discrepancies"]
    assert "audit FAIL" in capsys.readouterr().out


def test_file_missing_from_the_manifest_is_named_dotfiles_included(bundle):
    (bundle / "raw" / "cpu0" / ".x.json").write_text("{")
    (bundle / ".notes").write_text("hello")
    evidence.write_manifest(bundle)   # the harness's manifest leaves dotfiles out; the auditor counts them
    text = _failed(bundle)
    assert "manifest: raw/cpu0/.x.json is in the bundle but not in the manifest" in text
    assert "manifest: .notes is in the bundle but not in the manifest" in text
    assert "raw: raw/cpu0/.x.json could not be read" in text


# ------------------------------------------------------------- the layout contract and wall clocks

def _copy(src: str, dest: str):
    def edit(bundle):
        (bundle / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(bundle / src, bundle / dest)
        return dest
    return edit


STRAYS = {
    "an extra table": _copy("tables/arms.parquet", "tables/arms_best.parquet"),
    "a second report": _write("report-draft.md", "# loopbench: mini (complete)\n| cpu | 2 / 3 | faster |\n"),
    "a reference of no planned point": _copy("references/B2C3.schedule.json", "references/B9C9.schedule.json"),
    "a log of no planned session": _copy("logs/cpu0.log", "logs/gpu7.log"),
    "a file in a folder the layout lacks": _write("notes/why.txt", "trust me"),
}


@pytest.mark.parametrize("case", sorted(STRAYS))
def test_stray_file_listed_in_the_manifest_is_named(bundle, case):
    """A file outside the layout contract fails the audit even with a true manifest entry: only the layout
    check can catch it, since no other check reads a file the format does not define."""
    rel = STRAYS[case](bundle)
    _rewrite_manifest(bundle)
    assert rel in json.loads((bundle / "manifest.json").read_text())["files"]
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    assert verdict["discrepancies"] == [f"layout: {rel} is not a file of the bundle layout "
                                        f"(loopbench/bundle_layout.json version {auditor.LAYOUT['version']})"]


def test_manifest_of_another_layout_version_is_named(bundle):
    _edit_json(bundle / "manifest.json", lambda m: m.update(layout_version=auditor.LAYOUT["version"] + 1))
    assert f"layout: manifest.json records bundle layout version {auditor.LAYOUT['version'] + 1}" in _failed(bundle)


def test_the_harness_writes_the_layout_contract_and_nothing_else(honest_bundle, tmp_path):
    """Writer and auditor read one contract file: every file of a real bundle is in it, every required one
    is there, the manifest records its version, and no entry of the contract is dead."""
    bundle = tmp_path / "b"
    shutil.copytree(honest_bundle, bundle)
    assert audit_main([str(bundle)]) == 0                     # writes audit.json, the last file of the layout
    assert evidence.bundle_layout() == auditor.LAYOUT
    assert evidence.TABLES == tuple(auditor.LAYOUT["tables"]) and evidence.UNMANIFESTED == auditor.UNMANIFESTED
    plan = json.loads((bundle / "plan.json").read_text())
    assert auditor.layout_strays(bundle, plan) == []
    assert all((bundle / rel).is_file() for rel in auditor.layout_required(plan, {"cpu0"}))
    assert json.loads((bundle / "manifest.json").read_text())["layout_version"] == auditor.LAYOUT["version"]
    files = [p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()]
    domain = auditor.layout_domains(plan, set())["optional"]
    for entry in auditor.LAYOUT["files"]:
        assert any(auditor._layout_pattern(entry["path"], domain).fullmatch(f) for f in files), entry["path"]
        assert (REPO / entry["writer"]).is_file(), entry["writer"]


def _forge_elapsed(bundle: Path, seq: int, fn) -> dict:
    """Change one measured elapsed_s in its raw record and let the harness re-derive everything from it
    (tokens/s, tables, summary, report, plot, manifest), as a forger with the harness would."""
    path = _raw(bundle, seq)
    rec = json.loads(path.read_text())
    fn(rec)
    rec["tokens_per_s"] = stats.tokens_per_s(rec["num_requests"], rec["output_len"], rec["measured"]["elapsed_s"])
    path.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    plan, summary, children, env = (json.loads((bundle / f"{name}.json").read_text())
                                    for name in ("plan", "summary", "children", "environment"))
    evidence.finalize(bundle, plan, summary["checks"], children, env)
    return rec


def test_forged_elapsed_longer_than_the_wall_clock_span_is_named(bundle):
    def stretch(rec):
        wall = rec["wall_clock"]
        rec["measured"]["elapsed_s"] = 2 * (wall["measured_end_unix_s"] - wall["measured_start_unix_s"]) + 0.01
    rec = _forge_elapsed(bundle, 6, stretch)
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    assert len(verdict["discrepancies"]) == 1, verdict["discrepancies"]   # everything else re-derives
    assert verdict["discrepancies"][0].startswith(
        f"timing: record cpu0 seq 6 ({rec['arm']}): measured elapsed_s {rec['measured']['elapsed_s']!r} is longer "
        "than its wall-clock span")


def test_record_without_a_wall_clock_span_is_named(bundle):
    rec = _forge_elapsed(bundle, 3, lambda r: r.pop("wall_clock"))
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    assert verdict["discrepancies"] == [f"timing: record cpu0 seq 3 ({rec['arm']}): no wall-clock span to bound "
                                        "its measured elapsed_s: wall_clock is None"]


# -------------------------------------------------------------------------------------- independence

def test_auditor_imports_nothing_from_the_harness():
    for path in sorted((REPO / "audit").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            for name in names:
                assert "harness" not in name and not name.startswith(".."), f"{path.name} imports {name}"


def test_auditor_runs_with_the_harness_unimportable(bundle):
    code = ("import sys, runpy; sys.modules['loopbench.harness'] = None; "
            f"sys.argv = ['audit', {str(bundle)!r}]; runpy.run_module('loopbench.audit', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "audit PASS" in proc.stdout
    assert json.loads((bundle / "audit.json").read_text())["status"] == "pass"
    assert "audit.json" not in json.loads((bundle / "manifest.json").read_text())["files"]
    # and the CLI exits 1 on a tampered bundle
    _edit_table(bundle, "tokens", lambda df: df.assign(exit_depth=df["exit_depth"].where(df.index != 0, 1)))
    proc = subprocess.run([sys.executable, "-m", "loopbench.audit", str(bundle)], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1 and "audit FAIL" in proc.stdout and "exit_depth" in proc.stdout
