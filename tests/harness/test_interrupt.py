"""Interrupted runs (issue 8, items 4 and 5): SIGTERM / Ctrl-C publish an incomplete bundle, `finish`
publishes the bundle of a controller that was SIGKILLed, and a resume completes either one."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from loopbench.audit.auditor import audit
from loopbench.harness import cli, conf, controller, executors, identity, inputs

pytestmark = pytest.mark.slow      # its stopped and resumed runs take about 1 min together on 2 cores

REPO = Path(__file__).resolve().parents[2]
# 12 arms of a tiny model: long enough that a signal after the second record finds the session measuring
OVERRIDES = ["name=stop", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=9",
             "workload.prompt_lens=null", "workload.output_len=8", "pairs=6",
             "comparisons=[{baseline:native,candidate:alias_prefix}]", "executor.poll_s=0.1", "executor.stop_grace_s=5"]
WAIT_S = 120


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupt")
    yield {"results": root / "r", "cache": root / "c", "hydra": root / "h"}
    # a failed test must not leave a benchmark running on the machine
    for pid in _processes_of(root):
        os.kill(pid, signal.SIGKILL)


def _overrides(dirs) -> list[str]:
    return OVERRIDES + [f"results_dir={dirs['results']}", f"cache_dir={dirs['cache']}"]


def _start(dirs, results: Path) -> subprocess.Popen:
    # results_dir differs between these runs; a resume need not repeat it (the bundle is named by resume=)
    args = [sys.executable, "-m", "loopbench.harness.bench", "--config-name", "cpu-smoke", *_overrides(dirs),
            f"results_dir={results}", f"hydra.run.dir={dirs['hydra']}"]
    return subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _processes_of(bundle: Path) -> list[int]:
    """Processes whose command line names the bundle (its children: `session <bundle>/jobs/...`)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if str(bundle).encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:  # it ended meanwhile
                pass
    return pids


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (an orphan's zombie waits for whoever adopts it)."""
    live = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":   # fields: state ppid pgrp ...
            live.append(int(d.name))
    return live


def _interrupt_after_arms(dirs, results: Path, sig: int) -> tuple[Path, subprocess.Popen, int]:
    """Start `bench`, wait until three arms are recorded (so that a resume keeps a whole pair and finds a
    lone arm), send ``sig`` to the controller; (bundle, proc, session child's pid)."""
    proc = _start(dirs, results)   # its command line names results, so the teardown of `dirs` finds it
    deadline = time.monotonic() + WAIT_S
    while len(list(results.glob("*/raw/cpu0/*.json"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    (bundle,) = results.iterdir()
    (child,) = _processes_of(bundle)
    # the session child leads its own process group, apart from the controller's
    assert os.getpgid(child) == child != os.getpgid(proc.pid)
    proc.send_signal(sig)
    return bundle, proc, child


def _tree(bundle: Path) -> dict[str, str]:
    return {p.relative_to(bundle).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(bundle.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped(dirs):
    """A bench run stopped by SIGTERM once three arms are recorded, after its controller exited."""
    bundle, proc, child = _interrupt_after_arms(dirs, dirs["results"] / "term", signal.SIGTERM)
    out, _ = proc.communicate(timeout=WAIT_S)
    return {"bundle": bundle, "rc": proc.returncode, "out": out, "child": child,
            "left": _processes_of(bundle), "group_alive": _group_alive(child)}


def test_sigterm_stops_the_children_and_publishes_an_incomplete_bundle(stopped):
    bundle = stopped["bundle"]
    assert stopped["left"] == [] and not stopped["group_alive"], "a process of the run outlived its controller"
    assert stopped["rc"] == 3, stopped["out"]          # incomplete, and the audit found nothing else wrong
    summary = json.loads((bundle / "summary.json").read_text())
    assert summary["status"] == "incomplete" and not summary["verdicts_published"]
    assert all(r["verdict"] is None for r in summary["results"])
    assert summary["incomplete_reasons"][0] == {"code": "stopped", "by": "SIGTERM"}
    assert "the controller received SIGTERM and stopped its children" in (bundle / "report.md").read_text()
    children = json.loads((bundle / "children.json").read_text())
    assert [(c["name"], c["state"], c["interrupted_by"]) for c in children] == \
        [("reference", "completed", None), ("cpu0", "interrupted", "SIGTERM")]
    # the child ends by the signal (-15), not with the shell's 143, and is worded so everywhere it is shown
    assert children[-1]["exit_code"] == -signal.SIGTERM, children[-1]
    text = (bundle / "report.md").read_text()
    assert "child cpu0 ended interrupted, killed by SIGTERM (15)" in text
    assert "| cpu0 | CPU | interrupted | killed by SIGTERM (15) |" in text
    assert "child cpu0 ended interrupted, killed by SIGTERM (15); last lines of" in stopped["out"], stopped["out"]
    recorded = sorted((bundle / "raw" / "cpu0").glob("*.json"))
    assert 3 <= len(recorded) < 12 and summary["counts"]["arms_recorded"] == len(recorded)
    assert all(json.loads(p.read_text())["session"] == "cpu0" for p in recorded)
    assert (bundle / "manifest.json").is_file() and (bundle / "tables" / "arms.parquet").is_file()
    assert not [p for p in bundle.rglob(".*")], "a temporary file was left behind"
    rc = subprocess.run([sys.executable, "-m", "loopbench.audit", str(bundle)], cwd=REPO,
                        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert rc.returncode == 3, rc.stdout
    assert audit(bundle)["status"] == "incomplete"


def test_sigkill_then_finish_publishes_the_same_incomplete_state(dirs):
    bundle, proc, child = _interrupt_after_arms(dirs, dirs["results"] / "kill", signal.SIGKILL)
    proc.communicate(timeout=WAIT_S)
    deadline = time.monotonic() + 30   # the kernel SIGTERMs the orphan (prctl PR_SET_PDEATHSIG)
    while (_processes_of(bundle) or _live_members(child)) and time.monotonic() < deadline:
        time.sleep(0.1)                # the orphan may still be exiting when its bundle files are closed
    assert _processes_of(bundle) == [] and _live_members(child) == []
    assert not (bundle / "summary.json").exists() and not (bundle / "manifest.json").exists()
    assert audit(bundle)["status"] == "fail"          # unpublished: broken until finished
    assert {c["name"]: c["state"] for c in json.loads((bundle / "children.json").read_text())}["cpu0"] == "running"
    # what a writer killed mid-write leaves: a temporary dotfile beside the records
    (bundle / "raw" / "cpu0" / ".00011-B2C3-x-p5-baseline.json.k1.tmp").write_text('{"job": "cpu0", "se')

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    fin = subprocess.run([sys.executable, "-m", "loopbench.harness.bench", "finish", str(bundle)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=WAIT_S)
    assert fin.returncode == 3, fin.stdout + fin.stderr
    assert audit(bundle)["status"] == "incomplete"
    summary = json.loads((bundle / "summary.json").read_text())
    assert summary["status"] == "incomplete" and not summary["verdicts_published"]
    assert summary["incomplete_reasons"][0] == {"code": "lost"}
    assert "the controller ended without publishing; its unfinished children were marked interrupted" in \
        (bundle / "report.md").read_text()
    cpu0 = json.loads((bundle / "children.json").read_text())[-1]
    assert (cpu0["state"], cpu0["interrupted_by"], cpu0["exit_code"]) == ("interrupted", "lost", None)
    lost = "child cpu0 ended interrupted, lost: no exit status recorded"
    assert lost in fin.stdout and "None" not in fin.stdout, fin.stdout       # finish's status line
    assert lost in (bundle / "report.md").read_text()
    assert "| cpu0 | CPU | interrupted | lost: no exit status recorded | n/a |" in (bundle / "report.md").read_text()
    assert not [p for p in bundle.rglob(".*")]
    again = subprocess.run([sys.executable, "-m", "loopbench.harness.bench", "finish", str(bundle)], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert again.returncode == 1 and "published already" in again.stderr


def _copy(bundle: Path, dest: Path) -> Path:
    shutil.copytree(bundle, dest)
    (dest / "audit.json").unlink(missing_ok=True)
    return dest


def _resume(dirs, bundle: Path, *extra):
    return controller.run(conf.compose("cpu-smoke", _overrides(dirs) + [f"resume={bundle}", *extra]))


@pytest.fixture(scope="module")
def resumed(stopped, dirs, tmp_path_factory):
    """The SIGTERM'd bundle, its last pair cut in half, resumed to the end: (bundle, kept records, facts)."""
    bundle = _copy(stopped["bundle"], tmp_path_factory.mktemp("resumed") / "b")
    records = sorted((bundle / "raw" / "cpu0").glob("*.json"))
    if len(records) % 2 == 0:   # cut the last pair in half: its lone arm is measured again with its partner
        records.pop().unlink()
    before = {"lone": json.loads(records[-1].read_text()), "lone_bytes": records[-1].read_bytes(),
              "lone_name": records[-1].name, "kept": len(records) - 1,
              "plan": (bundle / "plan.json").read_bytes(),
              "refs": {p.name: p.read_bytes() for p in (bundle / "references").iterdir()}}
    return bundle, before, _resume(dirs, bundle)


def test_resume_measures_the_rest_in_the_planned_order_and_audits_pass(resumed, dirs):
    bundle, before, result = resumed
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert (bundle / "plan.json").read_bytes() == before["plan"]   # the frozen plan and references are reused
    assert {p.name: p.read_bytes() for p in (bundle / "references").iterdir()} == before["refs"]
    children = json.loads((bundle / "children.json").read_text())
    assert [(c["session"], c["attempt"], c["state"]) for c in children] == \
        [("reference", 0, "completed"), ("cpu0", 0, "interrupted"), ("cpu0.r1", 1, "completed")]
    plan = json.loads(before["plan"])
    recs = sorted((json.loads(p.read_text()) for p in (bundle / "raw" / "cpu0").glob("*.json")),
                  key=lambda r: r["seq"])
    kept = before["kept"]
    assert [r["seq"] for r in recs] == list(range(12)) and kept % 2 == 0 and kept >= 2
    assert [r["session"] for r in recs] == ["cpu0"] * kept + ["cpu0.r1"] * (12 - kept)
    assert recs[before["lone"]["seq"]]["session"] == "cpu0.r1"     # the lone arm was measured again
    # ... and its first measurement is kept, byte for byte, in the bundle (it was deleted), out of every figure
    aside = f"superseded/cpu0/raw/cpu0/{before['lone_name']}"
    assert [p.relative_to(bundle).as_posix() for p in (bundle / "superseded").rglob("*") if p.is_file()] == [aside]
    assert (bundle / aside).read_bytes() == before["lone_bytes"] and json.loads(before["lone_bytes"])["session"] == "cpu0"
    assert aside in json.loads((bundle / "manifest.json").read_text())["files"]
    assert verdict["checked"]["superseded_records"] == 1
    arms = pd.read_parquet(bundle / "tables" / "arms.parquet")
    assert len(arms) == 12 and arms.loc[arms["seq"] == before["lone"]["seq"], "session"].tolist() == ["cpu0.r1"]
    assert result.summary["counts"]["arms_recorded"] == 12 and result.summary["counts"]["pairs_complete"] == 6
    report = (bundle / "report.md").read_text()
    assert "1 run was measured and then superseded by a resume: the run stopped between the two arms of a pair" in report
    assert f"| {aside} | cpu0 | {before['lone']['seq']} | {before['lone']['arm']} |" in report
    for r, item in zip(recs, plan["order"]["cpu0"]):   # the same seeded balanced order, continued
        assert (r["pair"], r["position"], r["arm"]) == (item["pair"], item["position"], item["arm"])
    job = json.loads((bundle / "jobs" / "session-cpu0.r1.json").read_text())
    assert job["seqs"] == list(range(kept, 12)) and job["session"] == "cpu0.r1"
    assert "| cpu0.r1 | CPU | completed | exit code 0 |" in (bundle / "report.md").read_text()
    assert "| cpu0 | CPU | interrupted | killed by SIGTERM (15) |" in (bundle / "report.md").read_text()

    with pytest.raises(ValueError, match="is complete; a complete bundle cannot be resumed"):
        _resume(dirs, bundle)
    assert audit(bundle)["status"] == "pass"


def _rewrite_manifest(bundle: Path) -> None:
    """A forger's manifest, so that the auditor's session checks must catch the edit."""
    from loopbench.harness import evidence

    evidence.write_manifest(bundle)


def _edit(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _first_resumed(bundle: Path) -> Path:
    return min((p for p in (bundle / "raw" / "cpu0").glob("*.json")
                if json.loads(p.read_text())["session"] == "cpu0.r1"), key=lambda p: p.name)


TAMPERS = {
    "record claims the interrupted session": (
        lambda b: _edit(_first_resumed(b), lambda r: r.update(session="cpu0")), "was measured by sessions"),
    "record names no session of its job": (
        lambda b: _edit(_first_resumed(b), lambda r: r.update(session="cpu0.r7")), "is not a session of cpu0"),
    "session still running": (
        lambda b: _edit(b / "children.json", lambda ch: ch[2].update(state="running")), "not an ended state"),
    "sessions out of run order": (
        lambda b: _edit(b / "children.json", lambda ch: ch[1].update(attempt=2)), "follows seq"),
    "job asked for other seqs": (
        lambda b: _edit(b / "jobs" / "session-cpu0.r1.json", lambda j: j["seqs"].pop()), "its job asked for"),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_auditor_checks_which_session_measured_which_pair(resumed, tmp_path, tamper):
    edit, message = TAMPERS[tamper]
    bundle = _copy(resumed[0], tmp_path / "b")
    edit(bundle)
    _rewrite_manifest(bundle)
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    assert any(d.startswith("sessions: ") and message in d for d in verdict["discrepancies"]), verdict["discrepancies"]


def test_signals_become_a_stop_request_while_children_run():
    before = signal.getsignal(signal.SIGINT)
    with executors.StopSignals() as stop:
        assert stop() is None
        os.kill(os.getpid(), signal.SIGINT)    # Ctrl-C: no KeyboardInterrupt, a request the executor polls
        os.kill(os.getpid(), signal.SIGTERM)   # a second signal does not replace the first
        deadline = time.monotonic() + 5
        while stop() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop() == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


def test_a_child_that_ended_on_its_own_before_the_stop_keeps_its_own_end(tmp_path, monkeypatch):
    """A stop that came between a session's last record (its exit 0) and the controller's next poll marked it
    interrupted by the signal: a bundle with every planned arm recorded was published incomplete, verdicts barred.
    Here one child exits 0 and one fails before the stop, and one is still running when it comes."""
    scripts = {"done": "pass", "failed": "raise SystemExit(1)", "running": "import time; time.sleep(60)"}
    specs = []
    for name, body in scripts.items():
        job = tmp_path / f"{name}.py"
        job.write_text(f"{body}\n")
        specs.append(executors.ChildSpec(name, job, tmp_path / f"{name}.log", None, "CPU", 120.0))
    real_popen = executors.subprocess.Popen
    spawned = []

    def popen(args, **kw):      # each child runs its job file as a script, not a session
        spawned.append(real_popen([sys.executable, str(args[-1])], **kw))
        return spawned[-1]

    def stop():                 # the stop comes once the first two have ended, before any poll saw them end
        if len(spawned) < len(specs):
            return None
        deadline = time.monotonic() + 30
        while any(os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None for p in spawned[:2]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return "SIGTERM"

    monkeypatch.setattr(executors.subprocess, "Popen", popen)
    results = {r.name: r for r in executors.LocalExecutor().run(specs, poll_s=0.01, stop=stop, grace_s=5.0)}
    assert (results["done"].state, results["done"].exit_code, results["done"].interrupted_by) == ("completed", 0, None)
    assert (results["failed"].state, results["failed"].exit_code, results["failed"].interrupted_by) == ("failed", 1,
                                                                                                      None)
    assert (results["running"].state, results["running"].exit_code, results["running"].interrupted_by) == (
        "interrupted", -signal.SIGTERM, "SIGTERM")


def test_a_stop_is_acted_on_before_the_next_poll(tmp_path, monkeypatch):
    """The controller slept executor.poll_s between polls, and a Ctrl-C only set a flag it read at the next poll:
    with poll_s=40 a run stopped after 4 records went on measuring (53 records) for 40 s, its children unstopped,
    and with poll_s=1e9 a stop never came. The wait between polls now ends on a stop. A fake clock here: the stop
    comes during the first wait, and the child must be signalled before the poll interval has passed."""
    from types import SimpleNamespace

    job = tmp_path / "running.py"
    job.write_text("import time; time.sleep(60)\n")
    spec = executors.ChildSpec("running", job, tmp_path / "running.log", None, "CPU", 120.0)
    real_popen, real_signal = executors.subprocess.Popen, executors._signal_group
    clock, stopped_at, signalled_at = [0.0], [], []

    def sleep(seconds):
        if not stopped_at:
            stopped_at.append(clock[0])     # the Ctrl-C arrives while the controller waits
        clock[0] += seconds

    def signal_group(proc, sig):
        signalled_at.append((clock[0], sig))
        real_signal(proc, sig)

    monkeypatch.setattr(executors.subprocess, "Popen", lambda args, **kw: real_popen([sys.executable, str(job)], **kw))
    monkeypatch.setattr(executors, "time", SimpleNamespace(sleep=sleep, monotonic=lambda: clock[0]))
    monkeypatch.setattr(executors, "_signal_group", signal_group)
    poll_s = 600.0
    (result,) = executors.LocalExecutor().run([spec], poll_s=poll_s, stop=lambda: "SIGINT" if stopped_at else None,
                                              grace_s=5.0)
    assert (result.state, result.interrupted_by) == ("interrupted", "SIGINT")
    assert signalled_at[0][1] == signal.SIGTERM and signalled_at[0][0] < stopped_at[0] + poll_s, signalled_at


def test_stops_held_deliver_one_keyboard_interrupt_after_the_block_and_keep_an_ignored_signal_ignored():
    """Code a KeyboardInterrupt cannot land in cleanly (triton's native initialisation aborted the interpreter on a
    new user's Ctrl-C) runs to its end; the stop comes after it."""
    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with executors.stops_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)               # the handlers run here: neither raises
            done.append(True)
    assert done == [True] and signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # as a shell's background job starts
    try:
        with executors.stops_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_a_stop_inside_the_composition_is_an_interrupt_not_a_bad_configuration(monkeypatch, how):
    """A Ctrl-C inside OmegaConf came out as a secondary AttributeError, named as a bad configuration (exit 2)."""
    import hydra

    from loopbench.harness import conf

    real, composed = hydra.compose, []

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(0.05)                   # where the stop would land inside Hydra and OmegaConf
        composed.append(real(*args, **kwargs))
        return composed[-1]

    monkeypatch.setattr(hydra, "compose", signalled)
    with executors.stops_at_once(), pytest.raises(KeyboardInterrupt):
        conf.compose("cpu-smoke", ["pairs=3"])
    assert len(composed) == 1 and composed[0].pairs == 3   # held until the composition was done


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_a_stop_before_any_child_removes_the_new_bundle_folder(tmp_path, monkeypatch, how):
    """Ctrl-C (Python's KeyboardInterrupt) or SIGTERM while the model is prepared (checkpoint synthesis and
    calibration take seconds on a fresh cache): nothing was measured, so the run ends at once, with no empty bundle
    folder left behind, and SIGTERM's handler is given back."""
    before = signal.getsignal(signal.SIGTERM)

    def prepare_model(spec, got, bundle):
        assert (bundle / "prompts.json").parent.is_dir()   # the folder exists when the stop comes
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(5)       # the handler raises here; reaching the end would mean the signal was lost
        raise AssertionError(f"{how} did not stop prepare_model")

    monkeypatch.setattr(controller, "prepare_model", prepare_model)
    # SIGINT: Python's own handler raises KeyboardInterrupt, as at a terminal. Set here, since a test run started
    # in the background of a shell without job control (nohup ... &) inherits SIGINT ignored, and Python keeps that.
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cfg = conf.compose("cpu-smoke", [f"results_dir={tmp_path / 'r'}", f"cache_dir={tmp_path / 'c'}"])
        with pytest.raises(controller.Interrupted, match="before anything was measured: removed the new bundle folder "):
            controller.run(cfg)
    finally:
        signal.signal(signal.SIGINT, interrupt)
    assert list((tmp_path / "r").iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_during_the_reference_capture_removes_the_bundle_no_resume_could_use(tmp_path, monkeypatch, capsys):
    """A stop that ends the reference child before every point's reference is frozen: no arm has run and a resume
    would refuse the bundle, so the folder is removed (the child cached each reference it captured)."""
    def capture_references(spec, got, ckpt, bundle, executor, stop):
        os.kill(os.getpid(), signal.SIGTERM)   # recorded by the run's StopSignals, as while a child runs
        for _ in range(50):
            if stop() is not None:
                break
            time.sleep(0.1)
        (bundle / "references").mkdir()
        (bundle / "references" / "B3C5.schedule.json").write_text("{}")   # one point's file, no meta: not frozen
        return controller.point_entries(spec), [{"name": "reference", "state": "interrupted"}]

    monkeypatch.setattr(controller, "capture_references", capture_references)
    cfg = conf.compose("cpu-smoke", [f"results_dir={tmp_path / 'r'}", f"cache_dir={tmp_path / 'c'}"])
    with pytest.raises(controller.Interrupted, match="during the reference capture, before every point's reference "
                                                     "was frozen: removed the new bundle folder "):
        controller.run(cfg)
    assert list((tmp_path / "r").iterdir()) == []


def test_a_stop_after_the_references_before_the_first_session_is_recorded_and_resumable(dirs, tmp_path, monkeypatch):
    """SIGTERM once every reference is frozen, before the session child starts: the bundle said only '0 of 4 planned
    arms recorded' (no child entry, no stop: the stop was lost from the record). Now its session is recorded as
    not started, stopped by SIGTERM, and a resume measures every arm to a bundle whose audit passes."""
    freeze_plan = controller.freeze_plan

    def freeze_then_signal(*args, **kwargs):
        plan = freeze_plan(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)   # recorded by the run's StopSignals: the children have begun
        return plan

    monkeypatch.setattr(controller, "freeze_plan", freeze_then_signal)
    over = _overrides(dirs) + [f"results_dir={tmp_path / 'r'}", "pairs=2"]
    summary = controller.run(conf.compose("cpu-smoke", over)).summary
    (bundle,) = (tmp_path / "r").iterdir()
    assert summary["status"] == "incomplete"
    assert {"code": "stopped", "by": "SIGTERM"} in summary["incomplete_reasons"], summary["incomplete_reasons"]
    cpu0 = {c["name"]: c for c in summary["children"]}["cpu0"]
    assert cpu0["state"] == "interrupted" and cpu0["interrupted_by"] == "SIGTERM" and cpu0["exit_code"] is None
    assert audit(bundle)["status"] == "incomplete"
    monkeypatch.setattr(controller, "freeze_plan", freeze_plan)
    again = controller.run(conf.compose("cpu-smoke", over + [f"resume={bundle}"])).summary
    assert again["status"] == "complete" and again["counts"]["arms_recorded"] == 4
    assert audit(bundle)["status"] == "pass"


@pytest.mark.parametrize("stop", ["before anything was measured", "while measuring"])
def test_a_stopped_sweep_job_stops_the_sweep(tmp_path, monkeypatch, capsys, stop):
    """Ctrl-C in job 1 of a three-job multirun: Hydra would run jobs 2 and 3; they are named as not run, exit 3."""
    from loopbench.harness import bench

    ran = []

    def run(spec):
        ran.append(spec.pairs)
        if stop == "before anything was measured":
            raise controller.Interrupted("interrupted while preparing the model, before anything was measured")
        return controller.RunResult(tmp_path / "bundle", {"incomplete_reasons": [{"code": "stopped", "by": "SIGINT"}]})

    monkeypatch.setattr(controller, "run", run)
    monkeypatch.setattr(bench, "show", lambda result: 3)
    monkeypatch.delenv("LOOPBENCH_QUIET", raising=False)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "-m", "pairs=1,2,3", f"results_dir={tmp_path / 'r'}",
                     f"hydra.sweep.dir={tmp_path / 'h'}"]) == 3
    assert ran == [1]
    why = "a stop before any arm was measured" if stop == "before anything was measured" else "SIGINT"
    err = capsys.readouterr().err
    for job in (2, 3):
        assert f"loopbench: sweep: job {job} of 3 not run: the sweep was stopped ({why} in job 1)" in err, err


def _signalled(how: str):
    """A stand-in for a stage that a stop reaches: Ctrl-C as Python raises it, or SIGTERM sent to this process."""
    def stage(*args, **kwargs):
        if how == "SIGINT":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)   # the handler raises here; reaching the end would mean the signal was lost
        raise AssertionError("SIGTERM did not stop the stage")
    return stage


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_an_interrupted_audit_leaves_the_bundle_published_and_says_how_to_audit_it(stopped, monkeypatch, capsys, how):
    from loopbench.harness import bench

    monkeypatch.setattr(controller.subprocess, "run", _signalled(how))   # the auditor child, as a stop reaches it
    monkeypatch.delenv("LOOPBENCH_QUIET", raising=False)   # its progress line is part of the stderr checked
    bundle = stopped["bundle"]
    summary = json.loads((bundle / "summary.json").read_text())
    before = signal.getsignal(signal.SIGTERM)
    assert bench.show(controller.RunResult(bundle, summary)) == 3
    assert signal.getsignal(signal.SIGTERM) is before
    said = f"loopbench: audit: re-deriving every figure of {bundle.name} from its raw records\n\n"
    assert capsys.readouterr().err == said + (f"loopbench: the audit was interrupted, so {bundle} is published but "
                                              f"not audited; to audit it: loopbench audit {bundle}\n")
    # the command alone, SIGTERM too (controller.audit handles both for every caller)
    assert cli.main(["audit", str(bundle)]) == 3
    assert capsys.readouterr().err == said + f"loopbench audit: interrupted; no verdict was written for {bundle}\n"


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_a_stop_while_the_bundle_is_published_ends_the_command_before_the_audit(dirs, tmp_path, monkeypatch, capsys,
                                                                                how):
    """A stop once every child had ended, while the bundle was written, was lost: the handler said 'stopping the
    children, then publishing an incomplete bundle', yet the run published the bundle complete, audited it and exited
    0, as if no Ctrl-C or SIGTERM had come. Now the bundle (all that ran) is published, the command ends there, exit 3,
    naming the audit to run; that audit passes."""
    from loopbench.harness import evidence

    finalize = evidence.finalize

    def signal_then_finalize(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, how))   # recorded by the run's StopSignals
        return finalize(*args, **kwargs)

    monkeypatch.setattr(evidence, "finalize", signal_then_finalize)
    monkeypatch.setattr(controller, "audit", lambda bundle: pytest.fail("audited after the stop"))
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["-q", "bench", "--config-name", "cpu-smoke", *_overrides(dirs), "pairs=1",
                   f"results_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    (bundle,) = (tmp_path / "r").iterdir()
    assert rc == 3, err
    assert f"loopbench: {how} received: publishing the bundle of what was measured, then ending without its audit\n" \
        in err
    assert err.endswith(f"loopbench: {how} received after the children's last records: {bundle} is published (complete) "
                        f"but not audited; to audit it: loopbench audit {bundle}\n"), err
    assert (bundle / "manifest.json").is_file() and not (bundle / "audit.json").exists()
    assert audit(bundle)["status"] == "pass"


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_a_stop_while_the_configuration_is_checked_is_one_line(tmp_path, monkeypatch, capsys, how):
    """Before Hydra runs, bench composes and checks the configuration (seconds: torch and scipy import there)."""
    from loopbench.harness import planning

    monkeypatch.setattr(planning, "check", _signalled(how))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", f"results_dir={tmp_path / 'r'}"]) == 3
    assert capsys.readouterr().err.splitlines()[-2:] == ["", "loopbench: interrupted"]
    assert list(tmp_path.iterdir()) == []


def test_a_stop_recorded_between_the_handlers_still_ends_the_run_before_anything_is_measured(tmp_path, monkeypatch,
                                                                                             capsys):
    """SIGTERM while the card claim runs (the stop handlers record it there, they do not raise): the run ends before
    it opens a bundle, instead of preparing the model only to start children and stop them."""
    from loopbench.harness import cards

    claimed = cards.claimed

    def claim_then_signal(devices):
        os.kill(os.getpid(), signal.SIGTERM)
        return claimed(devices)

    monkeypatch.setattr(cards, "claimed", claim_then_signal)
    cfg = conf.compose("cpu-smoke", [f"results_dir={tmp_path / 'r'}", f"cache_dir={tmp_path / 'c'}"])
    with pytest.raises(controller.Interrupted, match="^interrupted before anything was measured: nothing was written$"):
        controller.run(cfg)
    assert "loopbench: SIGTERM received: the run ends before its first child" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() or list((tmp_path / "r").iterdir()) == []
    assert not (tmp_path / "c").exists()      # nor was the checkpoint synthesized


def test_a_stop_while_a_resume_changes_its_bundle_publishes_it_again_as_stopped(stopped, dirs, tmp_path,
                                                                                monkeypatch):
    """SIGTERM after the resume's checks, as it unpublishes the bundle: recorded, no session starts, and the bundle
    is published again, incomplete and stopped, with every record it had."""
    from loopbench.harness import evidence as evidence_mod

    bundle = _copy(stopped["bundle"], tmp_path / "b")
    records = sorted(p.name for p in (bundle / "raw" / "cpu0").glob("*.json"))
    unpublish = evidence_mod.unpublish

    def unpublish_then_signal(path):
        unpublish(path)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(evidence_mod, "unpublish", unpublish_then_signal)
    summary = _resume(dirs, bundle).summary
    assert summary["status"] == "incomplete" and {"code": "stopped", "by": "SIGTERM"} in summary["incomplete_reasons"]
    assert (bundle / "manifest.json").is_file() and audit(bundle)["status"] == "incomplete"
    kept = sorted(p.name for p in (bundle / "raw" / "cpu0").glob("*.json"))
    aside = sorted(p.name for p in (bundle / "superseded" / "cpu0" / "raw" / "cpu0").glob("*.json"))
    assert sorted(kept + aside) == records and len(aside) == len(records) % 2   # a lone arm kept as superseded


def test_an_interrupted_checkpoint_synthesis_leaves_no_copy_in_the_cache(tmp_path, monkeypatch):
    from loopbench.harness import fixtures

    def half_written(path, *args, **kwargs):
        (Path(path) / "model.safetensors").parent.mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(fixtures, "write_calibrated_checkpoint", half_written)
    spec = conf.validate(conf.compose("cpu-smoke", [f"cache_dir={tmp_path / 'c'}"]))
    with pytest.raises(KeyboardInterrupt):
        inputs.prepare_checkpoint(spec, tmp_path / "c")
    assert [p for p in (tmp_path / "c").rglob("*") if p.is_file()] == []


def test_a_checkpoint_another_run_wrote_first_is_used(tmp_path, monkeypatch):
    """Two runs synthesizing the same preset at once: the second one's rename finds the folder taken; it uses it."""
    from loopbench.harness import fixtures

    spec = conf.validate(conf.compose("cpu-smoke", [f"cache_dir={tmp_path / 'c'}"]))
    write = fixtures.write_calibrated_checkpoint

    def written_twice(path, *args, **kwargs):
        write(inputs.synthetic_checkpoint_path(spec, tmp_path / "c"), *args, **kwargs)   # the other run
        return write(path, *args, **kwargs)

    monkeypatch.setattr(fixtures, "write_calibrated_checkpoint", written_twice)
    entry = inputs.prepare_checkpoint(spec, tmp_path / "c")
    assert Path(entry["path"]) == inputs.synthetic_checkpoint_path(spec, tmp_path / "c")
    assert [p.name for p in Path(entry["path"]).parent.iterdir()] == [Path(entry["path"]).name]   # no temp copy


def test_the_auditor_interrupted_writes_nothing_and_exits_130(stopped, tmp_path, monkeypatch, capsys):
    from loopbench.audit import __main__ as audit_main, auditor

    copy = tmp_path / stopped["bundle"].name
    shutil.copytree(stopped["bundle"], copy)
    (copy / "audit.json").unlink(missing_ok=True)

    def interrupted(bundle):
        raise KeyboardInterrupt

    monkeypatch.setattr(auditor, "audit", interrupted)
    assert audit_main.main([str(copy)]) == 130
    assert capsys.readouterr().err == "audit interrupted: no verdict written\n"
    assert not (copy / "audit.json").exists()


@pytest.fixture
def plan(dirs, capsys, monkeypatch, tmp_path):
    """``loopbench plan`` of a resume of a bundle, in-process: (exit status, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)   # where Hydra would leave outputs/, were it to write any

    def run(bundle: Path, *extra: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli.main(["plan", "--config-name", "cpu-smoke", *_overrides(dirs), f"resume={bundle}", *extra])
        return rc, *capsys.readouterr()
    return run


FOLLOWING = "(and in 4 field(s) of the plan that follow from the config)"   # order, config_sha256, detectable effect


@pytest.mark.parametrize("override, named", [
    # a config key is named alone, with a count of the plan's fields that follow from it
    ("pairs=7", ["differs from its plan in config.pairs (bundle 6, this run 7) " + FOLLOWING]),
    ("workload.prompt_seed=2", ["config.workload.prompt_seed (bundle 1, this run 2)"]),
    ("model.seed=1", ["config.model.seed (bundle 0, this run 1)", "checkpoint.sha256"]),   # a hash is always named
    ("reuse_references=false", ["config.reuse_references (bundle true, this run false)"]),
    # torch's threads change what a CPU session measures, unlike the limits a resume may change
    ("executor.cpu_threads=2", ["config.executor.cpu_threads (bundle 1, this run 2)"]),
    (None, ["code.code_sha256"]),
    # a changed config key does not hide a difference that does not follow from it
    ("pairs=7 code", ["in code.code_sha256 (bundle ", "); config.pairs (bundle 6, this run 7) " + FOLLOWING]),
])
def test_resume_refuses_a_different_plan_naming_what_differs(stopped, dirs, tmp_path, monkeypatch, plan, override,
                                                             named):
    bundle = _copy(stopped["bundle"], tmp_path / "b")
    before = _tree(bundle)
    if override is None or override.endswith(" code"):   # the runtime sources changed since the bundle was planned
        ident = identity.code_identity()
        monkeypatch.setattr(inputs, "code_identity", lambda: {**ident, "code_sha256": "0" * 64})
        override = override and override.removesuffix(" code")
    with pytest.raises(ValueError, match="this run differs from its plan in") as err:
        _resume(dirs, bundle, *([override] if override else []))
    assert all(part in str(err.value) for part in named), str(err.value)
    assert _tree(bundle) == before    # refused before anything was changed or measured
    # `loopbench plan` refuses it as bench does (exit 2, bench's line), and changes nothing either
    rc, out, err_text = plan(bundle, *([override] if override else []))
    assert rc == 2 and out == "", out
    assert [line for line in err_text.splitlines() if "bad configuration" in line] == \
        [f"loopbench: bad configuration: {err.value}"]
    assert _tree(bundle) == before and list(tmp_path.iterdir()) == [bundle]


def test_plan_of_a_resume_says_what_it_would_keep_and_measure_and_changes_nothing(stopped, dirs, tmp_path, plan):
    bundle = _copy(stopped["bundle"], tmp_path / "b")
    seqs = sorted(json.loads(p.read_text())["seq"] for p in (bundle / "raw" / "cpu0").glob("*.json"))
    kept = len(seqs) // 2 * 2     # whole pairs; a lone last arm is discarded and measured again
    lone = sorted((bundle / "raw" / "cpu0").glob("*.json"))[kept:]
    before, cache = _tree(bundle), sorted(dirs["cache"].rglob("*"))
    rc, out, err = plan(bundle)
    assert rc == 0, err
    assert seqs == list(range(len(seqs))) and 2 <= kept < 12
    assert f"  resume: {bundle.resolve()} (published incomplete); this run's plan and environment are" in out
    assert f"  resume keeps {kept} of 12 arms, {12 - kept} to measure (cpu0 seqs {kept}-11)," in out
    assert (f"resume keeps 1 lone record (of a pair whose other arm was not recorded, measured again) as superseded, "
            f"out of every figure: raw/cpu0/{lone[0].name} -> superseded/cpu0/raw/cpu0/{lone[0].name}" if lone
            else "resume supersedes no records") in out
    assert "measurement order" not in out and "checkpoint not compared" not in out
    assert "  model: " in out and "  points: B2/C3" in out and "  detectable effect: " in out
    assert _tree(bundle) == before and sorted(dirs["cache"].rglob("*")) == cache
    assert list(tmp_path.iterdir()) == [bundle]

    # the checkpoint missing from the cache: plan writes none, and says it did not compare it
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    (dirs["cache"] / "checkpoints").rename(shelf / "checkpoints")
    try:
        rc, out, err = plan(bundle)
        assert not (dirs["cache"] / "checkpoints").exists()
    finally:
        (shelf / "checkpoints").rename(dirs["cache"] / "checkpoints")
    assert rc == 0, err
    assert "checkpoint not compared yet" in out and f"  resume keeps {kept} of 12 arms" in out
    assert _tree(bundle) == before


def test_a_resume_runs_its_sessions_under_its_own_timeouts(stopped, dirs, tmp_path, monkeypatch, plan, capsys):
    """A resume refused a changed executor.session_timeout_s like any change to the plan, so a session killed at the
    bundle's timeout before its first arm (a slower machine) was killed there again on every resume, and only a new
    run, losing every record, could raise it. A limit changes no measurement: the resume's children run under its own,
    plan.json keeps the first run's, and plan and bench name the change."""
    from loopbench.harness import resume

    bundle = _copy(stopped["bundle"], tmp_path / "b")
    limits = ["executor.session_timeout_s=1234", "executor.reference_timeout_s=99", "executor.stop_grace_s=7",
              "executor.slurm.time_limit_min=30"]
    rc, out, err = plan(bundle, *limits)
    assert rc == 0, err
    assert "  resume runs its children under executor.session_timeout_s = 1234.0 (the plan's 900.0) (a limit " \
           "changes no measurement)" in out, out
    assert "under executor.stop_grace_s = 7.0 (the plan's 5.0)" in out and "reference_timeout_s = 99.0" in out
    assert "under executor.slurm.time_limit_min = 30 (the plan's None)" in out
    seen = []

    def no_sessions(ex, *args, **kwargs):   # what the resume's children would run under; none is started
        seen.append((ex.session_timeout_s, ex.reference_timeout_s, ex.stop_grace_s))
        return []
    monkeypatch.setattr(resume, "run_restarts", no_sessions)
    planned = (bundle / "plan.json").read_bytes()
    monkeypatch.delenv("LOOPBENCH_QUIET", raising=False)
    capsys.readouterr()
    _resume(dirs, bundle, *limits)
    assert seen == [(1234.0, 99.0, 7.0)]
    assert (bundle / "plan.json").read_bytes() == planned
    out, err = capsys.readouterr()
    # progress lines, on stderr as every other loopbench: progress line (they were on stdout)
    assert "loopbench: resume: this resume's children run under executor.session_timeout_s = 1234.0 (the plan's " \
           "900.0); a limit changes no measurement" in err, err
    assert f"loopbench: resume: {bundle} (run 1): " in err and "loopbench: resum" not in out, out


def test_resume_refuses_a_bundle_in_use_and_a_folder_without_plan(stopped, dirs, tmp_path, plan):
    from loopbench.harness import evidence

    bundle = _copy(stopped["bundle"], tmp_path / "b")
    lock = evidence.try_lock(bundle)   # as a live controller holds it
    try:
        with pytest.raises(ValueError, match="held by a running controller"):
            _resume(dirs, bundle)
        rc, out, err = plan(bundle)    # the plan of that resume says what the resume would (a new user's find)
        assert rc == 2 and "held by a running controller" in err and "resume keeps" not in out, (out, err)
    finally:
        os.close(lock)
    assert plan(bundle)[0] == 0        # let go: the plan of the resume is shown
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no plan.json"):
        _resume(dirs, empty)


def test_resume_refuses_a_published_bundle_whose_files_changed(stopped, dirs, tmp_path):
    """A raw record edited after publishing (a forged elapsed_s) must not be re-published as measured: the
    resume checks the manifest first and changes nothing (found by a breaker run: it passed the audit)."""
    bundle = _copy(stopped["bundle"], tmp_path / "b")
    rec = sorted((bundle / "raw" / "cpu0").glob("*.json"))[0]
    data = json.loads(rec.read_text())
    data["measured"]["elapsed_s"] /= 2
    rec.write_text(json.dumps(data))
    before = _tree(bundle)
    with pytest.raises(ValueError, match=f"no longer match its manifest.json \\(raw/cpu0/{rec.name} changed\\)"):
        _resume(dirs, bundle)
    assert _tree(bundle) == before
    rec.unlink()
    with pytest.raises(ValueError, match=f"raw/cpu0/{rec.name} is missing"):
        _resume(dirs, bundle)


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_a_stop_while_a_resume_checks_its_bundle_changes_nothing(stopped, dirs, tmp_path, monkeypatch, how):
    """The resume's checks (inputs, checkpoint synthesis, hashes) come before it changes the bundle: a stop there
    ends it at once, the bundle as it was."""
    from loopbench.harness import resume

    bundle = _copy(stopped["bundle"], tmp_path / "b")
    before = _tree(bundle)
    monkeypatch.setattr(resume, "_check", _signalled(how))
    with pytest.raises(controller.Interrupted, match="for the resume: the bundle is unchanged"):
        _resume(dirs, bundle)
    assert _tree(bundle) == before


def test_a_resume_whose_cache_folder_cannot_be_made_is_refused_and_changes_nothing(stopped, dirs, tmp_path,
                                                                                  monkeypatch):
    """A resume writes a missing synthetic checkpoint into the cache while it checks the bundle; a cache folder it
    cannot make (below /proc here, with os.access made to pass as for root) was a traceback from that mkdir."""
    from loopbench.harness import rules

    bundle = _copy(stopped["bundle"], tmp_path / "b")
    before = _tree(bundle)
    monkeypatch.setattr(rules.os, "access", lambda *args, **kwargs: True)
    with pytest.raises(controller.BundleFolderError) as err:
        _resume(dirs, bundle, "cache_dir=/proc/loopbench-no-such/c")
    assert str(err.value).startswith("cache_dir = '/proc/loopbench-no-such/c': cannot make the cache folder there (")
    assert str(err.value).endswith(f"); {bundle} is unchanged"), str(err.value)
    assert _tree(bundle) == before
