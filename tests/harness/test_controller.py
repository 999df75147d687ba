"""The controller: frozen plan and order, killed and timed-out children, submitit, reference reuse."""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from loopbench.audit.auditor import audit
from loopbench.harness import conf, controller, identity, inputs, plan as plan_mod

REPO = Path(__file__).resolve().parents[2]
MINI = ["name=ctl", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=9", "workload.prompt_lens=null",
        "workload.output_len=3", "pairs=2", "comparisons=[{baseline:native,candidate:alias_prefix}]",
        "executor.poll_s=0.1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def run(tmp_path, cache, *extra):
    cfg = conf.compose("cpu-smoke", MINI + [f"results_dir={tmp_path / 'results'}", f"cache_dir={cache}", *extra])
    return controller.run(cfg)


@pytest.mark.parametrize("pairs", [1, 2, 7, 10])
def test_measurement_order_is_balanced_interleaved_and_seeded(pairs):
    checked = conf.validate(conf.compose("cpu-smoke", [f"pairs={pairs}"]))
    plain = checked.to_plain()
    points = plan_mod.point_entries(checked)
    assert points == [{"key": f"B{p['max_num_seqs']}C{p['num_requests']}", **p, "output_len": plain["workload"]["output_len"],
                       "requests": [{"request_id": f"r{i:04d}", "prompt_index": i} for i in range(p["num_requests"])]}
                      for p in plain["points"]]
    order = [o.to_dict() for o in plan_mod.measurement_order(checked)]
    assert [o["seq"] for o in order] == list(range(len(order)))
    assert len(order) == len(points) * len(plain["comparisons"]) * pairs * 2
    firsts = Counter((o["point"], o["comparison"], o["position"]) for o in order if o["slot"] == 0)
    for pt in points:
        for comp in plain["comparisons"]:
            assert firsts[(pt["key"], comp["name"], "baseline")] == math.ceil(pairs / 2)
            assert firsts[(pt["key"], comp["name"], "candidate")] == pairs // 2
    for a, b in zip(order[::2], order[1::2]):   # the two arms of a pair run back to back
        assert (a["point"], a["comparison"], a["pair"]) == (b["point"], b["comparison"], b["pair"])
        assert {a["position"], b["position"]} == {"baseline", "candidate"}
    # pair i of every comparison runs before pair i + 1 of any comparison of the same point
    pt0 = [o for o in order if o["point"] == points[0]["key"]]
    assert [o["pair"] for o in pt0] == sorted(o["pair"] for o in pt0)
    assert order == [o.to_dict() for o in plan_mod.measurement_order(checked)]
    reseeded = dataclasses.replace(checked, order_seed=1)
    assert order != [o.to_dict() for o in plan_mod.measurement_order(reseeded)] or pairs == 1


@pytest.mark.slow      # about 28 s on 2 cores
def test_plan_is_frozen_with_hashes(tmp_path, cache, monkeypatch):
    # Fix the code identity: in a shared checkout another engineer's edit would (rightly) change the key.
    ident = identity.code_identity()
    monkeypatch.setattr(inputs, "code_identity", lambda: ident)
    result = run(tmp_path, cache)
    plan = json.loads((result.bundle / "plan.json").read_text())
    assert plan["config_sha256"] and plan["checkpoint"]["sha256"] and plan["prompts"]["sha256"]
    assert plan["code"]["git_sha"] and isinstance(plan["code"]["git_dirty"], bool)
    assert plan["devices"] == [{"name": "cpu0", "kind": "cpu", "gpu_index": None, "label": "cpu", "cpu_threads": 1}]
    assert plan["points"][0]["reference"]["file"] == "references/B2C3.schedule.json"
    assert len(plan["order"]["cpu0"]) == 4
    assert list(plan["checkpoint"]["stored_dtypes"]) == ["float32"]  # the tiny synthetic preset is uniform
    assert result.summary["status"] == "complete" and audit(result.bundle)["status"] == "pass"
    # a second run reuses the frozen reference by hash; reuse_references=false captures it again
    again = run(tmp_path, cache)
    meta = json.loads((again.bundle / "references/B2C3.meta.json").read_text())
    assert meta["reused"] is True
    assert (again.bundle / "references/B2C3.schedule.json").read_bytes() == \
        (result.bundle / "references/B2C3.schedule.json").read_bytes()
    fresh = run(tmp_path, cache, "reuse_references=false")
    assert json.loads((fresh.bundle / "references/B2C3.meta.json").read_text())["reused"] is False


@pytest.mark.slow      # about 13 s on 2 cores
def test_longest_request_that_fits_the_model_runs(tmp_path, cache):
    """P + D - 1 = max_position_embeddings (1024 for the tiny preset) passes validation and measures."""
    result = run(tmp_path, cache, "workload.prompt_len=1022", "pairs=1")
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    plan = json.loads((result.bundle / "plan.json").read_text())
    assert plan["max_model_len"] == 1022 + 3 - 1 == plan["checkpoint"]["model_config"]["max_position_embeddings"]
    assert audit(result.bundle)["status"] == "pass"


def test_mixed_dtype_release_is_cast_measured_and_its_stored_dtypes_planned(tmp_path, cache):
    """A bf16 checkpoint with fp32 norms and exit gate (how releases ship) runs cast to model.dtype; plan.json
    records what was stored, and the bundle audits PASS."""
    import torch
    from safetensors.torch import save_file

    from loopbench.harness.fixtures import hf_config_dict, write_synthetic_checkpoint
    from loopbench.runtime.checkpoint import CONFIG_NAME, checkpoint_sha256, load_checkpoint
    from loopbench.runtime.model import PRESETS

    _, fp32 = load_checkpoint(write_synthetic_checkpoint(tmp_path / "fp32", "tiny", seed=0, dtype=torch.float32))
    release = tmp_path / "release"
    release.mkdir()
    fp32_names = {n for n in fp32 if "norm" in n.split(".")[-2] or n.startswith("model.early_exit_gate.")}
    save_file({n: t if n in fp32_names else t.to(torch.bfloat16) for n, t in fp32.items()},
              release / "model.safetensors", metadata={"format": "pt"})
    (release / CONFIG_NAME).write_text(json.dumps(hf_config_dict(PRESETS["tiny"], torch.bfloat16)))
    result = run(tmp_path, cache, f"model.checkpoint={release}", "pairs=1")
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    plan = json.loads((result.bundle / "plan.json").read_text())
    stored = plan["checkpoint"]["stored_dtypes"]
    assert sorted(stored) == ["bfloat16", "float32"]
    assert "model.norm.weight" in stored["float32"] and "model.layers.*.input_layernorm.weight" in stored["float32"]
    assert "lm_head.weight" in stored["bfloat16"]
    assert plan["checkpoint"]["sha256"] == checkpoint_sha256(release)
    assert audit(result.bundle)["status"] == "pass"


def test_killed_child_leaves_incomplete_bundle_with_finished_arms_and_no_verdict(tmp_path, cache):
    result = run(tmp_path, cache, "fault.kill_after_arms=3")
    s = result.summary
    assert s["status"] == "incomplete" and not s["verdicts_published"]
    assert all(r["verdict"] is None for r in s["results"])
    child = {c["name"]: c for c in s["children"]}["cpu0"]
    assert child["exit_code"] == -9 and child["state"] == "killed"
    assert len(list((result.bundle / "raw" / "cpu0").glob("*.json"))) == 3
    arms = pd.read_parquet(result.bundle / "tables" / "arms.parquet")
    assert sorted(arms["seq"]) == [0, 1, 2] and arms["elapsed_s"].gt(0).all()
    assert len(pd.read_parquet(result.bundle / "tables" / "pairs.parquet")) == 1
    assert s["counts"]["arms_recorded"] == 3 and s["counts"]["arms_planned"] == 4
    text = (result.bundle / "report.md").read_text()
    assert "INCOMPLETE" in text and "child cpu0 ended killed, killed by SIGKILL (9);" in text
    assert "| cpu0 | CPU | killed | killed by SIGKILL (9) |" in text and "| -9 |" not in text
    verdict = audit(result.bundle)
    assert verdict["status"] == "incomplete", verdict["discrepancies"]


def test_timed_out_child_is_killed_and_recorded(tmp_path, cache):
    result = run(tmp_path, cache, "executor.session_timeout_s=0.5")
    child = {c["name"]: c for c in result.summary["children"]}["cpu0"]
    assert child["state"] == "timeout" and child["exit_code"] != 0
    assert result.summary["status"] == "incomplete" and not result.summary["verdicts_published"]


def test_submitit_local_executor(tmp_path, cache):
    result = run(tmp_path, cache, "executor.kind=slurm", "executor.slurm.cluster=local", "executor.device=cpu")
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    assert [c["name"] for c in result.summary["children"]] == ["reference", "slurm0"]
    assert all(c["exit_code"] == 0 for c in result.summary["children"])
    assert audit(result.bundle)["status"] == "pass"


def test_prompt_files(tmp_path):
    checked = conf.validate(conf.compose("cpu-smoke", ["points=[{max_num_seqs:2,num_requests:2}]"]))

    def reading(path):
        return dataclasses.replace(checked, workload=dataclasses.replace(checked.workload, prompts_file=str(path)))

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('[1, 2, 3]\n{"prompt_token_ids": [4, 5]}\n[6]\n')
    assert inputs.make_prompts(reading(jsonl), 256) == [[1, 2, 3], [4, 5]]
    pq = tmp_path / "p.parquet"
    pd.DataFrame({"prompt_token_ids": [[7, 8], [9, 10, 11]]}).to_parquet(pq)
    assert inputs.make_prompts(reading(pq), 256) == [[7, 8], [9, 10, 11]]
    with pytest.raises(ValueError, match="prompt 1 has token id 10 outside"):
        inputs.make_prompts(reading(pq), 10)
    jsonl.write_text('[1, "a"]\n')
    with pytest.raises(ValueError, match="workload.prompts_file .*p.jsonl:1: expected a non-empty list"):
        inputs.make_prompts(reading(jsonl), 256)
    jsonl.write_text('[1, 2, 3]\nnot json\n')     # the line that is not JSON, not json's line 1 of it
    with pytest.raises(ValueError, match=r"prompts_file .*p.jsonl:2: not JSON \(Expecting value at column 1\)"):
        inputs.make_prompts(reading(jsonl), 256)
    jsonl.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="p.jsonl: not a text file"):
        inputs.make_prompts(reading(jsonl), 256)
    pq.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="p.parquet: not a readable parquet file"):
        inputs.make_prompts(reading(pq), 256)
    seeded = conf.validate(conf.compose("cpu-smoke", ["workload.prompt_len=33", "workload.prompt_lens=null"]))
    a = inputs.make_prompts(seeded, 256)
    assert len(a) == 8 and {len(p) for p in a} == {33} and a == inputs.make_prompts(seeded, 256)
    mixed = conf.validate(conf.compose("cpu-smoke", ["workload.prompt_lens=[3,5]"]))
    b = inputs.make_prompts(mixed, 256)
    assert [len(p) for p in b] == [3, 5] * 4 and b == inputs.make_prompts(mixed, 256)


def test_failed_reference_capture_measures_nothing_and_is_incomplete(tmp_path, cache):
    result = run(tmp_path, cache, "executor.reference_timeout_s=0.3", "reuse_references=false")
    s = result.summary
    assert s["status"] == "incomplete" and {"code": "reference_failed"} in s["incomplete_reasons"]
    assert "the reference capture failed; nothing was measured" in (result.bundle / "report.md").read_text()
    assert [c["name"] for c in s["children"]] == ["reference"] and s["children"][0]["state"] == "timeout"
    assert s["counts"]["arms_recorded"] == 0 and s["results"] == []
    verdict = audit(result.bundle)
    assert verdict["status"] == "incomplete", verdict["discrepancies"]


# ------------------------------------------------------------------------------------- provenance

def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def _copy_sources(dest: Path, folders=("runtime", "harness", "kernels")) -> Path:
    for folder in folders:
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _repo_with_one_commit(path: Path, name: str = "README") -> str:
    path.mkdir(parents=True, exist_ok=True)
    _git(path, "init", "-q")
    (path / name).write_text("outer\n")
    _git(path, "add", "-A")
    _git(path, "commit", "-qm", "first")
    return _git(path, "rev-parse", "HEAD")


def test_project_inside_another_repository_does_not_record_that_repositorys_sha(tmp_path):
    """A copied project tree in a folder of an unrelated (dirty) repository: its own code, run from the copy,
    records no git SHA or dirty flag at all, not the enclosing repository's."""
    outer = tmp_path / "outer"
    outer_sha = _repo_with_one_commit(outer)
    (outer / "README").write_text("an edit: the enclosing repository is dirty\n")
    proj = _copy_sources(outer / "vendor" / "loopbench", ("loopbench", "runtime", "harness", "kernels", "audit"))
    env = {k: v for k, v in os.environ.items() if k != "LOOPBENCH_GIT_SHA"}
    env["PYTHONPATH"] = str(proj)
    proc = subprocess.run([sys.executable, "-c", "import json; from loopbench.harness.identity import code_identity; "
                           "print(json.dumps(code_identity()))"], cwd=proj, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ident = json.loads(proc.stdout)
    assert outer_sha not in proc.stdout
    assert ident["git_sha"] is None and ident["git_dirty"] is None and ident["git_sha_source"] is None
    assert ident["code_sha256"] == identity.code_identity(REPO)["code_sha256"]   # the same sources, hashed


def test_code_sha256_covers_the_contract_the_writer_reads(tmp_path):
    """The publisher writes the format version, tables and report wording of loopbench/bundle_format.json: two
    trees whose runtime, harness and kernels sources are equal but whose contracts differ are other code, so
    finish and resume refuse a bundle measured under the other contract (dca0539 changed only the contract)."""
    proj = _copy_sources(tmp_path / "proj", ("loopbench", "runtime", "harness", "kernels"))
    before = identity.code_identity(proj)["code_sha256"]
    assert before == identity.code_identity(REPO)["code_sha256"]
    contract = proj / "loopbench" / "bundle_format.json"
    text = contract.read_text()
    version = json.loads(text)["version"]
    contract.write_text(text.replace(f'"version": {version}', f'"version": {version + 1}', 1))
    assert contract.read_text() != text
    assert identity.code_identity(proj)["code_sha256"] != before


def test_project_in_another_repository_takes_the_named_sha_and_checks_it(tmp_path, monkeypatch):
    outer = tmp_path / "outer"
    outer_sha = _repo_with_one_commit(outer)
    proj = _copy_sources(outer / "sub")
    named = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("LOOPBENCH_GIT_SHA", named.upper())
    ident = identity.code_identity(proj)
    assert ident["git_sha"] == named != outer_sha
    assert ident["git_dirty"] is None and ident["git_sha_source"] == "LOOPBENCH_GIT_SHA"
    monkeypatch.setenv("LOOPBENCH_GIT_SHA", "0123abc")     # a short SHA is a SHA
    assert identity.code_identity(proj)["git_sha"] == "0123abc"
    for bad in ("", "unknown", "main", "012345", "g123456789", "12345 678"):
        monkeypatch.setenv("LOOPBENCH_GIT_SHA", bad)
        with pytest.raises(ValueError, match=f"LOOPBENCH_GIT_SHA = {bad!r} is not a git commit SHA"):
            identity.code_identity(proj)


def test_named_sha_outranks_a_stale_own_repository_and_keeps_what_git_saw(tmp_path, monkeypatch):
    """A copy that carries a stale .git of its own (the lent GPU host's copy did: HEAD at an older commit,
    the tree dirty against it): the explicitly named commit is recorded, and git's view is kept beside it."""
    proj = _copy_sources(tmp_path / "proj")
    stale = _repo_with_one_commit(proj)
    (proj / "harness" / "stats.py").write_text("# newer than the stale HEAD\n")
    named = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("LOOPBENCH_GIT_SHA", named)
    ident = identity.code_identity(proj)
    assert (ident["git_sha"], ident["git_dirty"], ident["git_sha_source"]) == (named, None, "LOOPBENCH_GIT_SHA")
    assert (ident["git_head_observed"], ident["git_dirty_observed"]) == (stale, True)


def test_projects_own_repository_clone_symlink_and_worktree_record_their_sha(tmp_path, monkeypatch):
    proj = _copy_sources(tmp_path / "proj")
    sha = _repo_with_one_commit(proj)
    monkeypatch.setenv("LOOPBENCH_GIT_SHA", sha[:9].upper())   # naming the repository's own HEAD: git's answer
    ident = identity.code_identity(proj)
    assert (ident["git_sha"], ident["git_dirty"], ident["git_sha_source"]) == (sha, False, "git")
    assert "git_head_observed" not in ident
    monkeypatch.delenv("LOOPBENCH_GIT_SHA")
    link = tmp_path / "link"
    link.symlink_to(proj, target_is_directory=True)
    assert identity.code_identity(link)["git_sha"] == sha
    (proj / "harness" / "stats.py").write_text("# edited\n")
    assert identity.code_identity(proj)["git_dirty"] is True
    _git(proj, "checkout", "-q", "--", "harness/stats.py")
    # a `git worktree`: .git is a file there, and the worktree's own HEAD is recorded
    wt = tmp_path / "wt"
    _git(proj, "worktree", "add", "-q", "-b", "other", str(wt))
    (wt / "NOTES").write_text("on the other branch\n")
    _git(wt, "add", "NOTES")
    _git(wt, "commit", "-qm", "second")
    assert (wt / ".git").is_file()
    ident = identity.code_identity(wt)
    assert ident["git_sha"] == _git(wt, "rev-parse", "HEAD") != sha
    assert (ident["git_dirty"], ident["git_sha_source"]) == (False, "git")


def test_session_logs_echo_one_progress_line_per_online_run(tmp_path):
    """The controller echoes a session child's ``online`` log lines as ``loopbench: online: ...`` progress lines
    (the online runs take most of an online plan's wall time and fill no arm of the bar), each line once."""
    from loopbench.harness import controller
    log = tmp_path / "cpu0.log"
    said = []
    echo = controller._log_echo(log, "online ", "online", lambda phase, what: said.append((phase, what)))
    echo()                                          # no log yet: nothing
    log.write_text("[12:00:00]    0 3/5 native_vs_native pair 0 first native: 0.1s 10 tok/s\n"
                   "[12:00:01] online   0 calibration native rate closed: 16 done\n")
    echo()
    with log.open("a") as f:
        f.write("[12:00:02] online   1 arm native rate 14.973/s: 16 done\n")
    echo()
    assert said == [("online", "  0 calibration native rate closed: 16 done"),
                    ("online", "  1 arm native rate 14.973/s: 16 done")]


def test_the_arms_bar_starts_at_the_arms_already_recorded(tmp_path, monkeypatch, capsys):
    """A resume (or a later restart) starts its bar at the records kept, so its rate counts only the arms it measures
    (the bar once went 0/36 -> 33/36 on its first poll and read 3.78 arm/s)."""
    monkeypatch.delenv("LOOPBENCH_QUIET", raising=False)
    (tmp_path / "raw" / "cpu0").mkdir(parents=True)
    for seq in range(3):
        (tmp_path / "raw" / "cpu0" / f"{seq:05d}-a.json").write_text("{}")
    update, close, _ = controller._progress(tmp_path, 10)
    update()
    close()
    err = capsys.readouterr().err
    assert "3/10 [00:00<?, ?arm/s]" in err and "0/10" not in err, err


def test_a_full_disk_while_publishing_keeps_the_records_names_finish_and_finish_publishes(tmp_path, cache, monkeypatch,
                                                                                          capsys):
    """A full disk during publishing (a break test: a 420 KiB tmpfs as results_dir) was a traceback with exit 1 from
    the parquet writer, saying nothing of the measured records or of finish."""
    from loopbench.harness import bench, cli, evidence

    write_table = evidence.write_table

    def full(path, df):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(evidence, "write_table", full)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["-q", "bench", "--config-name", "cpu-smoke", *MINI, "pairs=1", f"results_dir={tmp_path / 'r'}",
                   f"cache_dir={cache}"])
    err = capsys.readouterr().err
    (bundle,) = (tmp_path / "r").iterdir()
    assert rc == 1 and "Traceback" not in err, err
    assert err.endswith(f"loopbench: could not publish {bundle}: No space left on device; its 2 raw arm records are "
                        f"kept, unpublished; once the cause is gone, publish them with: loopbench finish {bundle}\n"), err
    assert len(list((bundle / "raw").glob("*/*.json"))) == 2 and not (bundle / "manifest.json").exists()
    assert bench.finish_main([str(bundle)]) == 1   # still full: the same line, nothing published
    assert "could not publish" in capsys.readouterr().err and not (bundle / "manifest.json").exists()
    monkeypatch.setattr(evidence, "write_table", write_table)
    # every child had completed, so finish publishes the bundle complete (not incomplete) and its audit passes
    assert bench.finish_main([str(bundle)]) == 0 and audit(bundle)["status"] == "pass"
    assert json.loads((bundle / "summary.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("kept, words", [(1, "its 1 raw arm record is kept"), (3, "its 3 raw arm records are kept")])
def test_a_publish_that_fails_counts_the_records_it_keeps_in_words(tmp_path, monkeypatch, kept, words):
    """PublishFailed said 'its 1 raw arm record are kept'."""
    bundle = tmp_path / "b"
    for i in range(kept):
        (bundle / "raw" / "cpu0").mkdir(parents=True, exist_ok=True)
        (bundle / "raw" / "cpu0" / f"{i:05d}-B1C1-x-p0-baseline.json").write_text("{}")

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(controller, "write_children", full)
    with pytest.raises(controller.PublishFailed) as err:
        controller.publish(bundle, {}, [], {})
    assert str(err.value) == (f"could not publish {bundle}: No space left on device; {words}, unpublished; once the "
                              f"cause is gone, publish them with: loopbench finish {bundle}")
