"""The controller: one benchmark run as a row of stages, each a function of typed inputs and outputs.

    validate -> gather inputs -> prepare the model -> references -> freeze the plan -> sessions
    -> check -> publish -> (bench.py) audit

1. :func:`conf.validate` gives the frozen :class:`~spec.BenchSpec`; :func:`inputs.gather` checks it
   against the model's config (loops, positions), the prompt pool and the devices - a bad key or value
   fails here, before anything is written or measured.
2. :func:`prepare_model`: the checkpoint (a synthetic one of the preset, written once into the cache,
   or a real one) and its sha256, ``prompts.json`` and ``environment.json`` in the new bundle.
3. :func:`capture_references`: one ``reference`` child on the first device runs (or reuses by hash) a
   natural capture of the reference arm per point; the frozen ``Schedule`` files land in ``references/``.
4. :func:`freeze_plan`: ``plan.json`` (harness/plan.py), written before any measurement.
5. :func:`run_restarts`: per restart (``sessions: k``, issue 12: k independent sessions per device, one
   after another, each a fresh process that loads the model and measures its own balanced pairs),
   :func:`run_sessions` starts one child per device (local processes or submitit jobs) with timeouts
   and a progress bar fed by the raw records the sessions write as each arm completes. A restart starts
   only when every child of the one before completed.
6. :func:`check` and :func:`publish`: :mod:`checker`, :mod:`stats` and :mod:`evidence` turn whatever was
   recorded into the bundle; a failed, killed, timed-out or interrupted run is marked incomplete and
   publishes no verdict. :func:`audit` runs the independent auditor on it in its own interpreter.

Interruption (issue 8, item 4): while children run, SIGTERM and Ctrl-C only request a stop
(:class:`executors.StopSignals`); the executor stops the children's process groups (SIGTERM, then
SIGKILL after ``executor.stop_grace_s``), marks them ``interrupted`` and the controller publishes what
was recorded. ``children.json`` is kept current as children start and end, so the bundle of a controller
that died without publishing can be finished (:func:`resume.finish`) or resumed (:func:`resume.resume`).
Before any child runs (gathering inputs, writing the checkpoint, calibration) nothing is measured: there
SIGTERM and Ctrl-C end the run at once with :class:`Interrupted`, and the new bundle folder is removed. A stop
that ends the reference child before every point's reference is frozen removes the folder too (no resume could
use it, and the references captured so far are in the cache), then raises :class:`Interrupted`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from omegaconf import DictConfig

from . import cards, checker, conf, evidence, inputs, machine, natural, progress
from .executors import (ChildSpec, LocalExecutor, StopSignals, SubmissionFailed, SubmititExecutor, child_env,
                        running_result, stops_at_once)
from .fileio import atomic_write_json, atomic_write_text, sha256_file, try_lock
from .inputs import Inputs, prepare_checkpoint
from .plan import make_plan, point_entries, restart_seqs
from .spec import BenchSpec, ExecutorSpec

REFERENCE_FAILED = "reference_failed"   # a status code of loopbench/bundle_format.json


class Interrupted(Exception):
    """SIGTERM or Ctrl-C before a run measured anything, or before every point's reference was frozen (:func:`run`),
    or before a resume changed its bundle (``resume.resume``); the message says what was removed, or that nothing
    changed."""


@contextmanager
def unless_stopped(stop: StopSignals, on_stop: Callable[[], str]) -> Iterator[None]:
    """A stage that starts no child, run inside ``stop``'s :class:`StopSignals`: SIGINT and SIGTERM raise in it at
    once (:func:`stops_at_once`), and a stop ``stop`` recorded before it, or as its handler gave way to ``stop``'s
    after it, ends it too. Either way :class:`Interrupted` is raised with the message ``on_stop()`` returns (after
    whatever cleanup it does); other exceptions pass through."""
    try:
        with stops_at_once():
            if stop() is not None:
                raise KeyboardInterrupt
            yield
        if stop() is not None:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise Interrupted(on_stop()) from None


@dataclass(frozen=True)
class RunResult:
    bundle: Path
    summary: dict
    stopped: str | None = None   # the signal a stop recorded (also one that came while the bundle was published)


@dataclass(frozen=True)
class Prepared:
    """The model and environment a run's children share: the plan's checkpoint entry, environment.json."""

    checkpoint: dict
    environment: dict


# ------------------------------------------------------------------------------------------ children

def make_executor(spec: BenchSpec, bundle: Path, cache: Path, devices: list[dict]):
    """The executor of ``executor.kind``: local subprocesses, or submitit jobs."""
    if spec.executor.kind == "slurm":
        slurm = spec.to_plain()["executor"]["slurm"]
        return SubmititExecutor(cache / "submitit" / bundle.name, slurm, use_gpus=devices[0]["kind"] == "cuda")
    return LocalExecutor()


def _progress(bundle: Path, total: int):
    """The arms' progress bar: (update, close, say), ``say(phase, what)`` printing a progress line above the bar."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but a bar is never worth failing a run for
        return lambda: None, lambda: None, progress.say
    def recorded() -> int:
        return len(list((bundle / "raw").glob("*/*.json")))

    # a resume starts from the arms kept: the bar's rate and ETA count only the arms this run measures
    bar = tqdm(total=total, initial=recorded(), desc="arms", unit="arm", dynamic_ncols=True, file=sys.stderr,
               disable=progress.quiet())

    def update() -> None:
        done = recorded()
        if done > bar.n:
            bar.update(done - bar.n)

    def say(phase: str, what: str) -> None:
        if not progress.quiet():
            tqdm.write(f"loopbench: {phase}: {what}", file=sys.stderr)
    return update, bar.close, say


def _log_echo(log: Path, prefix: str, phase: str = "references", say=progress.say):
    """A progress callback that prints, as ``say(phase, ...)``, each new line of a child's ``log`` that starts with
    ``prefix`` (after the child's timestamp): the reference child's one line per point, a session's one line per
    online run."""
    seen = [0]

    def echo() -> None:
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        for line in lines[seen[0]:]:
            text = line.split("] ", 1)[-1]
            if text.startswith(prefix):
                say(phase, text[len(prefix):])
        seen[0] = len(lines)
    return echo


def write_job(bundle: Path, kind: str, dev: dict, stem: str | None = None, **extra) -> Path:
    """Write ``jobs/<kind>-<stem>.json`` (stem: the device's name, or a resumed session's id)."""
    job = {"kind": kind, "name": dev["name"], "bundle": str(bundle),
           "device": {"kind": dev["kind"], "gpu_index": dev["gpu_index"], "cpu_threads": dev["cpu_threads"],
                      **({"cpu_index": dev["cpu_index"]} if "cpu_index" in dev else {})},
           **extra}
    path = bundle / "jobs" / f"{kind}-{stem or dev['name']}.json"
    atomic_write_json(path, job)
    return path


def write_children(bundle: Path, children: list[dict]) -> None:
    """``children.json`` is rewritten at every change (a child starts, ends), so that a controller that
    dies leaves the list of children it had started for ``finish``."""
    atomic_write_json(bundle / "children.json", children)


def session_id(name: str, attempt: int, restart: int = 0) -> str:
    """A session child's id: its device's name, ``.s<j>`` for its j-th restart (j > 0), then ``.r<k>`` in
    the bundle's k-th resume (``cpu0``, ``cpu0.s1``, ``cpu0.r1``, ``cpu0.s1.r1``)."""
    return name + (f".s{restart}" if restart else "") + (f".r{attempt}" if attempt else "")


# ------------------------------------------------------------------------------------------- stages

def prepare_model(spec: BenchSpec, got: Inputs, bundle: Path) -> Prepared:
    """The checkpoint entry (written once for a preset), ``prompts.json`` and ``environment.json``."""
    ckpt = prepare_checkpoint(spec, got.cache)
    atomic_write_text(bundle / "prompts.json", got.prompts_text)
    env = machine.environment(got.devices)
    atomic_write_json(bundle / "environment.json", env)
    return Prepared(ckpt, env)


def reference_job(spec: BenchSpec, got: Inputs, ckpt: dict, bundle: Path) -> ChildSpec:
    """The ``reference`` child's job: a natural run of the reference arm per point, keyed for reuse."""
    ref = spec.reference
    plain = spec.to_plain()
    key_material = {"checkpoint_sha256": ckpt["sha256"], "prompts_sha256": got.prompts_sha256,
                    "workload": plain["workload"], "exit": plain["exit"], "arm": plain["arms"][ref],
                    "dtype": spec.model.dtype, "code_sha256": got.code["code_sha256"]}
    engine = plain["arms"][ref]["engine"]
    if engine in got.code.get("engine_sources", {}):    # an external reference engine: its sources key the reuse too
        key_material["engine_source_sha256"] = got.code["engine_sources"][engine]
    dev = got.devices[0]
    job = write_job(bundle, "reference", dev, spec={
        "checkpoint_path": ckpt["path"], "dtype": spec.model.dtype, "prompts_file": "prompts.json",
        "points": point_entries(spec), "output_len": spec.workload.output_len, "exit": plain["exit"],
        "arm": ref, "arm_config": plain["arms"][ref], "max_model_len": got.max_model_len,
        "cache_dir": str(got.cache), "reuse": spec.reuse_references, "key_material": key_material,
        "engine_sources": got.code.get("engine_sources", {}),   # the child checks it imports these versions
        **natural.reference_job_entry(plain, [pt.key for pt in spec.points])})
    return ChildSpec("reference", job, bundle / "logs" / "reference.log", dev["gpu_index"], dev["label"],
                     spec.executor.reference_timeout_s, cpu_index=dev.get("cpu_index"))


def capture_references(spec: BenchSpec, got: Inputs, ckpt: dict, bundle: Path, executor,
                       stop: StopSignals) -> tuple[list[dict], list[dict]]:
    """Run the reference child; returns (the plan's points, each with its ``reference`` entry where the
    frozen files exist; the children.json entries)."""
    ref_spec = reference_job(spec, got, ckpt, bundle)
    write_children(bundle, [running_result(ref_spec).to_dict()])
    ex = spec.executor
    n = len(spec.points)
    progress.say("references", f"natural run of arm {spec.reference} at {n} point{'s' * (n != 1)} on "
                               f"{got.devices[0]['label']} ("
                               + ("reused by hash when cached" if spec.reuse_references else "captured again: "
                                  "reuse_references=false") + ")")
    children = [c.to_dict() for c in executor.run([ref_spec], progress=_log_echo(ref_spec.log_file, "reference "),
                                                  poll_s=ex.poll_s, stop=stop, grace_s=ex.stop_grace_s)]
    write_children(bundle, children)
    points = point_entries(spec)
    for pt in points:
        f = bundle / "references" / f"{pt['key']}.schedule.json"
        meta = bundle / "references" / f"{pt['key']}.meta.json"
        if f.is_file() and meta.is_file():
            pt["reference"] = {"file": f.relative_to(bundle).as_posix(), "sha256": sha256_file(f),
                               "meta_file": meta.relative_to(bundle).as_posix(), "meta_sha256": sha256_file(meta)}
    return points, children


def freeze_plan(spec: BenchSpec, got: Inputs, ckpt: dict, points: list[dict], bundle: Path) -> dict:
    """Write ``plan.json`` (before any measurement); returns it."""
    plan = make_plan(spec, got, ckpt, points)
    atomic_write_json(bundle / "plan.json", plan)
    return plan


def run_sessions(ex: ExecutorSpec, executor, bundle: Path, devices: list[dict], children: list[dict],
                 stop: StopSignals, attempt: int = 0, seqs: dict[str, list[int]] | None = None,
                 restart: int = 0) -> list[dict]:
    """Start one session child per device (measuring ``seqs[name]`` of its order, or all of it), wait for
    them or for ``stop``; returns their children.json entries."""
    specs = []
    for d in devices:
        sid = session_id(d["name"], attempt, restart)
        extra = {"session": sid} if seqs is None else {"session": sid, "seqs": seqs[d["name"]]}
        specs.append(ChildSpec(d["name"], write_job(bundle, "session", d, sid, **extra),
                               bundle / "logs" / f"{sid}.log", d["gpu_index"], d["label"], ex.session_timeout_s,
                               sid, attempt, d.get("cpu_index")))
    write_children(bundle, children + [running_result(s).to_dict() for s in specs])
    total = sum(len(v) for v in json.loads((bundle / "plan.json").read_text())["order"].values())
    update, close, say = _progress(bundle, total)
    echoes = [_log_echo(s.log_file, "online ", f"online {s.name}" if len(specs) > 1 else "online", say)
              for s in specs]

    def tick() -> None:
        update()
        for echo in echoes:
            echo()
    try:
        results = executor.run(specs, progress=tick, poll_s=ex.poll_s, stop=stop, grace_s=ex.stop_grace_s)
        tick()          # what the children logged after the last poll
    finally:
        close()
    return [r.to_dict() for r in results]


def run_restarts(ex: ExecutorSpec, executor, bundle: Path, plan: dict, devices: list[dict], children: list[dict],
                 stop: StopSignals, attempt: int = 0, todo: dict[str, list[int]] | None = None) -> list[dict]:
    """Every restart's session children, restart after restart (``plan.restart_seqs``); ``todo``: per
    device the seqs still to measure (a resume), else all. A restart with nothing to measure is skipped;
    a device of ``devices`` left with nothing to measure at all (a resume of a session that wrote every
    record but did not complete) runs one session, with no seqs, in the last round. Stops after a
    restart whose children did not all complete, or on ``stop`` (a stop before the first round is recorded by its
    children, not started); returns the children.json entries."""
    cfg = plan["config"]
    n, k = cfg["pairs"], cfg.get("sessions", 1)
    per_restart = {d["name"]: restart_seqs(plan["order"][d["name"]], n, k) for d in devices}
    rounds = []
    for r in range(k):
        seqs = {name: (planned[r] if todo is None else [s for s in todo[name] if s in set(planned[r])])
                for name, planned in per_restart.items()}
        if any(seqs.values()):
            rounds.append((r, seqs))
    idle = [d["name"] for d in devices if not any(seqs[d["name"]] for _, seqs in rounds)]
    if idle and rounds:
        rounds[-1][1].update({name: [] for name in idle})
    elif idle:
        rounds = [(k - 1, {name: [] for name in idle})]
    out: list[dict] = []
    for r, seqs in rounds:
        active = [d for d in devices if seqs[d["name"]] or d["name"] in idle]
        # a stop before the first round still starts it: the executor records its children as not started, stopped by
        # the signal, so the bundle says it was stopped (it had said only that arms were missing)
        if (stop() and out) or any(c["state"] != "completed" for c in out):
            break
        whole = todo is None and k == 1   # a job without ``seqs`` measures its whole order (as before restarts)
        try:
            out += run_sessions(ex, executor, bundle, active, children + out, stop, attempt,
                                None if whole else {d["name"]: seqs[d["name"]] for d in active}, r)
        except SubmissionFailed as exc:
            # the bundle holds a frozen reference (and maybe arms): published incomplete, its arms missing, resumable
            print(f"loopbench: {exc}; publishing the bundle of what was measured, incomplete; once SLURM takes jobs, "
                  f"resume it: resume={bundle}", file=sys.stderr, flush=True)
            break
    return out


def reference_failure(plan: dict, children: list[dict]) -> str | None:
    """The status code of the one reason ``children.json`` does not show: the reference child failed (not
    stopped) or left a point without its frozen reference. The auditor derives the same from the bundle."""
    current = evidence.current_children(children)
    if any(c.get("interrupted_by") for c in current):
        return None
    ref = next((c for c in current if c["name"] == "reference"), None)
    if ref is None or ref["exit_code"] != 0 or any("reference" not in pt for pt in plan["points"]):
        return REFERENCE_FAILED
    return None


def check(bundle: Path, plan: dict) -> checker.CheckReport:
    """Every raw record against its point's frozen reference (harness/checker.py)."""
    references = {}
    for pt in plan["points"]:
        if "reference" in pt:
            references[pt["key"]] = {"schedule": json.loads((bundle / pt["reference"]["file"]).read_text()),
                                     "work": json.loads((bundle / pt["reference"]["meta_file"]).read_text())["work"]}
    return checker.check(evidence.load_records(bundle), references, warmup=plan["config"]["warmup"],
                         natural={c["name"] for c in natural.comparisons(plan["config"])})


def published(result: RunResult, stop: StopSignals) -> RunResult:
    """``result`` naming the signal ``stop`` recorded, if any: one that came while the bundle was written is in no
    child's record, and bench ends on it before the audit."""
    return result if stop() is None else dataclasses.replace(result, stopped=stop())


class PublishFailed(Exception):
    """The bundle could not be written (a full disk, a folder turned read-only): the raw records measured so far are
    kept, and ``loopbench finish`` publishes them once the cause is gone; the message says so."""


def publish(bundle: Path, plan: dict, children: list[dict], env: dict) -> RunResult:
    """Check and bundle whatever the raw records hold: tables, summary, report, plot, manifest (last).
    :class:`PublishFailed` when a file cannot be written (the manifest, written last, is then missing: unpublished)."""
    try:
        for rel in evidence.remove_stale_temp_files(bundle):
            print(f"loopbench: removed {rel}, a temporary file of a writer killed mid-write", flush=True)
        write_children(bundle, children)
        report = check(bundle, plan)
        summary = evidence.finalize(bundle, plan, report.to_dict(), children, env, reference_failure(plan, children))
    except OSError as exc:
        kept = len(list((bundle / "raw").glob("*/*.json")))
        raise PublishFailed(f"could not publish {bundle}: {exc.strerror or exc}"
                            + (f" ({exc.filename})" if exc.filename else "")
                            + f"; its {kept} raw arm record{' is' if kept == 1 else 's are'} kept, unpublished; once the "
                            f"cause is gone, publish them with: loopbench finish {bundle}") from None
    return RunResult(bundle, summary)


def audit(bundle: Path) -> int:
    """Run the independent auditor on ``bundle`` in its own interpreter; returns its exit code. Ctrl-C or SIGTERM
    stops the auditor, which then writes nothing, and raises KeyboardInterrupt here."""
    progress.say("audit", f"re-deriving every figure of {bundle.name} from its raw records")
    # its own session: a Ctrl-C at the terminal reaches this process alone, whose KeyboardInterrupt stops the child
    with stops_at_once():
        return subprocess.run([sys.executable, "-m", "loopbench.audit", str(bundle)], env=child_env(None),
                              start_new_session=True).returncode


class NotSubmitted(ValueError):
    """The reference child's SLURM job could not be submitted (harness/executors.py :class:`SubmissionFailed`): no
    child ran and nothing was measured, so the new bundle folder is removed; the message says so."""


class BundleFolderError(ValueError):
    """The new bundle folder, or the cache folder, cannot be made (a folder ``rules.check_folder`` passed, such as one
    below ``/proc`` as root, or one that became read-only since): nothing was measured or written."""


def make_cache(spec: BenchSpec, cache: Path, unchanged: str = "nothing was measured") -> None:
    """The cache folder, made before anything is written into the new bundle folder (or, in a resume, before its
    checks write a checkpoint): :class:`BundleFolderError` naming where it came from (``cache_dir``,
    ``$LOOPBENCH_CACHE`` or the default), the operating system's reason and ``unchanged``, when it cannot be made."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        source = inputs.cache_source(spec)
        where = f"{source[0]} = {source[1]!r}" if source else f"the default cache folder {str(cache)!r}"
        raise BundleFolderError(f"{where}: cannot make the cache folder there ({exc.strerror or exc}: "
                                f"{exc.filename}); {unchanged}") from None


def open_bundle(spec: BenchSpec, code: dict) -> Path:
    """A new ``results/<date>-<name>-<short sha>`` folder; :class:`BundleFolderError` naming ``results_dir`` and the
    operating system's reason when it cannot be made."""
    short = code["git_sha"][:8] if code["git_sha"] else "nogit"
    try:
        return evidence.bundle_dir(inputs.results_path(spec), spec.name, short)
    except OSError as exc:
        raise BundleFolderError(f"results_dir = {spec.results_dir!r}: cannot make the bundle folder there "
                                f"({exc.strerror or exc}: {exc.filename}); nothing was measured") from None


def run(cfg: DictConfig | dict | BenchSpec) -> RunResult:
    """Run one benchmark end to end, or resume one (``resume``); returns the bundle and its summary (never a
    verdict for a partial run). SIGTERM or Ctrl-C while children run stops them and publishes an incomplete bundle;
    before the first child it raises :class:`Interrupted` at once, the new bundle folder removed, and after a reference
    child it stopped before every point's reference was frozen, also with the folder removed.
    ``cfg`` is a composed config (validated here) or the ``BenchSpec`` a caller already validated."""
    spec = cfg if isinstance(cfg, BenchSpec) else conf.validate(cfg)
    if spec.resume is not None:
        from .resume import resume

        return resume(spec)
    with StopSignals(before_children=True) as stop:   # no stop is lost: raised before the first child, recorded after
        with unless_stopped(stop, lambda: "interrupted while gathering the run's inputs: nothing was written"):
            got = inputs.gather(spec)
        with cards.claimed(got.devices):   # a card another run measures on is refused before anything is written
            return _run_new(spec, got, stop)


def _run_new(spec: BenchSpec, got: Inputs, stop: StopSignals) -> RunResult:
    """A new run's stages, from its bundle to the published summary (:func:`run`)."""
    bundle = lock = None

    def removed() -> str:   # the folder holds prompts.json and environment.json at most; the cache's writes are atomic
        if bundle is None:
            return "interrupted before anything was measured: nothing was written"
        shutil.rmtree(bundle, ignore_errors=True)
        return f"interrupted before anything was measured: removed the new bundle folder {bundle}"

    try:
        with unless_stopped(stop, removed):   # a stop recorded while the card was claimed ends it before the folder
            bundle = open_bundle(spec, got.code)
            try:
                make_cache(spec, got.cache)
            except BundleFolderError:
                bundle.rmdir()   # made just now, empty: a bad cache_dir leaves no bundle folder behind
                raise
            lock = try_lock(bundle)  # held while this controller lives: finish and resume keep off
            print(f"loopbench: bundle {bundle}", flush=True)
            prepared = prepare_model(spec, got, bundle)
            load = prepared.environment["cpu_load"]   # sampled once, kept in environment.json (format 15)
            busy = None if load is None else machine.cpu_load_text(load)
            if busy:
                print(f"loopbench: {busy}", file=sys.stderr, flush=True)
            executor = make_executor(spec, bundle, got.cache, got.devices)
        stop.before_children = False
        try:
            points, children = capture_references(spec, got, prepared.checkpoint, bundle, executor, stop)
        except SubmissionFailed as exc:   # the first child: nothing ran, so no folder is left that no resume could use
            shutil.rmtree(bundle, ignore_errors=True)
            raise NotSubmitted(f"{exc}; nothing was measured (removed the new bundle folder {bundle})") from None
        frozen = all("reference" in pt for pt in points)
        if stop() is not None and not frozen:
            # A resume refuses a bundle without every point's frozen reference and no arm has run, so the folder
            # holds nothing a new run would not redo; the child cached each reference it captured.
            shutil.rmtree(bundle, ignore_errors=True)
            raise Interrupted(f"interrupted during the reference capture, before every point's reference was frozen: "
                              f"removed the new bundle folder {bundle}, which no resume could use; the references "
                              "captured so far are in the cache, and a new run reuses them (unless "
                              "reuse_references=false)")
        plan = freeze_plan(spec, got, prepared.checkpoint, points, bundle)
        # no sessions after a failed or stopped reference capture
        if children[0]["state"] == "completed" and frozen:
            children += run_restarts(spec.executor, executor, bundle, plan, got.devices, children, stop)
        stop.publishing = True
        return published(publish(bundle, plan, children, prepared.environment), stop)
    finally:
        if lock is not None:
            os.close(lock)
