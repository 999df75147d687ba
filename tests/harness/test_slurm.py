"""The SLURM executor (issue 15): job parameters from the config, and, against a real SLURM (the
`slurm`-marked tests; `bash .ci/slurm start` runs a single-node one on localhost), a run end to end
whose bundle audits PASS and records its jobs, and three faults (a job cancelled with scancel, one past
its time limit, one whose node goes down) that each leave an incomplete bundle naming the child's state."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopbench.audit.auditor import audit
from loopbench.harness import conf, controller, executors, slurm
from tests.audit.tamper import edit_json, failed, rewrite_manifest

pytestmark = pytest.mark.slow      # a SLURM job each, 3-4 min together on 2 cores

REPO = Path(__file__).resolve().parents[2]


def _no_controller() -> bool:
    """No SLURM to submit to: sbatch/scontrol absent, or installed with no controller up (`scontrol ping`:
    a machine with the client packages but no running slurmctld, where every job would fail)."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return True
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=30).returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return True


_NO_SLURM = pytest.mark.skipif(_no_controller(), reason="needs a SLURM cluster: sbatch/scontrol not on PATH or no "
                                                        "controller up (bash .ci/slurm start runs one on localhost)")


def on_slurm(test):
    """The `slurm` marker, and a skip that says why where there is no SLURM."""
    return pytest.mark.slurm(_NO_SLURM(test))


# 4 arms of a tiny model on one CPU of the cluster's node
TINY = ["name=slurm", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=9", "workload.prompt_lens=null",
        "workload.output_len=8", "pairs=2", "comparisons=[{baseline:native,candidate:alias_prefix}]",
        "executor.poll_s=0.2", "executor.stop_grace_s=5", "executor.kind=slurm", "executor.slurm.cpus_per_task=1",
        "executor.slurm.mem_gb=null"]
# the `stall` arm measures its first arm, then hangs (tests/harness/stall_engine.py)
STALL = ['+arms={stall:{engine:"tests.harness.stall_engine:make_engine"}}',
         "comparisons=[{baseline:native,candidate:stall}]"]
WAIT_S = 150


# ------------------------------------------------------------------------ without a cluster

def test_job_parameters_come_from_the_config():
    spec = conf.validate(conf.compose("cpu-smoke", [
        "executor.kind=slurm", "executor.slurm.partition=gpu", "executor.slurm.account=perf",
        "executor.slurm.time_limit_min=30", "executor.slurm.cpus_per_task=4", "executor.slurm.gpus_per_task=2",
        "executor.slurm.mem_gb=null", "+executor.slurm.additional_parameters={qos:high,exclusive:'true'}"]))
    params = slurm.sbatch_parameters(spec.to_plain()["executor"]["slurm"], 900.0, use_gpus=True,
                                     env={"PYTHONPATH": "/repo:/site"})
    assert params["slurm_partition"] == "gpu" and params["slurm_account"] == "perf"
    assert params["timeout_min"] == 30 and params["cpus_per_task"] == 4 and params["slurm_gpus_per_task"] == 2
    assert "mem_gb" not in params
    assert params["slurm_additional_parameters"] == {"no_requeue": True, "qos": "high", "exclusive": True}
    assert params["slurm_setup"] == ["export PYTHONPATH=/repo:/site"]
    # without time_limit_min: the child's own timeout, rounded up to whole minutes
    assert slurm.sbatch_parameters({**spec.to_plain()["executor"]["slurm"], "time_limit_min": None}, 61.0,
                                   use_gpus=False, env={})["timeout_min"] == 2


@pytest.mark.parametrize("override, named", [
    ("executor.slurm.partiton=gpu", "partiton"),                 # misspelt key: Hydra names it
    ("executor.slurm.time_limit_min=soon", "time_limit_min"),    # wrong type
])
def test_a_bad_slurm_key_fails_naming_it(override, named):
    with pytest.raises(Exception, match=named):
        conf.compose("cpu-smoke", [override])


@pytest.mark.parametrize("override, named", [
    ("executor.slurm.cluster=slrum", "executor.slurm.cluster"),
    ("executor.slurm.cpus_per_task=0", "executor.slurm.cpus_per_task"),
    ("executor.slurm.time_limit_min=0", "executor.slurm.time_limit_min"),
])
def test_a_bad_slurm_value_fails_naming_it(override, named):
    with pytest.raises(ValueError, match=named):
        conf.validate(conf.compose("cpu-smoke", [override]))


def test_slurm_states_and_exit_codes_map_through_the_contract():
    assert [slurm.child_state(s) for s in ("COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "RUNNING", None)] == \
        ["completed", "cancelled", "timeout", "node_failure", None, None]
    assert [slurm.exit_code({"ExitCode": e}) for e in ("0:0", "1:0", "0:15")] == [0, 1, -15]
    assert slurm.exit_code({}) is None


def test_a_slurm_job_loads_no_dataframe_library():
    code = ("import sys, loopbench.harness.slurm, loopbench.harness.session; "
            "print([m for m in sys.modules if m.split('.')[0] in ('pandas', 'pyarrow')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert out.stdout.strip() == "[]"


def _refusing_sbatch(tmp_path: Path, refuse_after: int = 0) -> dict:
    """An environment whose ``sbatch`` (first on PATH, with an ``srun`` beside it, which submitit looks for) fails as
    one with no controller up does, after ``refuse_after`` submissions that reach the real sbatch on PATH."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    count = tmp_path / "fake-sbatch-count"
    real = shutil.which("sbatch") or "false"
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\n"
        f"n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}\n"
        f"if [ \"$n\" -lt {refuse_after} ]; then exec {real} \"$@\"; fi\n"
        "echo 'sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)' >&2\n"
        "exit 1\n")
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    env.pop("LOOPBENCH_QUIET", None)
    return env


def test_a_refused_submission_is_one_line_and_leaves_no_folder(tmp_path):
    """sbatch failing for the first child (no controller up, a bad partition): one line naming executor.kind=slurm
    and sbatch's own error, exit 2 (nothing was measured), no traceback and no bundle folder left behind."""
    out = subprocess.run([sys.executable, "-m", "loopbench", "bench", "--config-name", "cpu-smoke",
                          *_overrides(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=600,
                         env=_refusing_sbatch(tmp_path))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "FailedJobError" not in out.stderr
    line = [x for x in out.stderr.splitlines() if "sbatch: error" in x]
    assert len(line) == 1, out.stderr
    assert line[0].startswith("loopbench: bad configuration: executor.kind=slurm: the reference job could not be "
                              "submitted: sbatch: error: Batch job submission failed: Unable to contact slurm "
                              "controller (connect failure); nothing was measured (removed the new bundle folder ")
    assert not (tmp_path / "results").exists() or list((tmp_path / "results").iterdir()) == []


def test_a_refused_session_job_publishes_an_incomplete_bundle(tmp_path, monkeypatch, capsys):
    """Once the reference is frozen, a session whose job sbatch refuses leaves a published incomplete bundle (its arms
    missing, the reason on stderr), which the audit reads as incomplete and a resume can measure."""
    submit = executors.SubmititExecutor._submit

    def refuse_sessions(self, spec):
        if spec.name == "reference":
            return submit(self, spec)
        raise executors.SubmissionFailed(f"executor.kind=slurm: the {spec.session_id} job could not be submitted: "
                                         "sbatch: error: invalid partition specified: gpu")
    monkeypatch.setattr(executors.SubmititExecutor, "_submit", refuse_sessions)
    result = controller.run(conf.compose("cpu-smoke", _overrides(tmp_path, "executor.slurm.cluster=local")))
    assert [r["code"] for r in result.summary["incomplete_reasons"]] == ["arms_missing"]
    assert [c["name"] for c in json.loads((result.bundle / "children.json").read_text())] == ["reference"]
    assert audit(result.bundle)["status"] == "incomplete"
    assert (f"loopbench: executor.kind=slurm: the slurm0 job could not be submitted: sbatch: error: invalid partition "
            f"specified: gpu; publishing the bundle of what was measured, incomplete; once SLURM takes jobs, resume it: "
            f"resume={result.bundle}") in capsys.readouterr().err


def test_plan_says_that_bench_submits_to_slurm():
    from loopbench.harness import planning

    text = planning.plan_text("cpu-smoke", ["executor.kind=slurm", "executor.slurm.cpus_per_task=1",
                                            "executor.slurm.mem_gb=null", "executor.slurm.partition=gpu"])
    assert ("  executor: SLURM (executor.kind=slurm): bench submits the reference capture and each session as a job "
            "with sbatch (partition gpu, 1 CPU per task, time limit each child's timeout); plan submits nothing") in text
    assert "executor:" not in planning.plan_text("cpu-smoke", [])


# ---------------------------------------------------------------------- on a real SLURM cluster

def _overrides(root: Path, *extra) -> list[str]:
    return TINY + [f"results_dir={root / 'results'}", f"cache_dir={root / 'cache'}", *extra]


@pytest.fixture(scope="module")
def slurm_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slurm")
    result = controller.run(conf.compose("cpu-smoke", _overrides(root)))
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    return result.bundle


@on_slurm
def test_a_run_on_slurm_audits_pass_and_records_its_jobs(slurm_bundle):
    assert audit(slurm_bundle)["status"] == "pass"
    children = json.loads((slurm_bundle / "children.json").read_text())
    assert [c["name"] for c in children] == ["reference", "slurm0"]
    for c in children:
        job = c["slurm"]
        assert c["state"] == "completed" and job["job_state"] == "COMPLETED"
        assert job["environment"]["SLURM_JOB_ID"] == job["job_id"]
        assert job["nodes"] and job["environment"]["SLURMD_NODENAME"] in job["nodes"]
    assert children[0]["slurm"]["job_id"] != children[1]["slurm"]["job_id"]
    assert len(list((slurm_bundle / "raw" / "slurm0").glob("*.json"))) == 4


def _tamper_children(bundle: Path, tmp_path: Path, fn) -> Path:
    copy = tmp_path / bundle.name
    shutil.copytree(bundle, copy)
    for name in ("children.json", "summary.json"):
        edit_json(copy / name, lambda d: fn(d if name == "children.json" else d["children"]))
    rewrite_manifest(copy)
    return copy


@on_slurm
def test_the_audit_holds_a_child_state_to_its_slurm_state(slurm_bundle, tmp_path):
    def forge(children):
        children[1]["slurm"]["job_state"] = "TIMEOUT"   # the job timed out, but the child claims completed
    assert "ended TIMEOUT, which is 'timeout'" in failed(_tamper_children(slurm_bundle, tmp_path, forge))


@on_slurm
def test_the_audit_requires_the_slurm_job_of_a_slurm_run(slurm_bundle, tmp_path):
    def drop(children):
        del children[1]["slurm"]
    assert "slurm0 ran on SLURM but records no slurm job" in failed(_tamper_children(slurm_bundle, tmp_path, drop))


def _start(root: Path, *extra) -> subprocess.Popen:
    args = [sys.executable, "-m", "loopbench.harness.bench", "--config-name", "cpu-smoke",
            *_overrides(root, *STALL, *extra), f"hydra.run.dir={root / 'hydra'}"]
    return subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _session_job(root: Path, proc: subprocess.Popen) -> tuple[Path, str]:
    """(bundle, the session's SLURM job id) once the session has recorded its first arm."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        raws = list((root / "results").glob("*/raw/slurm0/*.json"))
        if raws:
            bundle = raws[0].parents[2]
            jobs = [int(p.name) for p in (root / "cache" / "submitit" / bundle.name).iterdir() if p.name.isdigit()]
            return bundle, str(max(jobs))   # the reference job was submitted first
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the session recorded no arm within {WAIT_S} s:\n{proc.communicate()[0][-3000:]}")


def _finished(proc: subprocess.Popen, bundle: Path, state: str, job_state: str) -> dict:
    """The controller exits 3 without hanging; the bundle is incomplete, names the child's state, and
    keeps the arm the session completed."""
    try:
        out = proc.communicate(timeout=WAIT_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the controller did not exit within {WAIT_S} s after the fault:\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode == 3, out[-3000:]
    session = json.loads((bundle / "children.json").read_text())[-1]
    assert (session["name"], session["state"], session["slurm"]["job_state"]) == ("slurm0", state, job_state)
    summary = json.loads((bundle / "summary.json").read_text())
    assert {"code": "child_failed", "child": "slurm0", "state": state,
            "exit_code": session["exit_code"]} in summary["incomplete_reasons"]
    counts, raws = summary["counts"], list((bundle / "raw" / "slurm0").glob("*.json"))
    assert 1 <= counts["arms_recorded"] == len(raws) < counts["arms_planned"] and summary["checks"]["ok"]
    assert audit(bundle)["status"] == "incomplete"
    return session


@on_slurm
def test_a_job_cancelled_with_scancel_leaves_an_incomplete_bundle(tmp_path):
    proc = _start(tmp_path)
    bundle, job = _session_job(tmp_path, proc)
    subprocess.run(["scancel", job], check=True)
    _finished(proc, bundle, "cancelled", "CANCELLED")


@on_slurm
def test_a_job_past_its_time_limit_leaves_an_incomplete_bundle(tmp_path):
    proc = _start(tmp_path, "executor.slurm.time_limit_min=1")
    bundle, _ = _session_job(tmp_path, proc)
    session = _finished(proc, bundle, "timeout", "TIMEOUT")
    assert session["slurm"]["time_limit"] == "00:01:00"


@on_slurm
def test_a_job_whose_node_goes_down_leaves_an_incomplete_bundle(tmp_path):
    proc = _start(tmp_path)
    bundle, job = _session_job(tmp_path, proc)
    node = slurm.job_info(job)["NodeList"]
    try:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=loopbench-test"], check=True)
        _finished(proc, bundle, "node_failure", "NODE_FAIL")
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        _wait_idle(node)


def _wait_idle(node: str) -> None:
    for _ in range(60):
        out = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout
        if out.strip().startswith(("idle", "mix", "alloc")):
            return
        time.sleep(1)


@on_slurm
def test_a_stopped_controller_cancels_its_jobs(tmp_path):
    proc = _start(tmp_path)
    bundle, job = _session_job(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=WAIT_S)[0]
    assert proc.returncode == 3, out[-3000:]
    session = json.loads((bundle / "children.json").read_text())[-1]
    assert (session["state"], session["interrupted_by"], session["slurm"]["job_state"]) == \
        ("interrupted", "SIGTERM", "CANCELLED")
    assert slurm.job_info(job)["JobState"] == "CANCELLED"
    assert audit(bundle)["status"] == "incomplete"
