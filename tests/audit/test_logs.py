"""A session's log (logs/<session>.log) prints each arm it measured, with the elapsed_s and tokens/s it wrote
into the arm's record (documents.log.arm_line): a record whose figures were changed after the run, the log left
as it was, is named, and so is a log line changed or removed to hide it."""
import hashlib
import json
import shutil

import pytest

from loopbench.audit.values import canonical
from loopbench.harness import conf, controller, evidence
from loopbench.harness.fileio import canonical_json, sha256_bytes
from tests.audit.tamper import edit_json, failed, forge_elapsed, raw, republish, rewrite_manifest


def _log_lines(bundle):
    path = bundle / "logs" / "cpu0.log"
    return path, path.read_text().split("\n")


def _arm_line_index(lines, rec) -> int:
    key = evidence.FORMAT["documents"]["log"]["arm_line_key"].format(**rec) + ": "
    return next(i for i, line in enumerate(lines) if line[11:].startswith(key))


def test_forged_elapsed_is_named_against_the_sessions_log(bundle):
    """A forger who shortens a candidate run and re-derives tables, summary, report, plot and manifest with the
    harness: every figure agrees with the records, and only the log the session printed at the time does not."""
    rec = forge_elapsed(bundle, 5, lambda r: r["measured"].update(elapsed_s=r["measured"]["elapsed_s"] * 0.9))
    text = failed(bundle)
    named = [d for d in text.split("\n") if d.startswith("logs: logs/cpu0.log line ")]
    assert len(named) == 1, text
    assert f"; record cpu0 seq 5 ({rec['arm']}) gives" in named[0]
    assert f"{rec['measured']['elapsed_s']:.4f}s" in named[0].split("gives")[1]   # the record's figure, not the log's


def test_edited_arm_line_is_named(bundle):
    path, lines = _log_lines(bundle)
    rec = json.loads(raw(bundle, 2).read_text())
    i = _arm_line_index(lines, rec)
    lines[i] = lines[i].replace(f"{rec['tokens_per_s']:.1f} tok/s", f"{rec['tokens_per_s'] * 2:.1f} tok/s")
    path.write_text("\n".join(lines))
    rewrite_manifest(bundle)
    assert f"logs: logs/cpu0.log line {i + 1} reads" in failed(bundle)


def test_removed_arm_line_of_a_completed_session_is_named(bundle):
    path, lines = _log_lines(bundle)
    rec = json.loads(raw(bundle, 6).read_text())
    del lines[_arm_line_index(lines, rec)]
    path.write_text("\n".join(lines))
    rewrite_manifest(bundle)
    assert (f"logs: logs/cpu0.log: record cpu0 seq 6 ({rec['arm']}) has no line, though session cpu0 completed"
            in failed(bundle))


def test_forged_copy_ceiling_is_named_against_the_sessions_log(bundle):
    """Faster copies make every run's fraction of the ceiling smaller; the roofline re-derived from them agrees,
    the ceiling line the session printed does not."""
    edit_json(bundle / "ceilings" / "cpu0.json", lambda c: c.update(times_s=[t / 4 for t in c["times_s"]]))
    republish(bundle)
    ceiling = json.loads((bundle / "ceilings" / "cpu0.json").read_text())
    forged = f"{ceiling['bytes_per_copy'] / min(ceiling['times_s']) / 1e9:.1f} GB/s"
    text = failed(bundle)
    named = [d for d in text.split("\n") if d.startswith("logs: logs/cpu0.log line ")]
    assert len(named) == 1 and f"ceilings/cpu0.json gives 'session cpu0: copy ceiling {forged}'" in named[0], text


def test_removed_copy_ceiling_line_of_a_completed_session_is_named(bundle):
    path, lines = _log_lines(bundle)
    path.write_text("\n".join(line for line in lines if ": copy ceiling " not in line))
    rewrite_manifest(bundle)
    assert "logs: logs/cpu0.log: no copy ceiling line, though session cpu0 completed" in failed(bundle)


@pytest.fixture(scope="module")
def two_points(tmp_path_factory):
    """A small run of two points, one comparison: the second point's runs follow the first's in the order."""
    root = tmp_path_factory.mktemp("two_points")
    cfg = conf.compose("cpu-smoke", ["name=two", "points=[{max_num_seqs:2,num_requests:3},{max_num_seqs:2,num_requests:2}]",
                                     "workload.prompt_len=17", "workload.prompt_lens=null", "workload.output_len=4",
                                     "pairs=2", "comparisons=[{baseline:native,candidate:alias_prefix}]",
                                     "executor.poll_s=0.1", f"results_dir={root / 'results'}", f"cache_dir={root / 'cache'}"])
    return controller.run(cfg).bundle


def test_point_cut_from_the_plan_with_its_runs_is_named_by_its_log_lines(two_points, tmp_path):
    """A forger drops the last point (its records, reference and plan entries, the reference job's entry and log
    lines) and publishes again with the harness: every figure agrees with the shortened plan, and the session's log
    still prints the runs it measured at the dropped point."""
    bundle = tmp_path / two_points.name
    shutil.copytree(two_points, bundle)
    plan = json.loads((bundle / "plan.json").read_text())
    kept, cut = plan["points"][0]["key"], plan["points"][1]["key"]
    for path in [*(bundle / "raw" / "cpu0").glob(f"*-{cut}-*.json"), *(bundle / "references").glob(f"{cut}.*")]:
        path.unlink()
    plan["config"]["points"] = plan["config"]["points"][:1]
    plan["points"] = plan["points"][:1]
    plan["order"]["cpu0"] = [it for it in plan["order"]["cpu0"] if it["point"] == kept]
    plan["config_sha256"] = hashlib.sha256(canonical(plan["config"])).hexdigest()
    (bundle / "plan.json").write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")
    edit_json(bundle / "jobs" / "reference-cpu0.json", lambda job: job["spec"].update(points=job["spec"]["points"][:1]))
    ref_log = bundle / "logs" / "reference.log"
    ref_log.write_text("\n".join(line for line in ref_log.read_text().split("\n") if f" {cut}:" not in line))
    children, env = (json.loads((bundle / f"{name}.json").read_text()) for name in ("children", "environment"))
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    text = failed(bundle)
    named = [d for d in text.split("\n") if d.startswith("logs: logs/cpu0.log line ")]
    arms = [d for d in named if ": plan.json sha256 " not in d]     # the plan line is named too (format 14)
    assert arms and all(f" {cut} " in d and d.endswith("an arm that plan.json's order of cpu0 does not hold")
                        for d in arms), text
    assert len(named) == len(arms) + 1 and "the plan was changed after the session read it" in named[-1], text


def test_plan_rewritten_after_the_run_is_named_by_the_sessions_plan_line(bundle):
    """A forger relaxes the verdict rule in plan.json (confidence, min_pairs and the evidence alpha that follow it),
    fixes config_sha256 and publishes again with the harness: every verdict and figure agrees with the new plan, the
    sha256 the session printed of the plan it read does not."""
    def relax(plan):
        plan["config"]["verdict"].update(min_pairs=3, confidence=0.5)
        plan["config"]["evidence"].update(alpha=0.5)
        plan["detectable_effect"]["alpha"] = 0.5
        plan["config_sha256"] = sha256_bytes(canonical_json(plan["config"]).encode())
    edit_json(bundle / "plan.json", relax)
    republish(bundle)
    text = failed(bundle)
    named = [d for d in text.split("\n") if d.startswith("logs: logs/cpu0.log line ")]
    assert len(named) == 1 and "the plan was changed after the session read it" in named[0], text


def test_removed_plan_line_of_a_completed_session_is_named(bundle):
    path, lines = _log_lines(bundle)
    path.write_text("\n".join(line for line in lines if ": plan.json sha256 " not in line))
    rewrite_manifest(bundle)
    assert "logs: logs/cpu0.log: no plan.json sha256 line, though session cpu0 completed" in failed(bundle)
