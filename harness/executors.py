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
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
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


@dataclass(frozen=True)
class ChildResult:
    name: str
    device: str
    exit_code: int | None
    state: str                 # completed | failed | killed | timeout
    wall_s: float
    log: str

    def to_dict(self) -> dict:
        return {"name": self.name, "device": self.device, "exit_code": self.exit_code, "state": self.state,
                "wall_s": self.wall_s, "log": self.log}


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
    """One subprocess per job on this host."""

    def run(self, specs: list[ChildSpec], progress: Callable[[], None] | None = None,
            poll_s: float = 0.5) -> list[ChildResult]:
        procs = []
        for spec in specs:
            spec.log_file.parent.mkdir(parents=True, exist_ok=True)
            log = open(spec.log_file, "ab")
            proc = subprocess.Popen([sys.executable, "-m", "loopbench.harness.session", str(spec.job_file)],
                                    stdout=log, stderr=subprocess.STDOUT, env=child_env(spec.gpu_index),
                                    cwd=str(REPO_ROOT))
            procs.append((spec, proc, log, time.monotonic()))
        results: dict[str, ChildResult] = {}
        while len(results) < len(procs):
            for spec, proc, log, t0 in procs:
                if spec.name in results:
                    continue
                code = proc.poll()
                elapsed = time.monotonic() - t0
                if code is None and elapsed > spec.timeout_s:
                    proc.kill()
                    code = proc.wait()
                    results[spec.name] = ChildResult(spec.name, spec.device_label, code, "timeout", elapsed,
                                                     spec.log_file.name)
                elif code is not None:
                    results[spec.name] = ChildResult(spec.name, spec.device_label, code, _state(code), elapsed,
                                                     spec.log_file.name)
                if spec.name in results:
                    log.close()
            if progress:
                progress()
            if len(results) < len(procs):
                time.sleep(poll_s)
        return [results[spec.name] for spec, *_ in procs]


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

    def run(self, specs: list[ChildSpec], progress: Callable[[], None] | None = None,
            poll_s: float = 0.5) -> list[ChildResult]:
        from .session import run_job

        os.environ["PYTHONPATH"] = child_env(None)["PYTHONPATH"]   # submitit's local children inherit it
        jobs = []
        for spec in specs:
            ex = self._executor(spec.timeout_s)
            jobs.append((spec, ex.submit(run_job, str(spec.job_file)), time.monotonic()))
        results: dict[str, ChildResult] = {}
        while len(results) < len(jobs):
            for spec, job, t0 in jobs:
                if spec.name in results:
                    continue
                elapsed = time.monotonic() - t0
                if self.slurm.get("cluster") == "debug" or job.done():
                    results[spec.name] = self._result(spec, job, elapsed)
                elif elapsed > spec.timeout_s:
                    job.cancel(check=False)
                    results[spec.name] = ChildResult(spec.name, spec.device_label, _exit_code(job, 1), "timeout",
                                                     elapsed, spec.log_file.name)
                    self._copy_log(spec, job)
            if progress:
                progress()
            if len(results) < len(jobs):
                time.sleep(poll_s)
        return [results[spec.name] for spec, *_ in jobs]

    def _result(self, spec: ChildSpec, job, elapsed: float) -> ChildResult:
        try:
            code = int(job.result())
        except Exception as exc:  # the child's failure is recorded, not raised
            code = _exit_code(job, 1)
            spec.log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(spec.log_file, "a") as fh:
                fh.write(f"\n[submitit] job {job.job_id} state {job.state}: {type(exc).__name__}: {exc}\n")
        self._copy_log(spec, job)
        state = _state(code)
        return ChildResult(spec.name, spec.device_label, code, state, elapsed, spec.log_file.name)

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
