"""Executors: run child jobs (one per device) and report each one's exit code, state and wall time.

- :class:`LocalExecutor` starts ``python -m loopbench.harness.session JOB.json`` per job, pinned to one
  GPU with ``CUDA_VISIBLE_DEVICES`` (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so CUDA, NVML and the plan count
  GPUs alike), or with no GPU visible for a CPU job (a simulated CPU device's also pinned by
  ``LOOPBENCH_CPU_DEVICE``); all of a round's jobs run at once; output goes to the job's log file.
- :class:`SubmititExecutor` submits the same job function through submitit: to SLURM (``sbatch``; CI
  runs it against a single-node cluster on localhost, ``.ci/slurm``), or to submitit's ``local`` /
  ``debug`` executors.

Both call ``progress()`` while waiting and never raise for a failed child: a failure is a result,
recorded in ``children.json`` and turning the run incomplete. A local process past its timeout is
killed and marked ``timeout``; a SLURM job ends by SLURM's own time limit, and its SLURM state names its
child's state (harness/slurm.py: ``timeout``, ``cancelled`` for an ``scancel`` by someone else,
``node_failure``). Exit codes: the process's own (negative = killed by that signal) where it is known;
for a SLURM job SLURM's ``ExitCode`` in the same convention; for a submitit local job that is not our
process, 0 on success and 1 otherwise; None where there is none (harness/exit_status.py defines the form
and words it: "exit code 1", "killed by SIGTERM (15)", "never started").

Stopping (issue 8, item 4): a local child runs in its own session and process group, so a terminal's
Ctrl-C reaches only the controller, which decides. While waiting, the executor asks ``stop()``; once
it names a reason (the signal the controller received), every running child's process group gets
SIGTERM, then SIGKILL after ``grace_s`` seconds (and SIGKILL in any case, for stray grandchildren);
those children, and any not started yet, are results of state ``interrupted`` with
``interrupted_by`` = the reason.
"""
from __future__ import annotations

import contextlib
import io
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

from . import slurm
from .machine import CPU_DEVICE_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent
SLURM_POLL_S = 2.0   # the least time between two scontrol queries of one job (slurmctld serves everyone)


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
    cpu_index: int | None = None  # a simulated CPU device (executor.cpu_devices > 1); None: any other job

    @property
    def session_id(self) -> str:
        return self.session or self.name


@dataclass(frozen=True)
class ChildResult:
    name: str
    device: str
    exit_code: int | None      # negative: killed by that signal; None: none (harness/exit_status.py)
    state: str                 # completed | failed | killed | timeout | interrupted | cancelled | node_failure
                               # (| running, unpublished)
    wall_s: float | None       # None where unknown
    log: str
    session: str | None = None
    attempt: int = 0
    interrupted_by: str | None = None  # SIGTERM / SIGINT (the controller stopped it) or "lost" (controller died)
    slurm: dict | None = None          # a SLURM job's record (harness/slurm.py record); None for any other child

    def to_dict(self) -> dict:
        out = {"name": self.name, "device": self.device, "exit_code": self.exit_code, "state": self.state,
               "wall_s": self.wall_s, "log": self.log, "session": self.session or self.name,
               "attempt": self.attempt, "interrupted_by": self.interrupted_by}
        return out if self.slurm is None else {**out, "slurm": self.slurm}


def _result(spec: ChildSpec, exit_code: int | None, state: str, wall_s: float | None,
            interrupted_by: str | None = None, slurm: dict | None = None) -> ChildResult:
    return ChildResult(spec.name, spec.device_label, exit_code, state, wall_s, spec.log_file.name, spec.session_id,
                       spec.attempt, interrupted_by, slurm)


def running_result(spec: ChildSpec) -> ChildResult:
    """The entry ``children.json`` holds while a child runs, so that ``finish`` can tell it was started."""
    return _result(spec, None, "running", None)


def _not_started(spec: ChildSpec, reason: str) -> ChildResult:
    spec.log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_file, "a") as fh:
        fh.write(f"[controller] {spec.session_id} not started: the controller received {reason}\n")
    return _result(spec, None, "interrupted", None, reason)


# how often the wait between two polls looks for a stop request
STOP_CHECK_S = 0.05


def _wait_unless_stopped(seconds: float, stop: Callable[[], str | None]) -> None:
    """Wait ``seconds`` (``executor.poll_s``) or until ``stop()`` reports a signal. A signal handler cannot end a
    ``time.sleep`` (PEP 475 resumes it), so a Ctrl-C that came during one plain sleep of poll_s was acted on only
    after it: the children measured on, unstopped, for up to poll_s."""
    deadline = time.monotonic() + seconds
    while not stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, STOP_CHECK_S))


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's whole process group (its pid: it was started in a new session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def child_env(gpu_index: int | None, cpu_index: int | None = None) -> dict:
    """A child's environment: the repo importable, unbuffered output, pinned to physical GPU ``gpu_index``
    (PCI bus order) or to none; a simulated CPU device's child also gets its index in ``LOOPBENCH_CPU_DEVICE``."""
    env = dict(os.environ)
    env.pop(CPU_DEVICE_ENV, None)   # never inherited: only the executor pins a child to a simulated device
    if cpu_index is not None:
        env[CPU_DEVICE_ENV] = str(cpu_index)
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


class SubmissionFailed(RuntimeError):
    """A child's job could not be submitted (``sbatch`` failed: no controller to contact, a bad partition or account;
    or no SLURM here at all): the child never started. The message names ``executor.kind=slurm``, the child and
    sbatch's own error, on one line. Raised, not recorded as a result: a child without a job has no state the bundle
    format gives a SLURM child (the auditor requires its job), so the controller decides (harness/controller.py)."""


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
                env = {**child_env(spec.gpu_index, spec.cpu_index), "LOOPBENCH_CONTROLLER_PID": str(os.getpid())}
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
                    _wait_unless_stopped(poll_s, stop)
        except BaseException:
            # a bug or an unforeseen exception in the controller must not orphan a measuring child
            self._stop([p for p in procs if p[0].session_id not in results], "an error in the controller", 0.0)
            raise
        return [results[spec.session_id] for spec in specs]

    @staticmethod
    def _stop(running: list[tuple], reason: str, grace_s: float) -> dict[str, ChildResult]:
        """SIGTERM every running child's group, wait up to ``grace_s`` s, then SIGKILL the groups. A child that
        exits 0 ended on its own with its job done (a session stopped by the signal ends by it, -15; the job file's
        arms all recorded): it is ``completed``, not ``interrupted``, and so is any child that had ended before the
        stop, in its own state. They had been marked interrupted by the stop when it came between a child's last
        record and the controller's next poll, which made a bundle of every planned arm incomplete."""
        ended = {spec.session_id for spec, proc, _, _ in running if proc.poll() is not None}
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
            if code == 0 or spec.session_id in ended:
                out[spec.session_id] = _result(spec, code, _state(code), time.monotonic() - t0)
            else:
                out[spec.session_id] = _result(spec, code, "interrupted", time.monotonic() - t0, reason)
        return out


class SubmititExecutor:
    """One submitit job per spec: ``cluster`` None = SLURM, or submitit's ``local`` / ``debug``.

    On SLURM, job states come from ``scontrol`` (harness/slurm.py, no accounting database needed): an
    ended job's SLURM state names its child's state (``TIMEOUT`` -> ``timeout``, ``CANCELLED`` ->
    ``cancelled``, ``NODE_FAIL`` -> ``node_failure``...) and its entry carries the job's ``slurm`` record
    (id, state, reason, nodes, partition, the SLURM environment it saw). SLURM enforces the time limit;
    the controller cancels a job only on a stop (``interrupted``) or when scontrol has lost it.
    """

    def __init__(self, folder: Path, slurm_conf: dict, use_gpus: bool):
        self.folder, self.slurm, self.use_gpus = Path(folder), slurm_conf, use_gpus
        self.cluster = slurm_conf.get("cluster") or "slurm"

    def _executor(self, timeout_s: float):
        import submitit

        ex = submitit.AutoExecutor(folder=str(self.folder / "%j"), cluster=self.cluster)
        if self.cluster == "slurm":
            env = child_env(0 if self.use_gpus else None)
            keys = ["PYTHONPATH", "CUDA_DEVICE_ORDER", "PYTHONUNBUFFERED"]
            keys += [] if self.use_gpus else ["CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET"]  # SLURM sets a GPU job's
            ex.update_parameters(**slurm.sbatch_parameters(self.slurm, timeout_s, self.use_gpus,
                                                           {k: env[k] for k in keys}))
        else:
            ex.update_parameters(timeout_min=max(1, math.ceil(timeout_s / 60)), nodes=1, tasks_per_node=1,
                                 cpus_per_task=self.slurm["cpus_per_task"],
                                 gpus_per_node=self.slurm["gpus_per_task"] if self.use_gpus else 0)
        return ex

    def _submit(self, spec: ChildSpec):
        """The submitted job; :class:`SubmissionFailed` naming sbatch's error (submitit's FailedJobError, which it also
        prints to stderr: kept out, as the message carries it) or submitit's own (no ``srun``: no SLURM here)."""
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                if self.cluster != "slurm":
                    from .session import run_job

                    return self._executor(spec.timeout_s).submit(run_job, str(spec.job_file))
                return self._executor(spec.timeout_s).submit(slurm.run_in_job, str(spec.job_file),
                                                             str(self._environment_file(spec)))
        except (RuntimeError, OSError) as exc:   # submitit's FailedJobError is a RuntimeError
            why = " ".join((str(exc) or said.getvalue() or type(exc).__name__).split())
            kind = "executor.kind=slurm" + (f" (executor.slurm.cluster={self.cluster})" if self.cluster != "slurm" else "")
            raise SubmissionFailed(f"{kind}: the {spec.session_id} job could not be submitted: {why}") from None

    def _environment_file(self, spec: ChildSpec) -> Path:
        return self.folder / f"{spec.session_id}.slurm-environment.json"

    def run(self, specs: list[ChildSpec], progress: Callable[[], None] | None = None, poll_s: float = 0.5,
            stop: Callable[[], str | None] | None = None, grace_s: float = 10.0) -> list[ChildResult]:
        stop = stop or (lambda: None)
        os.environ["PYTHONPATH"] = child_env(None)["PYTHONPATH"]   # submitit's local children inherit it
        jobs, results = [], {}
        try:   # a submission that fails cancels the jobs of this round submitted before it (SubmissionFailed)
            for spec in specs:
                if stop():
                    results[spec.session_id] = _not_started(spec, stop())
                    continue
                jobs.append(_Job(spec, self._submit(spec), time.monotonic()))
            while len(results) < len(specs):
                reason = stop()
                for job in jobs:
                    if job.spec.session_id not in results:
                        got = self._poll_slurm(job, reason, grace_s) if self.cluster == "slurm" else \
                            self._poll_local(job, reason)
                        if got is not None:
                            results[job.spec.session_id] = got
                if progress:
                    progress()
                if len(results) < len(specs):
                    _wait_unless_stopped(poll_s, stop)
        except BaseException:
            for job in jobs:  # an error in the controller must not leave a job measuring on the cluster
                if job.spec.session_id not in results:
                    job.job.cancel(check=False)
            raise
        if any(r.slurm is not None and r.state != "completed" for r in results.values()):
            slurm.wait_for_job_processes(jobs[0].spec.job_file.parent, grace_s + 30)
        return [results[spec.session_id] for spec in specs]

    def _poll_local(self, job: "_Job", reason: str | None) -> ChildResult | None:
        """submitit's ``local`` / ``debug`` job: done, or past its timeout or stopped (then cancelled)."""
        spec, elapsed = job.spec, time.monotonic() - job.t0
        if self.cluster == "debug" or job.job.done():
            return self._result(spec, job.job, elapsed)
        if reason or elapsed > spec.timeout_s:
            job.job.cancel(check=False)  # a local job gets SIGINT
            self._copy_log(spec, job.job)
            return _result(spec, _exit_code(job.job, 1), "interrupted" if reason else "timeout", elapsed, reason)
        return None

    def _poll_slurm(self, job: "_Job", reason: str | None, grace_s: float) -> ChildResult | None:
        """A SLURM job: its result once scontrol says it ended (asked at most every
        :data:`SLURM_POLL_S`); on a stop it is cancelled (``scancel``) and waited for up to ``grace_s`` +
        60 s; a job that scontrol cannot tell of for 60 s is cancelled and recorded as failed."""
        now = time.monotonic()
        if reason and job.cancelled_at is None:
            job.job.cancel(check=False)
            job.cancelled_at = now
        elif now - job.polled_at < SLURM_POLL_S:
            return None
        job.polled_at, info = now, slurm.job_info(job.job.job_id)
        if info is not None:
            job.info, job.unknown_since = info, None
            ended = slurm.child_state(info["JobState"])
        else:  # scontrol forgot an ended job (MinJobAge) or does not answer; a result file still tells
            job.unknown_since = job.unknown_since or now
            ended = "completed" if Path(job.job.paths.result_pickle).exists() else None
        lost = job.unknown_since is not None and now - job.unknown_since > 60
        gave_up = job.cancelled_at is not None and now - job.cancelled_at > grace_s + 60
        if ended is None and not lost and not gave_up:
            return None
        if ended is None:
            job.job.cancel(check=False)
        return self._slurm_result(job, reason, ended, now - job.t0)

    def _slurm_result(self, job: "_Job", reason: str | None, ended: str | None, elapsed: float) -> ChildResult:
        spec = job.spec
        code = slurm.exit_code(job.info) if job.info else None
        state = "interrupted" if reason else (ended or "failed")
        if state == "completed" and Path(job.job.paths.result_pickle).exists():
            done = self._result(spec, job.job, elapsed)   # the job function's own return code
            code, state = done.exit_code, done.state
        else:
            state = "failed" if state == "completed" else state   # COMPLETED without a result: not ours
            self._copy_log(spec, job.job)
        record = slurm.record(job.job.job_id, job.info if ended else None,
                              slurm.read_environment(self._environment_file(spec)))
        with open(spec.log_file, "a") as fh:
            fh.write(f"\n[slurm] job {record['job_id']} ended {record['job_state']} (reason {record['reason']}) "
                     f"on {record['nodes']}: child {state}\n")
        return _result(spec, code, state, elapsed, reason, slurm=record)

    def _result(self, spec: ChildSpec, job, elapsed: float) -> ChildResult:
        try:
            code = int(job.result())
        except Exception as exc:  # the child's failure is recorded, not raised
            code = _exit_code(job, 1)
            spec.log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(spec.log_file, "a") as fh:
                fh.write(f"\n[submitit] job {job.job_id}: {type(exc).__name__}: {exc}\n")
        self._copy_log(spec, job)
        return _result(spec, code, _state(code), elapsed)

    @staticmethod
    def _copy_log(spec: ChildSpec, job) -> None:
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        for path in (getattr(job.paths, "stdout", None), getattr(job.paths, "stderr", None)):
            if path is not None and Path(path).is_file():
                with open(spec.log_file, "ab") as out, open(path, "rb") as src:
                    shutil.copyfileobj(src, out)


@dataclass
class _Job:
    """A submitted job and what the executor has learnt about it so far."""

    spec: ChildSpec
    job: object                       # a submitit Job
    t0: float                         # time.monotonic() at submission
    info: dict | None = None          # scontrol's latest fields (SLURM)
    polled_at: float = -math.inf       # time.monotonic() of the latest scontrol query
    unknown_since: float | None = None
    cancelled_at: float | None = None


def _exit_code(job, default: int) -> int:
    """The local process's return code where submitit ran one (LocalJob), else ``default``."""
    proc = getattr(job, "_process", None)
    code = getattr(proc, "returncode", None)
    return int(code) if code is not None and code != 0 else default


class StopSignals:
    """While the controller runs (or may run) children, SIGTERM and SIGINT (Ctrl-C) become a stop request (issue 8,
    item 4).

    The handler only records the first signal's name; the executors poll it (``stop()``), stop their
    children, and the controller then publishes an incomplete bundle. Later signals are ignored: the stop
    is bounded by ``executor.stop_grace_s`` and publishing takes seconds. Outside the main thread (where
    Python cannot install handlers) it never fires. The previous handlers come back on exit.
    ``before_children``: no child has started yet (the controller enters it before gathering its inputs, under
    :func:`stops_at_once` for the long stages), so a recorded stop ends the run before any child. ``publishing``: every
    child has ended; a stop then ends the command once the bundle is written, before its audit.
    """

    def __init__(self, before_children: bool = False) -> None:
        self.signal: str | None = None
        self.before_children = before_children
        self.publishing = False   # every child has ended and the bundle is being written
        self._previous: dict = {}

    def __call__(self) -> str | None:
        return self.signal

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            what = ("the run ends before its first child" if self.before_children else
                    "publishing the bundle of what was measured, then ending without its audit" if self.publishing
                    else "stopping the children, then publishing the bundle of what they recorded (incomplete "
                    "unless they had recorded every planned arm)")
            print(f"\nloopbench: {self.signal} received: {what}", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


@contextlib.contextmanager
def stops_held():
    """SIGTERM and SIGINT held until the block ends, then raised as one KeyboardInterrupt: for code that a
    KeyboardInterrupt cannot land in cleanly, which is short (importing torch and triton, composing a
    configuration). Landing inside a native module's initialisation aborts the interpreter (triton's nanobind
    extension: ``terminate called ... nanobind::python_error``, SIGABRT); inside OmegaConf it is replaced by a
    secondary AttributeError, which read as a bad configuration. A signal ignored on entry (SIG_IGN, as a shell's background job starts) stays
    ignored. Outside the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, lambda signum, frame: came.append(signum))
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if came:
        raise KeyboardInterrupt


@contextlib.contextmanager
def stops_at_once():
    """While no child runs (inputs, checkpoint synthesis, calibration, the final audit), SIGTERM and SIGINT (Ctrl-C)
    raise KeyboardInterrupt at once: there is nothing to stop and, before the plan, nothing measured to publish. The
    handlers before it (Python's own, or :class:`StopSignals`' when nested in it) come back on exit. Outside the
    main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    try:   # filled one signal at a time inside the try: a signal between the two still finds the first restored
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, signal.default_int_handler)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
