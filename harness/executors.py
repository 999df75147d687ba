"""Executors: run child jobs (one per device) and report each one's exit code, state and wall time.

- :class:`LocalExecutor` starts ``python -m loopbench.harness.session JOB.json`` per job, pinned to one
  GPU with ``CUDA_VISIBLE_DEVICES`` (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so CUDA, NVML and the plan count
  GPUs alike), or with no GPU visible for a CPU job; output goes to the job's log file.
- :class:`SubmititExecutor` submits the same job function through submitit (Slurm, or submitit's
  ``local`` / ``debug`` executors, which is how CI tests this path without a cluster).

Both wait with a per-job timeout (a job past it is killed or cancelled and marked ``timeout``), call
``progress()`` while waiting, and never raise for a failed child: a failure is a result, recorded in
``children.json`` and turning the run incomplete. Exit codes: the process's own (negative = killed by
that signal) where it is known; for a submitit job that is not a local process, 0 on success and 1
otherwise, with submitit's state beside it.

Stopping (issue 8, item 4): a local child runs in its own session and process group, so a terminal's
Ctrl-C reaches only the controller, which decides. While waiting, the executor asks ``stop()``; once
it names a reason (the signal the controller received), every running child's process group gets
SIGTERM, then SIGKILL after ``grace_s`` seconds (and SIGKILL in any case, for stray grandchildren);
those children, and any not started yet, are results of state ``interrupted`` with
``interrupted_by`` = the reason.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ChildSpec:
    name: str
    job_file: Path
    log_file: Path
    gpu_index: int | None      # physical GPU for a local job; None: CPU, or whatever Slurm grants
    device_label: str
    timeout_s: float
    session: str | None = None  # unique id in the bundle (default: ``name``; a resume's are ``<name>.r<k>``)
    attempt: int = 0            # which controller run of the bundle started it: 0 first, k the k-th resume

    @property
    def session_id(self) -> str:
        return self.session or self.name


@dataclass(frozen=True)
class ChildResult:
    name: str
    device: str
    exit_code: int | None      # None: never started, or its end is unknown (the controller died first)
    state: str                 # completed | failed | killed | timeout | interrupted (| running, unpublished)
    wall_s: float | None       # None where unknown
    log: str
    session: str | None = None
    attempt: int = 0
    interrupted_by: str | None = None  # SIGTERM / SIGINT (the controller stopped it) or "lost" (controller died)

    def to_dict(self) -> dict:
        return {"name": self.name, "device": self.device, "exit_code": self.exit_code, "state": self.state,
                "wall_s": self.wall_s, "log": self.log, "session": self.session or self.name,
                "attempt": self.attempt, "interrupted_by": self.interrupted_by}


def _result(spec: ChildSpec, exit_code: int | None, state: str, wall_s: float | None,
            interrupted_by: str | None = None) -> ChildResult:
    return ChildResult(spec.name, spec.device_label, exit_code, state, wall_s, spec.log_file.name, spec.session_id,
                       spec.attempt, interrupted_by)


def running_result(spec: ChildSpec) -> ChildResult:
    """The entry ``children.json`` holds while a child runs, so that ``finish`` can tell it was started."""
    return _result(spec, None, "running", None)


def _not_started(spec: ChildSpec, reason: str) -> ChildResult:
    spec.log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_file, "a") as fh:
        fh.write(f"[controller] {spec.session_id} not started: the controller received {reason}\n")
    return _result(spec, None, "interrupted", None, reason)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's whole process group (its pid: it was started in a new session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def child_env(gpu_index: int | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["PYTHONUNBUFFERED"] = "1"
    if gpu_index is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("TRITON_INTERPRET", "1")   # a CPU job can only run Triton kernels interpreted
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_index)
    return env


def _state(code: int | None) -> str:
    if code == 0:
        return "completed"
    return "killed" if code is not None and code < 0 else "failed"


class LocalExecutor:
    """One subprocess per job on this host, each the leader of its own process group."""

    def run(self, specs: list[ChildSpec], progress: Callable[[], None] | None = None, poll_s: float = 0.5,
            stop: Callable[[], str | None] | None = None, grace_s: float = 10.0) -> list[ChildResult]:
        stop = stop or (lambda: None)
        procs, results = [], {}
        try:
            for spec in specs:
                if stop():
                    results[spec.session_id] = _not_started(spec, stop())
                    continue
                spec.log_file.parent.mkdir(parents=True, exist_ok=True)
                log = open(spec.log_file, "ab")
                env = {**child_env(spec.gpu_index), "LOOPBENCH_CONTROLLER_PID": str(os.getpid())}
                proc = subprocess.Popen([sys.executable, "-m", "loopbench.harness.session", str(spec.job_file)],
                                        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT),
                                        start_new_session=True)
                procs.append((spec, proc, log, time.monotonic()))
            while len(results) < len(specs):
                running = [p for p in procs if p[0].session_id not in results]
                reason = stop()
                if reason:
                    results.update(self._stop(running, reason, grace_s))
                    break
                for spec, proc, log, t0 in running:
                    code = proc.poll()
                    elapsed = time.monotonic() - t0
                    if code is None and elapsed > spec.timeout_s:
                        _signal_group(proc, signal.SIGKILL)
                        results[spec.session_id] = _result(spec, proc.wait(), "timeout", elapsed)
                    elif code is not None:
                        _signal_group(proc, signal.SIGKILL)   # whatever it left behind in its group
                        results[spec.session_id] = _result(spec, code, _state(code), elapsed)
                    if spec.session_id in results:
                        log.close()
                if progress:
                    progress()
                if len(results) < len(specs):
                    time.sleep(poll_s)
        except BaseException:
            # a bug or an unforeseen exception in the controller must not orphan a measuring child
            self._stop([p for p in procs if p[0].session_id not in results], "an error in the controller", 0.0)
            raise
        return [results[spec.session_id] for spec in specs]

    @staticmethod
    def _stop(running: list[tuple], reason: str, grace_s: float) -> dict[str, ChildResult]:
        """SIGTERM every running child's group, wait up to ``grace_s`` s, then SIGKILL the groups."""
        for _, proc, _, _ in running:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc, _, _ in running:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
        out = {}
        for spec, proc, log, t0 in running:
            _signal_group(proc, signal.SIGKILL)
            code = proc.wait()
            log.close()
            out[spec.session_id] = _result(spec, code, "interrupted", time.monotonic() - t0, reason)
        return out


class SubmititExecutor:
    """One submitit job per spec: ``cluster`` None = Slurm, or submitit's ``local`` / ``debug``."""

    def __init__(self, folder: Path, slurm: dict, use_gpus: bool):
        self.folder, self.slurm, self.use_gpus = Path(folder), slurm, use_gpus

    def _executor(self, timeout_s: float):
        import submitit

        cluster = self.slurm.get("cluster") or "slurm"
        ex = submitit.AutoExecutor(folder=str(self.folder / "%j"), cluster=cluster)
        params = {"timeout_min": max(1, math.ceil(timeout_s / 60)), "cpus_per_task": self.slurm["cpus_per_task"],
                  "gpus_per_node": self.slurm["gpus_per_job"] if self.use_gpus else 0, "nodes": 1,
                  "tasks_per_node": 1}
        if cluster == "slurm":
            params["mem_gb"] = self.slurm["mem_gb"]
            if self.slurm.get("partition"):
                params["slurm_partition"] = self.slurm["partition"]
            if self.slurm.get("additional_parameters"):
                params["slurm_additional_parameters"] = dict(self.slurm["additional_parameters"])
        ex.update_parameters(**params)
        return ex

    def run(self, specs: list[ChildSpec], progress: Callable[[], None] | None = None, poll_s: float = 0.5,
            stop: Callable[[], str | None] | None = None, grace_s: float = 10.0) -> list[ChildResult]:
        from .session import run_job

        stop = stop or (lambda: None)
        os.environ["PYTHONPATH"] = child_env(None)["PYTHONPATH"]   # submitit's local children inherit it
        jobs, results = [], {}
        for spec in specs:
            if stop():
                results[spec.session_id] = _not_started(spec, stop())
                continue
            ex = self._executor(spec.timeout_s)
            jobs.append((spec, ex.submit(run_job, str(spec.job_file)), time.monotonic()))
        while len(results) < len(specs):
            reason = stop()
            for spec, job, t0 in jobs:
                if spec.session_id in results:
                    continue
                elapsed = time.monotonic() - t0
                if self.slurm.get("cluster") == "debug" or job.done():
                    results[spec.session_id] = self._result(spec, job, elapsed)
                elif reason or elapsed > spec.timeout_s:
                    job.cancel(check=False)  # scancel (Slurm); a local job gets SIGINT
                    results[spec.session_id] = _result(spec, _exit_code(job, 1), "interrupted" if reason else "timeout",
                                                       elapsed, reason)
                    self._copy_log(spec, job)
            if progress:
                progress()
            if len(results) < len(specs):
                time.sleep(poll_s)
        return [results[spec.session_id] for spec in specs]

    def _result(self, spec: ChildSpec, job, elapsed: float) -> ChildResult:
        try:
            code = int(job.result())
        except Exception as exc:  # the child's failure is recorded, not raised
            code = _exit_code(job, 1)
            spec.log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(spec.log_file, "a") as fh:
                fh.write(f"\n[submitit] job {job.job_id} state {job.state}: {type(exc).__name__}: {exc}\n")
        self._copy_log(spec, job)
        return _result(spec, code, _state(code), elapsed)

    @staticmethod
    def _copy_log(spec: ChildSpec, job) -> None:
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        for path in (getattr(job.paths, "stdout", None), getattr(job.paths, "stderr", None)):
            if path is not None and Path(path).is_file():
                with open(spec.log_file, "ab") as out, open(path, "rb") as src:
                    shutil.copyfileobj(src, out)


def _exit_code(job, default: int) -> int:
    """The local process's return code where submitit ran one (LocalJob), else ``default``."""
    proc = getattr(job, "_process", None)
    code = getattr(proc, "returncode", None)
    return int(code) if code is not None and code != 0 else default


class StopSignals:
    """While the controller has children, SIGTERM and SIGINT (Ctrl-C) become a stop request (issue 8, item 4).

    The handler only records the first signal's name; the executors poll it (``stop()``), stop their
    children, and the controller then publishes an incomplete bundle. Later signals are ignored: the stop
    is bounded by ``executor.stop_grace_s`` and publishing takes seconds. Outside the main thread (where
    Python cannot install handlers) it never fires. The previous handlers come back on exit.
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict = {}

    def __call__(self) -> str | None:
        return self.signal

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            print(f"\nloopbench: {self.signal} received: stopping the children, then publishing an incomplete "
                  "bundle", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
