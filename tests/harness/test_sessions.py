"""Independent sessions (``sessions: k``, issue 12): the plan's order of k restarts, session ids, the
config keys, and a run whose sessions are killed and resumed restart by restart."""
import json
import math
from collections import Counter

import pytest

from loopbench.audit.auditor import audit
from loopbench.harness import conf, controller, plan as plan_mod

MINI = ["name=ses", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=9", "workload.prompt_lens=null",
        "workload.output_len=3", "pairs=2", "comparisons=[{baseline:native,candidate:alias_prefix}]",
        "executor.poll_s=0.1"]


def test_one_session_plans_the_order_of_a_bundle_before_sessions():
    one = conf.validate(conf.compose("cpu-smoke", ["pairs=5"]))
    two = conf.validate(conf.compose("cpu-smoke", ["pairs=5", "sessions=2"]))
    first, both = plan_mod.measurement_order(one), plan_mod.measurement_order(two)
    assert [o.to_dict() for o in both[:len(first)]] == [o.to_dict() for o in first]
    assert len(both) == 2 * len(first) and [o.seq for o in both] == list(range(len(both)))
    later = both[len(first):]
    assert sorted({o.pair for o in later}) == list(range(5, 10))   # pair indices run on over restarts
    firsts = Counter((o.point, o.comparison, o.position) for o in later if o.slot == 0)
    assert set(firsts.values()) == {math.ceil(5 / 2), 5 // 2}     # the restart balances its own pairs
    assert [(o.position, o.arm) for o in later] != [(o.position, o.arm) for o in first]   # its own seeds
    seqs = plan_mod.restart_seqs([o.to_dict() for o in both], 5, 2)
    assert seqs == [list(range(len(first))), list(range(len(first), len(both)))]


def test_session_ids_name_restart_and_resume():
    assert [controller.session_id("cpu0", a, r) for a, r in ((0, 0), (0, 1), (1, 0), (2, 3))] == \
        ["cpu0", "cpu0.s1", "cpu0.r1", "cpu0.s3.r2"]


@pytest.mark.parametrize("override, named", [
    ("sessions=0", "sessions must be a positive integer"),
    ("evidence.alpha=1.5", "evidence.alpha must be in (0, 1)"),
    ("evidence.power=0", "evidence.power must be in (0, 1)"),
    ("evidence.noise_sigma=-0.1", "evidence.noise_sigma must be > 0"),
])
def test_bad_evidence_keys_are_refused_by_name(override, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        conf.validate(conf.compose("cpu-smoke", [override]))


def test_detectable_effect_is_planned_with_its_noise_source():
    declared = plan_mod.detectable_effect(conf.validate(conf.compose("cpu-smoke", ["evidence.noise_sigma=0.02",
                                                                                   "pairs=7", "sessions=2"])))
    assert (declared["n_pairs"], declared["noise"]["source"]) == (14, "declared")
    assert declared["mde_relative"] == pytest.approx(math.expm1(2.801585 * 0.02 / math.sqrt(14)), rel=1e-6)
    unknown = plan_mod.detectable_effect(conf.validate(conf.compose("cpu-smoke", [])))
    assert unknown["noise"]["source"] == "unknown" and unknown["mde_relative"] is None


@pytest.mark.slow      # about 22 s on 2 cores
def test_killed_sessions_are_resumed_restart_by_restart_and_audit_pass(tmp_path):
    """sessions=2, pairs=2, one comparison: 4 arms per restart; every session kills itself after 3 arms.
    Run 1: cpu0 killed after seqs 0-2, restart 1 not started. Resume 1: cpu0.r1 measures 2-3 (the lone
    arm again), cpu0.s1.r1 is killed after 4-6. Resume 2: cpu0.s1.r2 measures 6-7. Complete. The lone arms' first
    records (seq 2 by cpu0, seq 6 by cpu0.s1.r1) are kept as superseded, out of every figure."""
    over = MINI + ["sessions=2", "fault.kill_after_arms=3", f"results_dir={tmp_path / 'r'}", f"cache_dir={tmp_path / 'c'}"]
    first = controller.run(conf.compose("cpu-smoke", over))
    assert first.summary["status"] == "incomplete"
    assert [c["session"] for c in first.summary["children"]] == ["reference", "cpu0"]
    bundle = first.bundle
    lone = {}
    for _ in range(2):
        last = max((bundle / "raw" / "cpu0").glob("*.json"))
        lone[last.name] = last.read_bytes()
        result = controller.run(conf.compose("cpu-smoke", over + [f"resume={bundle}"]))
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    children = json.loads((bundle / "children.json").read_text())
    assert [(c["session"], c["state"]) for c in children] == [
        ("reference", "completed"), ("cpu0", "killed"), ("cpu0.r1", "completed"), ("cpu0.s1.r1", "killed"),
        ("cpu0.s1.r2", "completed")]
    recs = sorted((json.loads(p.read_text()) for p in (bundle / "raw" / "cpu0").glob("*.json")), key=lambda r: r["seq"])
    assert [r["session"] for r in recs] == ["cpu0"] * 2 + ["cpu0.r1"] * 2 + ["cpu0.s1.r1"] * 2 + ["cpu0.s1.r2"] * 2
    assert json.loads((bundle / "jobs" / "session-cpu0.s1.r1.json").read_text())["seqs"] == [4, 5, 6, 7]
    assert result.summary["results"][0]["evidence"]["session_pairs"] == [2, 2]
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    aside = {p.relative_to(bundle).as_posix(): p.read_bytes() for p in (bundle / "superseded").rglob("*") if p.is_file()}
    names = sorted(lone)
    assert aside == {f"superseded/cpu0/raw/cpu0/{names[0]}": lone[names[0]],
                     f"superseded/cpu0.s1.r1/raw/cpu0/{names[1]}": lone[names[1]]}
    assert names[0].startswith("00002-") and names[1].startswith("00006-")
    assert verdict["checked"]["superseded_records"] == 2 and result.summary["counts"]["arms_recorded"] == 8
    assert "2 runs were measured and then superseded by a resume" in (bundle / "report.md").read_text()


@pytest.mark.slow      # about 15 s on 2 cores
def test_a_pair_interrupted_twice_keeps_both_of_its_lone_records(tmp_path):
    """pairs=1, every session kills itself after its first arm: run 1's cpu0 records seq 0 and is killed, each resume
    sets that lone record aside and measures the pair again, to be killed after seq 0 again. Both superseded records
    of the one pair are kept, each in its own session's folder (the second would have overwritten the first at one
    path), and the bundle audits incomplete (its last lone arm is the resume's to measure), with no discrepancy."""
    over = [o for o in MINI if not o.startswith("pairs=")] + ["pairs=1", "fault.kill_after_arms=1",
                                                             f"results_dir={tmp_path / 'r'}", f"cache_dir={tmp_path / 'c'}"]
    bundle = controller.run(conf.compose("cpu-smoke", over)).bundle
    (path,) = (bundle / "raw" / "cpu0").glob("*.json")
    measured = []
    for _ in range(2):
        measured.append(path.read_bytes())
        result = controller.run(conf.compose("cpu-smoke", over + [f"resume={bundle}"]))
    assert result.summary["status"] == "incomplete"
    assert [json.loads(m)["session"] for m in measured] == ["cpu0", "cpu0.r1"]
    assert measured[0] != measured[1]
    assert (bundle / "superseded" / "cpu0" / "raw" / "cpu0" / path.name).read_bytes() == measured[0]
    assert (bundle / "superseded" / "cpu0.r1" / "raw" / "cpu0" / path.name).read_bytes() == measured[1]
    assert json.loads(path.read_text())["session"] == "cpu0.r2"
    report = (bundle / "report.md").read_text()
    rows, arm = [line for line in report.splitlines() if line.startswith("| superseded/")], json.loads(measured[0])["arm"]
    assert rows == [f"| superseded/cpu0/raw/cpu0/{path.name} | cpu0 | 0 | {arm} |",
                    f"| superseded/cpu0.r1/raw/cpu0/{path.name} | cpu0.r1 | 0 | {arm} |"], rows
    verdict = audit(bundle)
    assert verdict["status"] == "incomplete" and verdict["discrepancies"] == []
    assert verdict["checked"]["superseded_records"] == 2
