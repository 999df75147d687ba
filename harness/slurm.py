"""What SLURM says about a child's job, read without an accounting database, and the job's own side.

- :func:`job_info` asks ``scontrol show job`` (slurmctld keeps an ended job for ``MinJobAge`` seconds,
  300 by default). submitit's own watcher asks ``sacct``, which fails (and warns at every poll) on a
  cluster without slurmdbd, so the executor (harness/executors.py) polls this instead.
- :func:`child_state` maps a SLURM job state onto a child state through the contract
  (``documents.children.slurm_job_states`` of loopbench/bundle_format.json), so that the auditor
  derives the same state from the same record.
- :func:`run_in_job` is the function a SLURM job runs: it records the job's SLURM environment, then
  runs the child's job file (harness/session.py ``run_job``).
- :func:`sbatch_parameters` turns ``executor.slurm`` (harness/conf.py ``SlurmConf``) into submitit's.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from .fileio import bundle_format

# read through fileio, not harness/evidence.py: the job's interpreter (a session) loads no dataframe library
_CHILDREN = bundle_format()["documents"]["children"]
STATES: dict[str, str] = _CHILDREN["slurm_job_states"]
FIELDS = ("JobState", "Reason", "NodeList", "ExitCode", "Partition", "Account", "TimeLimit")


def job_info(job_id: str) -> dict[str, str] | None:
    """``scontrol show job``'s fields :data:`FIELDS` of one job (values as SLURM prints them), or None
    where scontrol cannot say (it is absent, the controller does not answer, or it forgot the job)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    found = {k: m.group(1) for k in FIELDS if (m := re.search(rf"(?:^|\s){re.escape(k)}=(\S*)", out.stdout))}
    return found if "JobState" in found else None


def child_state(job_state: str | None) -> str | None:
    """The child state of an ended SLURM job state (``TIMEOUT`` -> ``timeout``...); None while it has not ended."""
    return STATES.get(job_state or "")


def exit_code(info: dict[str, str]) -> int | None:
    """SLURM's ``ExitCode=<code>:<signal>`` as this module's convention: the signal negated, else the code."""
    m = re.fullmatch(r"(\d+):(\d+)", info.get("ExitCode", ""))
    if m is None:
        return None
    code, sig = int(m.group(1)), int(m.group(2))
    return -sig if sig else code


def record(job_id: str, info: dict[str, str] | None, environment: dict | None) -> dict:
    """The ``slurm`` entry of a child in children.json (contract: ``documents.children.slurm_fields``)."""
    info = info or {}

    def value(key: str) -> str | None:
        v = info.get(key)
        return None if v in (None, "", "(null)", "None") else v

    return {"job_id": str(job_id), "job_state": value("JobState"), "reason": value("Reason"),
            "nodes": value("NodeList"), "partition": value("Partition"), "account": value("Account"),
            "time_limit": value("TimeLimit"), "environment": environment}


def read_environment(path: Path) -> dict | None:
    """The SLURM environment a job recorded at its start (:func:`run_in_job`), or None if it never did."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def wait_for_job_processes(jobs_dir: Path, wait_s: float) -> None:
    """Wait (up to ``wait_s``) until no job process holds its shared lock on ``jobs/``: SLURM may call a
    job ended (``NODE_FAIL`` as soon as its node is set down) while its processes still run and could
    write a record after the bundle is published."""
    from .fileio import try_lock

    fd = try_lock(jobs_dir, wait_s=wait_s)
    if fd is None:
        print(f"loopbench: a SLURM job's process still holds {jobs_dir} after {wait_s:.0f} s; publishing",
              file=sys.stderr, flush=True)
    else:
        os.close(fd)


def run_in_job(job_file: str, environment_file: str) -> int:
    """Inside the SLURM job: write its ``SLURM*`` variables to ``environment_file``, then run the job.

    SIGUSR2 is ignored: submitit asks SLURM for it ahead of the time limit and would then requeue the job
    or end it as failed; a session cannot be checkpointed, so SLURM's time limit ends it (``TIMEOUT``).
    """
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    from .fileio import atomic_write_json
    from .session import run_job

    atomic_write_json(Path(environment_file),
                      {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM")})
    return run_job(job_file)


def sbatch_parameters(slurm: dict, timeout_s: float, use_gpus: bool, env: dict[str, str]) -> dict:
    """submitit ``AutoExecutor`` parameters of one SLURM job: ``executor.slurm``'s keys, ``--time`` of
    ``time_limit_min`` (or ``timeout_s`` rounded up to minutes), ``--no-requeue`` (a requeued session
    would measure its arms twice), and ``env`` exported by the batch script before the job starts, so that
    the job's Python finds the controller's modules whatever the cluster's ``--export`` default."""
    extra = {k: (True if str(v).lower() == "true" else v) for k, v in (slurm.get("additional_parameters") or {}).items()}
    params = {"timeout_min": slurm.get("time_limit_min") or max(1, math.ceil(timeout_s / 60)),
              "cpus_per_task": slurm["cpus_per_task"], "nodes": 1, "tasks_per_node": 1,
              "slurm_setup": [f"export {k}={shlex.quote(v)}" for k, v in env.items()],
              "slurm_signal_delay_s": 1, "slurm_additional_parameters": {"no_requeue": True, **extra}}
    if use_gpus:
        params["slurm_gpus_per_task"] = slurm["gpus_per_task"]
    if slurm.get("mem_gb") is not None:
        params["mem_gb"] = slurm["mem_gb"]
    for key in ("partition", "account"):
        if slurm.get(key):
            params[f"slurm_{key}"] = slurm[key]
    return params
