"""The online track's evidence against the auditor (audit/check_online.py): an honest cpu-online bundle
passes; changing one latency, timestamp, figure, token or report line fails the audit and names it. From format
10 each online record says what its server's engine ran with (audit/check_settings.py check_online)."""
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from loopbench.audit import contract
from loopbench.harness import conf, controller, evidence, planning
from loopbench.harness.online import evidence as online_evidence, metrics
from loopbench.harness.online.loadgen import TIMEOUT_ERROR

from .tamper import (REPO, audit, edit_json, edit_report, failed, forge_settings, numpy_draws, passes_as_version,
                     rewrite_manifest, strip_version_10)

SMALL = ["online.num_requests=6", "online.rates=[1.0]", "online.warmup_requests=2", "executor.poll_s=0.1"]


def _run_online(root: Path) -> Path:
    cfg = conf.compose("cpu-online", SMALL + [f"results_dir={root / 'results'}", f"cache_dir={root / 'cache'}"])
    result = controller.run(cfg)
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    return result.bundle


@pytest.fixture(scope="module")
def honest_online(tmp_path_factory) -> Path:
    return _run_online(tmp_path_factory.mktemp("online"))


@pytest.fixture(scope="module")
def numpy_trace_online(tmp_path_factory) -> Path:
    """An honest cpu-online bundle whose plan drew its trace as formats 5 to 13 did (numpy's Generator,
    online.trace_rule_before; the auditor's own copy of that rule stands in for the old writer), and its pair orders
    and prompts as formats up to 14 did (tamper.numpy_draws)."""
    from loopbench.audit import check_online
    from loopbench.harness.online import loadgen

    with numpy_draws() as patch:
        patch.setattr(loadgen, "unit_trace", check_online.numpy_unit_arrivals)
        return _run_online(tmp_path_factory.mktemp("online-numpy-trace"))


@pytest.fixture
def bundle(honest_online, tmp_path) -> Path:
    copy = tmp_path / honest_online.name
    shutil.copytree(honest_online, copy)
    return copy


def _raw(bundle: Path, seq: int) -> Path:
    return next((bundle / "online" / "cpu0").glob(f"{seq:05d}-*.json"))


def test_the_honest_online_bundle_passes_and_serves_the_reference_tokens(honest_online):
    verdict = audit(honest_online)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"]["online_records"] == 3 and verdict["checked"]["online_request_rows"] == 18
    summary = json.loads((honest_online / "online" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["checks"]["ok"], summary["checks"]
    assert summary["checks"]["requests_checked"] == 18 and summary["slo"]["source"] == "calibration"
    assert [r["kind"] for r in summary["runs"]] == ["calibration", "arm", "arm"]
    table = pd.read_parquet(honest_online / "online" / "requests.parquet")
    assert {"ttft_s", "e2e_latency_s", "tpot_s", "itl_s", "planned_s"} <= set(table.columns)
    assert (table["ttft_s"] > 0).all() and (table["tokens"] == 16).all()
    report = (honest_online / "report.md").read_text()
    assert "## Online serving" in report and "Served tokens equal the frozen natural reference" in report
    assert (honest_online / "online" / "latency.png").stat().st_size > 0
    files = [p.relative_to(honest_online).as_posix() for p in honest_online.rglob("*") if p.is_file()]
    domain = contract.layout_domains(json.loads((honest_online / "plan.json").read_text()), set())["optional"]
    for entry in contract.FORMAT["files"]:              # no online entry of the contract is dead
        if entry["path"].startswith("online/"):
            assert any(contract.layout_pattern(entry["path"], domain).fullmatch(f) for f in files), entry["path"]
            assert (REPO / entry["writer"]).is_file(), entry["writer"]


def test_tampering_one_latency_in_the_table_fails_naming_it(bundle):
    path = bundle / "online" / "requests.parquet"
    df = pd.read_parquet(path)
    df.loc[4, "ttft_s"] = df.loc[4, "ttft_s"] * 0.5
    evidence.write_table(path, df)
    rewrite_manifest(bundle)
    text = failed(bundle)
    row = df.loc[4]
    assert f"online/requests.parquet: row cpu0 seq {row['seq']} request {row['request_index']}: ttft_s is" in text


def test_tampering_one_raw_timestamp_fails_naming_the_figures_it_moves(bundle):
    """The first-token time of the run's slowest request (by TTFT) moved to 0.0: its TTFT becomes the lowest, so
    the p99 TTFT (which interpolates between the two highest of the run's TTFTs) moves whatever the measured
    latencies. (Request 2's TTFT moved alone changed neither p50 nor p99 when it was already below the median.)"""
    rec = json.loads(_raw(bundle, 1).read_text())
    ttfts = [metrics.request_latencies(q)["ttft_s"] for q in rec["requests"]]
    i = max((j for j, t in enumerate(ttfts) if t is not None), key=lambda j: ttfts[j])
    edit_json(_raw(bundle, 1), lambda rec: rec["requests"][i]["token_times_s"].__setitem__(0, 0.0))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert f"online/requests.parquet: row cpu0 seq 1 request {rec['requests'][i]['index']}: first_token_s is" in text
    assert "online/summary.json: runs[1].p99_ttft_s is" in text


@pytest.mark.parametrize("leaf", ["p99_ttft_s", "p50_ttft_s", "p99_itl_s", "goodput_rps", "throughput_tokens_per_s"])
def test_tampering_a_summary_figure_fails_naming_it(bundle, leaf):
    # a goodput of 0 (no request of the run met the SLO derived from the calibration run) scaled stays 0
    edit_json(bundle / "online" / "summary.json",
              lambda s: s["runs"][2].__setitem__(leaf, s["runs"][2][leaf] * 1.01 or 0.01))
    rewrite_manifest(bundle)
    assert f"online/summary.json: runs[2].{leaf} is" in failed(bundle)


def test_tampering_a_paired_median_or_the_slo_fails_naming_it(bundle):
    def forge(s):
        s["rates"][0]["figures"]["goodput_rps"]["ratio_median"] = 2.0
        s["slo"]["ttft_s"] *= 2
    edit_json(bundle / "online" / "summary.json", forge)
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "online/summary.json: rates[0].figures.goodput_rps.ratio_median is 2.0" in text
    assert "online/summary.json: slo.ttft_s is" in text


def test_a_planned_arrival_off_the_trace_fails(bundle):
    edit_json(_raw(bundle, 2), lambda rec: rec["requests"][3].__setitem__("planned_s", rec["requests"][3]["planned_s"] + 0.1))
    rewrite_manifest(bundle)
    assert "record seq 2 request 3: planned_s" in failed(bundle)


def test_a_changed_served_token_is_a_failed_check_naming_request_and_position(bundle):
    """The harness's own check names the first differing request and token; a summary that still says ok fails."""
    edit_json(_raw(bundle, 2), lambda rec: rec["requests"][1]["token_ids"].__setitem__(5, rec["requests"][1]["token_ids"][5] + 1))
    plan = json.loads((bundle / "plan.json").read_text())
    checks = online_evidence.online_summary(bundle, plan, online_evidence.load_online_records(bundle))["checks"]
    assert not checks["ok"]
    first = checks["mismatches"][0]
    assert (first["seq"], first["request_index"], first["reference_request_id"], first["position"]) == (2, 1, "r0001", 5)
    rewrite_manifest(bundle)
    assert "online/summary.json: checks.ok is True, re-derived from the raw timestamps False" in failed(bundle)


def test_an_edited_online_report_line_fails(bundle):
    edit_report(bundle, lambda lines: [line.replace("0 failed requests", "0 failed requests (all fine)") for line in lines])
    rewrite_manifest(bundle)
    assert "report.md: line" in failed(bundle) and "(## Online serving)" in failed(bundle)


def test_a_stray_online_file_fails_the_layout(bundle):
    (bundle / "online" / "notes.json").write_text("{}")
    rewrite_manifest(bundle)
    assert "layout: online/notes.json is not a file of the bundle layout" in failed(bundle)


def test_a_format_4_claim_with_an_online_track_is_a_downgrade(bundle):
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=4))
    edit_json(bundle / "plan.json", lambda p: p.pop("natural"))     # format 6's field, named first otherwise
    assert "plan: plan.json: online is a field that" in failed(bundle)


def _only_a_calibration_run_that_completed_no_request(bundle) -> None:
    """The online track stopped after its calibration run (seq 0), every request of which timed out."""
    for path in sorted((bundle / "online" / "cpu0").glob("*.json"))[1:]:
        path.unlink()

    def all_failed(rec):
        for q in rec["requests"]:
            q.update(token_times_s=[], token_ids=[], finish_reason=None, error=TIMEOUT_ERROR)
    edit_json(_raw(bundle, 0), all_failed)


def test_a_calibration_run_that_completed_no_request_publishes_an_incomplete_bundle_without_an_slo(bundle):
    """A calibration run whose every request failed (a server too slow for max_duration_s) fails its session; the
    bundle must still publish, incomplete, with no derived SLO (publishing crashed on factor x None), and the
    auditor must re-derive the same rather than crash."""
    _only_a_calibration_run_that_completed_no_request(bundle)
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    children[-1].update(state="failed", exit_code=1)
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    summary = json.loads((bundle / "online" / "summary.json").read_text())
    assert summary["status"] == "incomplete" and summary["capacity_rps"] == 0.0
    assert (summary["slo"]["ttft_s"], summary["slo"]["tpot_s"]) == (None, None)
    assert [r["goodput_rps"] for r in summary["runs"]] == [None]
    verdict = audit(bundle)
    assert verdict["status"] == "incomplete", verdict["discrepancies"]
    assert not verdict["discrepancies"]


def test_a_bundle_stopped_in_its_online_track_is_resumed_to_a_complete_track(honest_online, bundle):
    """A stop in the middle of the online track (SIGTERM to the controller after two of its three runs, between the
    two runs of a pair): the resume measures the pair again in its own session, at the recorded calibration run's
    capacity, and keeps the pair's lone run, record and server log byte for byte, under superseded/ (format 15; it
    deleted them). (A resume ran no online run, then published the bundle complete with its online track incomplete
    for good, and the audit passed it; then it ran only the run left, so the pair's two runs came from two sessions,
    which a pair of arm runs never does.)"""
    _raw(bundle, 2).unlink()
    lone = {p.name: p.read_bytes() for p in (bundle / "online" / "cpu0").glob(f"{1:05d}-*")}   # its .json and .log
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    children[-1].update(state="interrupted", exit_code=-15, interrupted_by="SIGTERM")
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    assert json.loads((bundle / "online" / "summary.json").read_text())["status"] == "incomplete"
    root = honest_online.parent.parent
    overrides = SMALL + [f"results_dir={bundle.parent}", f"cache_dir={root / 'cache'}", f"resume={bundle}"]
    text = planning.plan_text("cpu-online", overrides)     # what `loopbench plan resume=` says first
    assert "  resume runs 2 of the online track's 3 runs (those not recorded, and a pair's lone run again with its " \
           "partner)" in text.split("\n"), text
    assert f"online/cpu0/{_raw(bundle, 1).name} -> superseded/cpu0/online/cpu0/{_raw(bundle, 1).name}" in text
    result = controller.run(conf.compose("cpu-online", overrides))
    summary = json.loads((bundle / "online" / "summary.json").read_text())
    assert (summary["status"], summary["runs_recorded"]) == ("complete", 3) and summary["checks"]["ok"]
    assert [json.loads(_raw(bundle, s).read_text())["session"] for s in (0, 1, 2)] == ["cpu0", "cpu0.r1", "cpu0.r1"]
    assert [json.loads(_raw(bundle, s).read_text())["capacity_rps"] for s in (1, 2)] == [summary["capacity_rps"]] * 2
    assert result.summary["status"] == "complete"
    aside = bundle / "superseded" / "cpu0" / "online" / "cpu0"
    assert sorted(lone) == sorted(p.name for p in aside.iterdir()) and len(lone) == 2
    assert all((aside / name).read_bytes() == data for name, data in lone.items())
    assert json.loads(lone[_raw(bundle, 1).name])["session"] == "cpu0"
    assert f"| superseded/cpu0/online/cpu0/{_raw(bundle, 1).name} | cpu0 | 1 |" in (bundle / "report.md").read_text()
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"]["superseded_records"] == 1 and verdict["checked"]["online_records"] == 3


@pytest.mark.parametrize("seq, named", [
    # the calibration run has no partner: no resume sets it aside
    (0, "superseded: superseded/cpu0/online/cpu0/{name} is not an arm run at its place in plan.json online.order"),
    # a run measured once, by the session that still holds it: not measured again
    (1, "superseded: superseded/cpu0/online/cpu0/{name} was not measured again: online/cpu0/{name} is of session cpu0, "
        "not of a session after cpu0 in children.json"),
])
def test_a_forged_superseded_online_run_is_named(bundle, seq, named):
    """Format 15: a copy of a run no resume superseded, put where a resume keeps a lone online run, is named."""
    aside = bundle / "superseded" / "cpu0" / "online" / "cpu0"
    aside.mkdir(parents=True)
    shutil.copy(_raw(bundle, seq), aside / _raw(bundle, seq).name)
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert named.format(name=_raw(bundle, seq).name) in text, text


def test_a_resumed_session_that_completed_with_the_online_track_incomplete_is_named(bundle):
    """What the old resume published: the device's last session completed, an online run still missing."""
    _raw(bundle, 2).unlink()
    edit_json(bundle / "children.json", lambda ch: ch.append({**ch[-1], "session": "cpu0.r1", "log": "cpu0.r1.log"}))
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    assert "online: session cpu0.r1 completed but 2 of 3 online runs are recorded" in "\n".join(audit(bundle)["discrepancies"])


def _republished_with_a_resumed_session(bundle, seqs_in_resume: tuple[int, ...]) -> list[str]:
    """The bundle republished as if a resume's session cpu0.r1 (in children.json, with its job, ceiling and log) had
    measured the online runs ``seqs_in_resume``; the audit's discrepancies."""
    edit_json(bundle / "children.json", lambda ch: ch.append({**ch[-1], "session": "cpu0.r1", "log": "cpu0.r1.log",
                                                             "attempt": 1}))
    for seq in seqs_in_resume:
        edit_json(_raw(bundle, seq), lambda rec: rec.update(session="cpu0.r1"))
    # the resume's log prints its own session's ceiling and plan lines
    log = (bundle / "logs" / "cpu0.log").read_text()
    (bundle / "logs" / "cpu0.r1.log").write_text(log.replace("] session cpu0: ", "] session cpu0.r1: "))
    job = json.loads((bundle / "jobs" / "session-cpu0.json").read_text())
    (bundle / "jobs" / "session-cpu0.r1.json").write_text(json.dumps({**job, "session": "cpu0.r1", "seqs": []}))
    ceiling = json.loads((bundle / "ceilings" / "cpu0.json").read_text())
    (bundle / "ceilings" / "cpu0.r1.json").write_text(json.dumps({**ceiling, "session": "cpu0.r1"}))
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    return audit(bundle)["discrepancies"]


def test_an_online_pair_whose_two_runs_ran_in_two_sessions_is_named(bundle):
    """What the resume of a stop between a pair's two runs published: the first run in the stopped session, the
    second in the resume's (its session in children.json, with its ceiling and log); a pair is two runs back to back
    in one session, so it is named (the auditor passed it)."""
    problems = _republished_with_a_resumed_session(bundle, (2,))
    assert problems == ["online: pair 0 at rate index 0 ran in sessions cpu0 (seq 1), cpu0.r1 (seq 2); a pair's two "
                        "runs are measured back to back in one session"], problems


def test_an_online_run_in_an_earlier_session_than_the_run_before_it_is_named(bundle):
    """The calibration run (seq 0) claims the resume's session while the pair after it claims the first: a later
    session runs only what an earlier one left, so the order is named (the auditor took any listed session)."""
    problems = _republished_with_a_resumed_session(bundle, (0,))
    assert problems == [f"online: seq {seq} ran in session cpu0, before seq 0 in cpu0.r1; a later session runs only "
                        "the online runs an earlier one left" for seq in (1, 2)], problems


def test_a_resume_after_a_calibration_run_that_completed_no_request_names_it_before_serving(bundle):
    """The recorded calibration run completed no request (capacity 0): a resume's session names that, as the first
    session did, before it starts a server (it started one, then failed on 'rate_rps must be > 0, got 0.0')."""
    from loopbench.harness.online import arms

    _only_a_calibration_run_that_completed_no_request(bundle)
    started = []
    job = {**json.loads((bundle / "jobs" / "session-cpu0.json").read_text()), "bundle": str(bundle), "session": "cpu0.r1",
           "seqs": []}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(arms.ServerProcess, "start", lambda self: started.append(self) or (_ for _ in ()).throw(
            AssertionError("a server started")))
        with pytest.raises(RuntimeError, match="the online calibration run completed no request"):
            arms.measure_online(job, lambda line: None, json.loads((bundle / "plan.json").read_text()))
    assert not started and sorted(p.name for p in (bundle / "online" / "cpu0").glob("*.json")) == [_raw(bundle, 0).name]


# ------------------------------------------------------------------ what each online run ran with (format 10)

def _online_records(bundle: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((bundle / "online" / "cpu0").glob("*.json"))]


def _baseline_runs(bundle: Path) -> tuple[dict, dict]:
    """The calibration run (seq 0, the baseline arm's) and the baseline's arm run at the one rate."""
    recs = _online_records(bundle)
    return recs[0], next(r for r in recs[1:] if r["arm"] == recs[0]["arm"])


def test_every_online_record_holds_what_its_servers_engine_ran_with(honest_online):
    plan = json.loads((honest_online / "plan.json").read_text())
    recs = _online_records(honest_online)
    for rec in recs:
        settings = rec["engine_settings"]
        assert settings["kv_layout"] == rec["arm_config"]["kv_layout"]
        assert settings["max_num_seqs"] == plan["online"]["max_num_seqs"]
        assert settings["exit_policy"] == plan["config"]["exit"]["policy"] and settings["schedule_sha256"] is None
        assert "engine_settings" not in rec["server"]["health"]    # one copy, the record's own
    assert audit(honest_online)["checked"]["online_engine_settings"] == len(recs) == 3
    report = (honest_online / "report.md").read_text().split("\n")
    at = report.index("### Runtime settings of the online runs")
    assert report[at + 2] == contract.FORMAT["online"]["report"]["settings_text"]
    assert "| setting | alias_prefix | native |" in report[at:] and "| kv_layout | alias | native |" in report[at:]
    plot = report.index("![online latency](online/latency.png)")    # the online section's last line
    assert report[plot - 2].startswith("Shared by every arm: ") and "exit_policy=ouro" in report[plot - 2]


def test_an_online_record_without_engine_settings_is_named(bundle):
    edit_json(_raw(bundle, 1), lambda rec: rec.pop("engine_settings"))
    rewrite_manifest(bundle)
    rec = json.loads(_raw(bundle, 1).read_text())
    assert f"engine_settings: online record cpu0 seq 1 ({rec['arm']}, arm run, session cpu0) has no engine_settings" \
        in failed(bundle)


def test_an_online_run_whose_settings_differ_from_its_arms_other_runs_is_named(bundle):
    """A changed setting and one the calibration run lacks, each named with its key against the arm's first run."""
    calibration, run = _baseline_runs(bundle)
    lines = forge_settings(bundle, _raw(bundle, run["seq"]), batch_invariant=False, extra=1).splitlines()
    at = f"engine_settings: online record cpu0 seq {run['seq']} ({run['arm']}, arm run, session cpu0): "
    alike = "an online run of the same arm in the same session"
    assert [f for f in lines if f.startswith("engine_settings:")] == [
        f"{at}engine_settings.batch_invariant is false, where seq 0, {alike}, holds true",
        f"{at}engine_settings.extra is 1, where seq 0, {alike}, holds missing"]


def test_an_online_setting_that_contradicts_its_record_is_named(bundle):
    calibration, run = _baseline_runs(bundle)
    for rec in (calibration, run):    # every run of the arm alike, so only the record check can name them
        edit_json(_raw(bundle, rec["seq"]), lambda r: r["engine_settings"].update(max_num_seqs=999, tile_size=64))
    rewrite_manifest(bundle)
    lines = [f for f in failed(bundle).splitlines() if f.startswith("engine_settings:")]
    assert len(lines) == 4 and f"seq {run['seq']} ({run['arm']}, arm run, session cpu0): " in lines[3]
    batch, tile_size = calibration["engine_settings"]["max_num_seqs"], calibration["arm_config"]["tile_size"]
    assert f"engine_settings.max_num_seqs is 999, where the record says {batch}" in lines[0]
    assert f"engine_settings.tile_size is 64, where the record says {tile_size}" in lines[1]


def test_a_forged_online_settings_line_is_named(bundle):
    def forge(lines):   # the online runs' row, not the measured runs' one of the Runtime settings section
        at = lines.index("### Runtime settings of the online runs")
        return lines[:at] + [line.replace("| kv_layout | alias | native |", "| kv_layout | alias | alias |")
                             for line in lines[at:]]
    edit_report(bundle, forge)
    rewrite_manifest(bundle)
    assert "(## Online serving) reads '| kv_layout | alias | alias |'" in failed(bundle)


def test_a_format_9_online_bundle_has_no_online_settings_and_audits_as_before(numpy_trace_online, tmp_path):
    """A format-9 bundle's trace is numpy's (online.trace_rule_before), as its writer drew it."""
    bundle = Path(shutil.copytree(numpy_trace_online, tmp_path / numpy_trace_online.name))
    strip_version_10(bundle)
    assert "### Runtime settings of the online runs" not in (bundle / "report.md").read_text()
    passes_as_version(bundle, 9)
    edit_json(_raw(bundle, 0), lambda rec: rec.update(engine_settings=None))   # format 10 content
    rewrite_manifest(bundle)
    assert "engine_settings: online record cpu0 seq 0 (native, calibration run, session cpu0) holds engine_settings, " \
           "format 10 content in a format 9 bundle" in failed(bundle)


@pytest.mark.parametrize("forge, named", [
    (lambda rec: [rec], "a JSON list, not an object"),
    (lambda rec: "x", "a JSON str, not an object"),
    (lambda rec: rec["requests"].__setitem__(0, "x") or rec, "requests[0] is 'x', not an object"),
    (lambda rec: rec["requests"][1].pop("end_s") and rec, "requests[1].end_s is missing"),   # not only the first
])
def test_an_online_record_or_request_that_is_malformed_is_named_not_a_crash(bundle, forge, named):
    """A record or request that is no JSON object, or a later request missing a field, is named with its file; it
    did not stop the whole online check with the exception's text ("could not be checked: TypeError: ...")."""
    path = _raw(bundle, 1)
    path.write_text(json.dumps(forge(json.loads(path.read_text()))))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert f"online: {path.relative_to(bundle).as_posix()}: {named}" in text and "could not be checked" not in text, text


def _candidate_run(bundle: Path) -> dict:
    """The candidate arm's one online run (at the one rate, pair 0)."""
    return next(r for r in _online_records(bundle) if r["position"] == "candidate")


def test_an_online_run_that_ran_the_baselines_config_under_the_candidates_name_is_named(bundle):
    """The candidate's online run forged as native (its arm_config and engine_settings alike, so the settings
    agree with the record): the record's arm_config is held to the plan's arm, as a raw arm record's is."""
    run = _candidate_run(bundle)
    plan = json.loads((bundle / "plan.json").read_text())
    baseline = plan["config"]["arms"][plan["online"]["baseline"]]

    def forge(rec):
        rec["arm_config"] = dict(baseline)
        rec["engine_settings"].update({k: v for k, v in baseline.items() if k in rec["engine_settings"]})
    edit_json(_raw(bundle, run["seq"]), forge)
    rewrite_manifest(bundle)
    text = failed(bundle)
    rel = _raw(bundle, run["seq"]).relative_to(bundle).as_posix()
    assert f"online: {rel}: arm_config.kv_layout is 'native', plan.json config.arms.{run['arm']} says 'alias'" \
        in text, text


def test_an_online_run_claiming_another_session_is_named(bundle):
    """A run moved out of its arm's group by its session (so its differing settings met no other run): the online
    track runs in its device's sessions (children.json), the first one's id the device's name."""
    calibration, run = _baseline_runs(bundle)
    edit_json(_raw(bundle, run["seq"]), lambda rec: rec.update(session="cpu0-r1"))
    text = forge_settings(bundle, _raw(bundle, run["seq"]), batch_invariant=False)
    rel = _raw(bundle, run["seq"]).relative_to(bundle).as_posix()
    assert f"online: {rel}: session is 'cpu0-r1', not a session of device 'cpu0' in children.json (cpu0)" in text, text


def test_online_settings_nulled_where_the_same_engines_measured_runs_report_settings_are_named(bundle):
    """null says an engine without settings(); every online record nulled (the report then says no run's engine
    reported any) while the measured runs of the same engine, in the same bundle, report theirs: each named."""
    for path in sorted((bundle / "online" / "cpu0").glob("*.json")):
        edit_json(path, lambda rec: rec.update(engine_settings=None))
    rewrite_manifest(bundle)
    lines = [f for f in failed(bundle).splitlines() if f.startswith("engine_settings:")]
    raw = json.loads(next((bundle / "raw" / "cpu0").glob("00000-*.json")).read_text())
    assert len(lines) == 3 and lines[0] == (
        "engine_settings: online record cpu0 seq 0 (native, calibration run, session cpu0): engine_settings is null, "
        f"where record cpu0 seq 0 ({raw['arm']}, {raw['point']}, session cpu0), of the same engine "
        f"({raw['arm_config']['engine']}), holds an object"), lines


def test_online_runs_whose_settings_say_they_replayed_the_frozen_reference_are_named(bundle):
    """A server runs its own exits (plan.json config.exit); every online run's settings forged to name the point's
    frozen schedule, which would make the served-token check against that reference hold by replay: each named."""
    plan = json.loads((bundle / "plan.json").read_text())
    sha = next(p["reference"]["sha256"] for p in plan["points"] if p["key"] == plan["online"]["point"])
    for path in sorted((bundle / "online" / "cpu0").glob("*.json")):
        edit_json(path, lambda rec: rec["engine_settings"].update(schedule_sha256=sha))
    rewrite_manifest(bundle)
    lines = [f for f in failed(bundle).splitlines() if f.startswith("engine_settings:")]
    assert len(lines) == 3 and lines[0] == (
        "engine_settings: online record cpu0 seq 0 (native, calibration run, session cpu0): engine_settings."
        f"schedule_sha256 is {sha}, where an online run replays no schedule: its server runs the plan's exit "
        "policy"), lines


# ------------------------------------------- what every server ran with by the plan, on the committed GPU bundles

COMMITTED_ONLINE = {"2026-12-01-ouro-1.4b-online-69b8d26": 5, "2026-12-06-ouro-1.4b-online-e87ddf11": 10}


def _committed(name: str, tmp_path: Path) -> Path:
    """A copy of a committed bundle (auditing it writes its audit.json, which the tree's copy must keep)."""
    src = REPO / "results" / name
    if not src.is_dir():
        pytest.skip(f"results/{name} is not checked out")
    return Path(shutil.copytree(src, tmp_path / name))


@pytest.mark.parametrize("name", sorted(COMMITTED_ONLINE))
def test_the_committed_online_bundles_pass_with_their_servers_held_to_the_plan(name, tmp_path):
    """Format 10's online records name the plan's exit policy and max_model_len; format 5's hold no settings."""
    bundle = _committed(name, tmp_path)
    assert json.loads((bundle / "manifest.json").read_text())["format_version"] == COMMITTED_ONLINE[name]
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    records = [json.loads(p.read_text()) for p in sorted((bundle / "online" / "gpu0").glob("*.json"))]
    if COMMITTED_ONLINE[name] < 10:
        assert "online_engine_settings" not in verdict["checked"] and not any("engine_settings" in r for r in records)
        return
    plan = json.loads((bundle / "plan.json").read_text())
    assert verdict["checked"]["online_engine_settings"] == len(records) == 3
    assert {(r["engine_settings"]["exit_policy"], r["engine_settings"]["max_model_len"]) for r in records} == {
        (plan["config"]["exit"]["policy"], plan["max_model_len"])}


@pytest.mark.parametrize("key, forged, stated", [
    ("exit_policy", "ouro", "plan.json config.exit.policy"),
    ("max_model_len", 512, "plan.json max_model_len")])
def test_online_servers_that_ran_another_exit_policy_or_max_model_len_than_the_plan_are_named(key, forged, stated,
                                                                                               tmp_path):
    """The committed format-10 GPU bundle with every online record's setting forged alike (so the runs of an arm
    still agree) and the Online section's shared settings line rewritten to match: only the plan names each
    record."""
    bundle = _committed("2026-12-06-ouro-1.4b-online-e87ddf11", tmp_path)
    plan = json.loads((bundle / "plan.json").read_text())
    planned = {"exit_policy": plan["config"]["exit"]["policy"], "max_model_len": plan["max_model_len"]}[key]
    paths = sorted((bundle / "online" / "gpu0").glob("*.json"))
    for path in paths:
        edit_json(path, lambda rec: rec["engine_settings"].update({key: forged}))

    def forge(lines):   # the online runs' shared line, not the measured runs' one of the Runtime settings section
        at = lines.index("### Runtime settings of the online runs")
        return lines[:at] + [line.replace(f"{key}={planned},", f"{key}={forged},") for line in lines[at:]]
    edit_report(bundle, forge)
    rewrite_manifest(bundle)
    expected = []
    for path in paths:
        rec = json.loads(path.read_text())
        expected.append(f"engine_settings: online record gpu0 seq {rec['seq']} ({rec['arm']}, {rec['kind']} run, "
                        f"session gpu0): engine_settings.{key} is {json.dumps(forged)}, where {stated} says "
                        f"{json.dumps(planned)}")
    assert failed(bundle).splitlines() == expected


def test_a_timed_out_request_counts_in_the_percentiles_as_slower_than_every_served_one(bundle):
    """Censoring: a request the run's bound cut off (no first token) is not dropped from the TTFT and TPOT
    percentiles, where it would make the run with more timeouts look faster; it counts as slower than every served
    request, so of 6 requests with 1 failed p99 (rank 4.95 of 0..5) reaches it: n/a, in the writer's summary and in
    the auditor's re-derivation alike. The old figure (p99 over the 5 served requests) is named."""
    rec = json.loads(_raw(bundle, 1).read_text())
    i = max(range(len(rec["requests"])), key=lambda j: metrics.request_latencies(rec["requests"][j])["ttft_s"])
    edit_json(_raw(bundle, 1), lambda r: r["requests"][i].update(token_times_s=[], token_ids=[], finish_reason=None,
                                                                  error=TIMEOUT_ERROR))
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    summary = json.loads((bundle / "online" / "summary.json").read_text())
    run = summary["runs"][1]
    assert run["failed"] == 1 and run["p99_ttft_s"] is None and run["p99_tpot_s"] is None
    assert run["p50_ttft_s"] is not None and run["p99_itl_s"] is not None
    assert summary["rates"][0]["figures"]["p99_ttft_s"]["ratio_median"] is None   # its pair's, not dropped
    verdict = audit(bundle)
    assert not verdict["discrepancies"], verdict["discrepancies"]
    served = [metrics.request_latencies(q)["ttft_s"] for q in json.loads(_raw(bundle, 1).read_text())["requests"]]
    dropped = metrics.percentile([t for t in served if t is not None], 99)
    edit_json(bundle / "online" / "summary.json", lambda s: s["runs"][1].update(p99_ttft_s=dropped))
    rewrite_manifest(bundle)
    assert f"online/summary.json: runs[1].p99_ttft_s is {dropped!r}, re-derived from the raw timestamps None" \
        in failed(bundle)


def test_a_format_12_bundle_keeps_its_percentiles_over_the_completed_requests(bundle):
    """Format 13 counts failed requests in the TTFT and TPOT percentiles (online.censored_since); the auditor re-derives
    an older bundle by its own rule: the percentiles over the completed requests, the medians over the pairs with a
    value. Same records, two versions, two answers."""
    from loopbench.audit import check_online
    from loopbench.audit.context import Audit

    rec = json.loads(_raw(bundle, 1).read_text())
    i = max(range(len(rec["requests"])), key=lambda j: metrics.request_latencies(rec["requests"][j])["ttft_s"])
    edit_json(_raw(bundle, 1), lambda r: r["requests"][i].update(token_times_s=[], token_ids=[], finish_reason=None,
                                                                  error=TIMEOUT_ERROR))
    plan = json.loads((bundle / "plan.json").read_text())
    records = [json.loads(p.read_text()) for p in sorted((bundle / "online" / "cpu0").glob("*.json"))]
    served = [metrics.request_latencies(q)["ttft_s"] for q in json.loads(_raw(bundle, 1).read_text())["requests"]]
    dropped = metrics.percentile([t for t in served if t is not None], 99)
    got = {}
    for version in (12, 13):
        ctx = Audit(bundle)
        ctx.version = version
        got[version] = check_online.derived(ctx, plan, records)[0]["runs"][1]["p99_ttft_s"]
    assert contract.FORMAT["online"]["censored_since"] == 13
    assert got == {12: dropped, 13: None}, got


def _forged_latency_plot(bundle):
    """The harness's plot of TTFTs and gaps 40% lower than served (every token 40% nearer its planned arrival)."""
    from loopbench.harness.online.report import plot_latency

    records = online_evidence.load_online_records(bundle)
    for q in (q for rec in records for q in rec["requests"]):
        q["token_times_s"] = [q["planned_s"] + 0.6 * (t - q["planned_s"]) for t in q["token_times_s"]]
    plot_latency(records, json.loads((bundle / "online" / "summary.json").read_text()),
                 bundle / "online" / "latency.png")


def _latency_not_a_png(bundle):
    (bundle / "online" / "latency.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")


@pytest.mark.parametrize("forge", [_forged_latency_plot, _latency_not_a_png])
def test_a_forged_latency_plot_is_named(bundle, forge):
    """online/latency.png, shown in the Online section, is the plot of the raw records' latencies and the re-derived
    SLO: a plot of other latencies, or a file that is no PNG, is named even with the manifest rewritten."""
    before = (bundle / "online" / "latency.png").read_bytes()
    forge(bundle)
    assert (bundle / "online" / "latency.png").read_bytes() != before
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "online/latency.png: is not " in text, text
    assert [d for d in text.split("\n") if not d.startswith("online/latency.png: ")] == []   # nothing else changed


def test_a_latency_plot_under_another_matplotlib_is_counted_not_compared(bundle):
    """As pair_ratios.png (test_plot.py): under another recorded matplotlib neither figure is compared, both are
    counted; a latency file that is no PNG is still named."""
    edit_json(bundle / "environment.json", lambda env: env["packages"].update(matplotlib="0.0-other"))
    _forged_latency_plot(bundle)
    rewrite_manifest(bundle)
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"].get("plot_not_compared_other_matplotlib") == 2 and "plot_pixels" not in verdict["checked"]
    _latency_not_a_png(bundle)
    rewrite_manifest(bundle)
    assert "online/latency.png: is not a PNG" in failed(bundle)


def _fail_request(q):
    q.update(token_times_s=[], token_ids=[], finish_reason=None, error=TIMEOUT_ERROR)


@pytest.mark.parametrize("case", ["complete", "incomplete", "declared slo", "no slo", "a failed request",
                                  "one chunk", "nothing completed"])
def test_writer_and_auditor_draw_one_latency_figure(honest_online, tmp_path, case):
    """The auditor's drawing (audit/check_plot.py render_latency) is the writer's (harness/online/report.py
    plot_latency), byte for byte, from the same records and summary: also for an incomplete track, a declared SLO
    or none, a failed request, a request whose tokens came in one chunk (gaps of 0 on the log axis), and runs that
    completed nothing."""
    from loopbench.audit.check_plot import render_latency
    from loopbench.harness.online.report import plot_latency

    records = online_evidence.load_online_records(honest_online)
    summary = json.loads((honest_online / "online" / "summary.json").read_text())
    if case == "incomplete":
        records, summary["status"] = records[:-1], "incomplete"
    elif case == "declared slo":
        summary["slo"].update(source="declared", ttft_s=summary["slo"]["ttft_s"] / 3, tpot_s=summary["slo"]["tpot_s"] * 2)
    elif case == "no slo":
        summary["slo"] = {k: v for k, v in summary["slo"].items() if k not in ("ttft_s", "tpot_s")}
    elif case == "a failed request":
        _fail_request(records[1]["requests"][0])
    elif case == "one chunk":
        q = records[-1]["requests"][-1]
        q["token_times_s"] = [q["token_times_s"][0]] * len(q["token_times_s"])
    elif case == "nothing completed":
        summary["slo"] = {k: v for k, v in summary["slo"].items() if k not in ("ttft_s", "tpot_s")}
        for q in (q for rec in records for q in rec["requests"]):
            _fail_request(q)
    plot_latency(records, summary, tmp_path / "writer.png")
    assert render_latency(records, summary) == (tmp_path / "writer.png").read_bytes()


def _shift_tokens(q: dict, by_s: float) -> None:
    q["token_times_s"] = [t + by_s for t in q["token_times_s"]]


@pytest.mark.parametrize("forge, named", [
    # every token of the request before it was planned: a negative TTFT
    (lambda q: _shift_tokens(q, -(q["token_times_s"][0] - q["planned_s"]) - 0.01),
     "its first token at {first} s comes before its planned arrival (planned_s {planned})"),
    # the tokens' times out of order: negative inter-token gaps
    (lambda q: q.update(token_times_s=q["token_times_s"][::-1]), "token_times_s go back in time at token 1"),
    # fewer times than tokens: the ITL and TPOT of a few tokens, the throughput of all
    (lambda q: q.update(token_times_s=q["token_times_s"][:4]), "4 token_times_s for {tokens} token_ids"),
    # the request ends before its last token: an end-to-end latency shorter than its TTFT
    (lambda q: q.update(end_s=q["planned_s"]), "its last token at {last} s comes after its end_s {end}"),
    # its first token before it was sent
    (lambda q: q.update(sent_s=q["token_times_s"][0] + 0.01), "its first token at {first} s comes before it was sent"),
])
def test_online_request_timestamps_that_contradict_each_other_are_named(bundle, forge, named):
    """Every figure is re-derived from the raw timestamps, so a raw record forged and the bundle republished from it
    agrees with itself; but one run's clock (time.perf_counter) orders a request's times, so a request planned, sent,
    streamed and ended out of that order never ran. Each such forgery passed the audit."""
    path = _raw(bundle, 1)
    rec = json.loads(path.read_text())
    q = rec["requests"][2]
    tokens = len(q["token_times_s"])
    forge(q)
    path.write_text(json.dumps(rec))
    want = named.format(first=q["token_times_s"][0], planned=q["planned_s"], last=q["token_times_s"][-1],
                        end=q["end_s"], tokens=tokens)
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    problems = audit(bundle)["discrepancies"]
    assert any(p.startswith("online: record seq 1 request 2: ") and want in p for p in problems), problems


@pytest.mark.parametrize("seq, key, forged", [
    (0, "rate_rps", 5.0),              # the closed-loop calibration run shown as an open-loop run at 5 requests/s
    (0, "capacity_rps", 5.0),
    (0, "concurrency", 1),
    (1, "mode", "closed"),
    (1, "concurrency", 3),
    (1, "warmup_requests", 0),
    (1, "max_duration_s", 1e9),
    (1, "point", "B2C2"),
])
def test_an_online_record_whose_run_is_not_the_one_the_plan_sets_is_named(bundle, seq, key, forged):
    """A record's point, mode, concurrency, warmup and time bound are the plan's for its kind of run (a calibration run
    has no capacity or rate to scale by); a record forged to claim others, the bundle republished from it, passed."""
    edit_json(_raw(bundle, seq), lambda rec: rec.update({key: forged}))
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    rel = _raw(bundle, seq).relative_to(bundle).as_posix()
    problems = audit(bundle)["discrepancies"]
    assert any(p.startswith(f"online: {rel}: {key} is {forged!r}, plan.json online") for p in problems), problems


def _slo_declared(on: dict) -> None:
    on["slo"] = {"source": "declared", "ttft_s": 10.0, "tpot_s": 10.0, "factor": None}


@pytest.mark.parametrize("forge, named", [
    # every request then meets the SLO: goodput = request rate, while the config derives it from the calibration run
    (_slo_declared, "online.slo.source is 'declared', the config gives 'calibration'"),
    (lambda on: on.update(warmup_requests=0), "online.warmup_requests is 0, the config gives 2"),
    (lambda on: on.update(max_duration_s=1e9), "online.max_duration_s is 1000000000.0, the config gives 120.0"),
    (lambda on: on.update(health_timeout_s=1.0), "online.health_timeout_s is 1.0, the config gives 120.0"),
    (lambda on: on["calibration"].update(concurrency=1), "online.calibration.concurrency is 1, the config gives 4"),
])
def test_a_plans_online_track_that_is_not_the_configs_is_named(bundle, forge, named):
    """plan.json online is what the run was asked for, derived from config.online (hashed in config_sha256): a plan
    forged to say another SLO, warmup, bound or calibration, the bundle republished from it, passed the audit."""
    plan = json.loads((bundle / "plan.json").read_text())
    forge(plan["online"])
    for path in (bundle / "online" / "cpu0").glob("*.json"):    # the records agree with the forged plan
        edit_json(path, lambda rec: rec.update({k: plan["online"][k] for k in ("warmup_requests", "max_duration_s")},
                                               **({"concurrency": plan["online"]["calibration"]["concurrency"]}
                                                  if rec["kind"] == "calibration" else {})))
    (bundle / "plan.json").write_text(json.dumps(plan, indent=1))
    children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("children", "environment"))
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    problems = audit(bundle)["discrepancies"]
    assert any(p == f"online: plan.json {named}" for p in problems), problems


def test_a_derived_slo_by_another_factor_than_the_contracts_is_named(bundle):
    """A forger's plan with its derived SLO at 3 x the calibration run's p99s, every online figure, table cell and
    report line republished from it by the writer: the auditor derives the SLO by the contract's factor
    (online.slo_factor) from the calibration run's raw records, not by the factor the bundle claims."""
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    assert plan["online"]["slo"] == {"source": "calibration", "ttft_s": None, "tpot_s": None,
                                     "factor": contract.FORMAT["online"]["slo_factor"]} == {
        "source": "calibration", "ttft_s": None, "tpot_s": None, "factor": metrics.SLO_FACTOR}
    plan["online"]["slo"]["factor"] = 3.0
    (bundle / "plan.json").write_text(json.dumps(plan, indent=1))
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    summary = json.loads((bundle / "online" / "summary.json").read_text())
    calibration = summary["runs"][0]
    assert summary["slo"]["ttft_s"] == 3.0 * calibration["p99_ttft_s"]
    text = failed(bundle)
    assert "online: plan.json online.slo.factor is 3.0; the contract derives an SLO as online.slo_factor = 1.5 x the " \
           "calibration run's p99 TTFT and TPOT" in text
    assert f"online/summary.json: slo.ttft_s is {summary['slo']['ttft_s']!r}, re-derived from the raw timestamps " \
           f"{1.5 * calibration['p99_ttft_s']!r}" in text


class _AnotherNumpysGenerator:
    """numpy.random.default_rng as another numpy version might give it: the bit generator's stream the same, its
    exponential draws not (numpy promises the former across versions, not the latter)."""

    def __init__(self, seed=None):
        self._gen = _DEFAULT_RNG(seed)

    def exponential(self, *args, **kwargs):
        return self._gen.exponential(*args, **kwargs) * (1 + 1e-6)

    def __getattr__(self, name):
        return getattr(self._gen, name)


_DEFAULT_RNG = np.random.default_rng


def test_the_online_trace_is_re_derived_without_numpys_generator(bundle, monkeypatch):
    """Format 14: the auditor re-derives the trace by the contract's SHA-256 rule, so an auditor on a numpy whose
    exponential draws differ passes the sound bundle (format 13's numpy rule named it)."""
    monkeypatch.setattr(np.random, "default_rng", _AnotherNumpysGenerator)
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert json.loads((bundle / "manifest.json").read_text())["format_version"] == contract.VERSION >= 14


def _forge_trace(bundle: Path, forge) -> None:
    """plan.json's online trace edited by ``forge`` (a list of arrivals in place), its sha256 re-hashed."""
    def edit(plan):
        trace = plan["online"]["trace"]
        forge(trace["unit_arrivals_s"])
        trace["sha256"] = hashlib.sha256(json.dumps(trace["unit_arrivals_s"]).encode()).hexdigest()
    edit_json(bundle / "plan.json", edit)
    rewrite_manifest(bundle)


def test_a_trace_that_is_not_its_seeds_is_named(bundle):
    _forge_trace(bundle, lambda unit: unit.__setitem__(3, unit[3] + 0.5))
    assert "online: plan.json online.trace.unit_arrivals_s is not the seeded Poisson trace of its seed (the " \
           "contract's online.trace_rule)" in failed(bundle)


def test_a_format_13_bundle_keeps_numpys_trace_and_neither_rule_passes_for_the_other(bundle, numpy_trace_online,
                                                                                       tmp_path):
    """A format-13 bundle's trace is numpy's (online.trace_rule_before) and audits as before; the same bundle
    claimed as format 14 is named by online.trace_rule, and a format-14 trace claimed as format 13 by the numpy
    rule, so neither claim passes off the other's trace."""
    older = Path(shutil.copytree(numpy_trace_online, tmp_path / "older" / numpy_trace_online.name))
    passes_as_version(older, 13)
    edit_json(older / "manifest.json", lambda m: m.update(format_version=14))
    rewrite_manifest(older)
    assert "online: plan.json online.trace.unit_arrivals_s is not the seeded Poisson trace of its seed (the " \
           "contract's online.trace_rule)" in failed(older)
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=13))
    rewrite_manifest(bundle)
    assert "online: plan.json online.trace.unit_arrivals_s is not the seeded Poisson trace of its seed (the " \
           "contract's online.trace_rule_before)" in failed(bundle)
