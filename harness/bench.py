"""``loopbench bench`` (``make bench``): the paired benchmark end to end, then the independent audit,
then the report table. ``harness/cli.py`` parses the command line and calls :func:`run_hydra`.

    loopbench bench [--config-name PRESET] [KEY=VALUE ...] [-m KEY=A,B ...]
    python -m loopbench.harness.bench ...        # the same, without the console script

Without ``--config-name`` the preset is ``ouro-1.4b`` where CUDA is available and ``cpu-smoke``
otherwise. Any key can be overridden (``pairs=3``, ``model.checkpoint=/path``...); Hydra's multirun
(``-m``) runs one benchmark per combination, each into its own bundle. Each run: controller (plan,
references, sessions) -> checker -> statistics -> bundle -> ``python -m loopbench.audit BUNDLE`` in a
separate process (the auditor imports nothing from the harness) -> the seed-style table on stdout.

    python -m loopbench.harness.bench [...] resume=results/<bundle>   # measure the rest of an incomplete bundle
    python -m loopbench.harness.bench finish results/<bundle>         # publish a bundle whose controller died

Exit status: 0 when every run is complete and its audit passes; 3 when a run is incomplete (no
verdict) and its audit finds nothing else wrong; 1 when an audit fails or on any error; 2 for a
configuration error (a misspelt key, a wrong type, an unknown arm, a bad value...), printed as one
line before anything is measured (cli.py checks the configuration before Hydra runs it; a multirun
every job's). SIGTERM or Ctrl-C stops the run's children and publishes an incomplete bundle
(exit 3), which ``resume=`` can complete.
"""
from __future__ import annotations

import json

import sys
import time
from pathlib import Path

from . import conf, progress, report
from .cards import CardInUse

_EXIT_CODES: list[int] = []
# Hydra's flags that show something and run no job (Hydra's own argument parser)
HYDRA_SHOW_FLAGS = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--version")
# a multirun's size (cli.py counts it) and start, for the sweep's ETA; what stopped it (SIGINT or SIGTERM), if anything
_SWEEP = {"jobs": 0, "started": None, "stopped": None}


def _sweep_job() -> tuple[int, int] | None:
    """(this job's number from 0, the sweep's jobs) in a multirun, else None."""
    from hydra.core.hydra_config import HydraConfig

    total = _SWEEP["jobs"]
    if not total or not HydraConfig.initialized() or HydraConfig.get().mode.name != "MULTIRUN":
        return None
    return HydraConfig.get().job.num, total


def _stop_the_sweep(why: str) -> None:
    """A job of a multirun was stopped (Ctrl-C, SIGTERM): the jobs after it are not run (:func:`task`)."""
    if (job := _sweep_job()) is not None and _SWEEP["stopped"] is None:
        _SWEEP["stopped"] = f"{why} in job {job[0] + 1}"


def _sweep_progress() -> None:
    """In a multirun, which job starts and when the whole sweep should end (mean job time so far)."""
    if (job := _sweep_job()) is None:
        return
    num, total = job
    if _SWEEP["started"] is None:
        _SWEEP["started"] = time.monotonic()
    eta = ""
    runs = _SWEEP.get("runs") or [1] * total      # each job's measured arm runs (planning.sweep_arm_runs)
    if num:
        done, left = sum(runs[:num]), sum(runs[num:])
        eta = f"; the sweep should end in about {progress.duration((time.monotonic() - _SWEEP['started']) / done * left)}"
    progress.say("sweep", f"job {num + 1} of {total}{eta}")


def task(cfg) -> int:
    from . import controller

    if _SWEEP["stopped"] is not None:   # Hydra runs the sweep's jobs on; a stop meant all of them
        num, total = _sweep_job()
        progress.say("sweep", f"job {num + 1} of {total} not run: the sweep was stopped ({_SWEEP['stopped']})")
        _EXIT_CODES.append(3)
        return 3
    _sweep_progress()
    try:
        spec = conf.validate(cfg)    # a bad key or value: one clear line and exit 2, not a traceback
    except (ValueError, TypeError) as exc:
        print(f"loopbench: bad configuration: {conf.plain_error(str(exc))}", file=sys.stderr)
        _EXIT_CODES.append(2)
        return 2
    from .resume import ResumeRefused

    try:
        result = controller.run(spec)
    except controller.PublishFailed as exc:   # a full disk while the bundle was written: what was measured is kept
        print(f"loopbench: {exc}", file=sys.stderr)
        _EXIT_CODES.append(1)
        return 1
    except (controller.BundleFolderError, controller.NotSubmitted) as exc:
        # results_dir cannot take a bundle folder, or SLURM took no job: bad usage or environment, nothing measured
        print(f"loopbench: bad configuration: {exc}", file=sys.stderr)
        _EXIT_CODES.append(2)
        return 2
    except CardInUse as exc:   # another run holds a card: one clear line, nothing written
        print(f"loopbench: {exc}", file=sys.stderr)
        _EXIT_CODES.append(1)
        return 1
    except ResumeRefused as exc:   # resume= names a bundle that cannot be resumed so: bad usage, bundle unchanged
        where = f" in sweep job {job[0] + 1} of {job[1]}" if (job := _sweep_job()) is not None else ""
        print(f"loopbench: bad configuration{where}: {exc}", file=sys.stderr)
        _EXIT_CODES.append(2)
        return 2
    except controller.Interrupted as exc:   # stopped before any arm was measured: one line, nothing left behind
        print(f"\nloopbench: {exc}", file=sys.stderr)
        _stop_the_sweep("a stop before any arm was measured")
        _EXIT_CODES.append(3)
        return 3
    if result.stopped is not None and not any(r["code"] == "stopped" for r in result.summary["incomplete_reasons"]):
        # the stop came once every child had ended, while the bundle was written, or once every session had recorded
        # all it was asked for (it then ends normally: harness/session.py): the bundle holds all that ran, and the stop
        # ends the command before the audit, as a stop during the audit does
        _stop_the_sweep("a stop after the children's last records")
        print(f"\nloopbench: {result.stopped} received after the children's last records: {result.bundle} is published "
              f"({result.summary['status']}) but not audited; to audit it: loopbench audit {result.bundle}",
              file=sys.stderr)
        _EXIT_CODES.append(3)
        return 3
    for reason in result.summary["incomplete_reasons"]:
        if reason["code"] == "stopped":
            _stop_the_sweep(reason["by"])
    return show(result)


def show(result) -> int:
    """Audit the run's bundle, print its tables, status and failed children's log tails; the exit status."""
    from .controller import audit

    try:
        code = audit(result.bundle)
    except KeyboardInterrupt:   # the bundle is published: only its audit is missing
        _stop_the_sweep("a stop during the audit")
        print(f"\nloopbench: the audit was interrupted, so {result.bundle} is published but not audited; to audit it: "
              f"loopbench audit {result.bundle}", file=sys.stderr)
        _EXIT_CODES.append(3)
        return 3
    summary = result.summary
    print()
    plan_file = result.bundle / "plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    for line in report.noise_floor_lines(summary, plan) if plan is not None else []:
        print(line)   # an A/A control that reads a change, above the tables it undermines (format 15)
    print(report.result_tables(summary, plan))   # with each point's P / D
    print(f"status: {summary['status']}"
          + (f" ({report.reasons_text(summary)})" if summary["incomplete_reasons"] else "")
          + f"; checks {'FAILED' if not summary['checks']['ok'] else 'passed' if summary['status'] == 'complete' else 'passed on what was recorded'}"
          + f"; verdicts {'published' if summary['verdicts_published'] else 'barred: ' + str(summary['verdicts_barred_by'])}"
          + (f" (flagged: an A/A control reads a change at {len(summary['noise_floor'])} point"
             f"{'' if len(summary['noise_floor']) == 1 else 's'})" if summary.get("noise_floor") else "")
          + f"; audit {'passed' if code == 0 else 'exit ' + str(code)}")
    from .online.report import status_line   # the online track's one line, when the run has one

    if (online := status_line(result.bundle)) is not None:
        print(online)
    from .evidence import current_children
    from .exit_status import exit_status_text

    for child in current_children(summary.get("children", [])):   # not the earlier runs of a resumed bundle
        if child.get("exit_code") not in (0, None):
            log = result.bundle / "logs" / child["log"]
            tail = log.read_text(errors="replace").splitlines()[-12:] if log.is_file() else ["(no log)"]
            print(f"child {child.get('session', child['name'])} ended {child['state']}, {exit_status_text(child)}; "
                  f"last lines of {log}:")
            print("\n".join("    " + line for line in tail))
    print(f"bundle: {result.bundle}")
    print(f"report: {result.bundle / 'report.md'}")
    rc = 1 if code not in (0, 3) else (3 if summary["status"] != "complete" or code == 3 else 0)
    _EXIT_CODES.append(rc)
    return rc


def default_config_name() -> str:
    import torch

    return "ouro-1.4b" if torch.cuda.is_available() else "cpu-smoke"


def finish_main(argv: list[str]) -> int:
    """``bench finish BUNDLE``: publish the bundle of a controller that died without publishing."""
    from . import resume

    if len(argv) != 1:
        print("usage: python -m loopbench.harness.bench finish BUNDLE_DIR", file=sys.stderr)
        return 2
    from .controller import PublishFailed

    try:
        result = resume.finish(Path(argv[0]))
    except (ValueError, PublishFailed) as exc:
        print(f"loopbench finish: {exc}", file=sys.stderr)
        return 1
    return show(result)


def run_hydra(config_name: str, hydra_args: list[str], sweep_jobs: int = 0, sweep_runs: list[int] | None = None
              ) -> int:
    """Run :func:`task` under ``@hydra.main`` with ``hydra_args`` (overrides, ``-m``, Hydra's flags) for
    preset ``config_name``; ``sweep_runs``: each job's measured arm runs, which weight the sweep's ETA (the
    jobs' times are assumed proportional to them); returns the worst exit status of its runs, 0 when Hydra was
    asked only to show something (``--cfg``, ``--info``: it runs nothing and says so by returning), else 1 when
    none ran."""
    import hydra

    _EXIT_CODES.clear()
    _SWEEP.update(jobs=sweep_jobs, started=None, runs=sweep_runs, stopped=None)
    saved = sys.argv
    sys.argv = [saved[0], *hydra_args]   # @hydra.main reads the command line from sys.argv
    try:
        hydra.main(version_base=None, config_path=str(conf.CONFIG_DIR), config_name=config_name)(task)()
    finally:
        sys.argv = saved
    if _EXIT_CODES:
        return max(_EXIT_CODES)
    return 0 if any(arg.split("=")[0] in HYDRA_SHOW_FLAGS for arg in hydra_args) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m loopbench.harness.bench [finish BUNDLE | ARGS]``: ``loopbench bench ARGS``."""
    from . import cli

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["finish"]:
        return finish_main(argv[1:])
    return cli.main(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
