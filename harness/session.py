"""A child process on one device: the reference capture, or one persistent measuring session.

``python -m loopbench.harness.session JOB.json`` (or :func:`run_job` through submitit) runs one job
that the controller wrote into the bundle:

- ``reference``: for each point, a natural run of the reference arm (BRIEF section 2: "a natural run
  of the native Graph arm is captured once ... and frozen with its sha256"), stored as the frozen
  ``Schedule`` plus its work counters, or reused from the cache when the same inputs, code, device
  model and torch version were captured before.
- ``session``: loads the model once, then for each arm of the frozen measurement order builds a fresh
  engine replaying the point's schedule, runs one full untimed warmup of the whole workload, then one
  measured run timed from the first submission to full drain. Each completed arm is written at once as
  one raw JSON record (atomic, :class:`records.ArmRecord`), so a killed session leaves every completed
  arm behind. A job may name the ``seqs`` of the plan's order it measures (a resumed run's session
  measures the rest) and its ``session`` id, which every record it writes carries. A record also
  carries the arm's ``coverage``: how often each path where the layouts differ ran, derived from the
  frozen schedule on the host after the measured run (harness/coverage.py), never counted while timed,
  and the measured run's ``engine_settings``: what its engine says it resolved and ran with (the optional
  ``settings()`` of the Engine protocol, read after the run; None for an engine without it).

Every engine is built by its arm's factory (harness/engines.py) and driven only through the ``Engine``
protocol (runtime/api.py). This process never loads the bundle writer (pandas, pyarrow): it writes
through harness/fileio.py, and tests/test_layering.py holds it to that.

Stopping: SIGTERM ends the child at once (an arm in flight is not recorded, and a record being written
is either whole or absent); on Linux the kernel sends that SIGTERM when the controller dies, even by
SIGKILL, so no child outlives its controller. Two exceptions, both about work already done: a record and its
log line are written together (a SIGTERM between them waits the few milliseconds until both are), and once a
session job has recorded everything its job asked for (its last arm, and the online track where it has one) it
has nothing left to lose, so SIGTERM is ignored from then on and the child ends normally, exit 0, within the
controller's grace: a stop that came after the last record but before the child had exited ended it by the signal
(-15), which the controller rightly recorded as ``interrupted`` and so published a bundle of every planned arm as
incomplete, verdicts withheld. The controller keeps a child that exits 0 during a stop ``completed``
(harness/executors.py), and the auditor derives the status from ``children.json`` and the records as before. While it runs, the child holds a shared lock on the
bundle's ``jobs/`` folder, by which ``finish`` and a resume tell that no child of the bundle still runs.

Timing: ``time.perf_counter`` around add_request ... run() (whose end synchronises the device and
copies the tokens to the host, i.e. the drain); on CUDA a ``torch.cuda.synchronize`` precedes both clock
reads. The garbage collector is collected before and disabled inside the timed region, as ``timeit``
does, so a collection of earlier garbage cannot land in one arm. Checking, the start / end telemetry
readings and file writing are outside the timer; the NVML sampler thread (harness/sampler.py) runs
through the measured run (not the warmup) and records its own CPU time, its cost. Peak memory is reset before and read after each phase (CUDA; None on CPU).
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import coverage, engines, loop_timing, machine, natural, telemetry
from .sampler import Sampler
from .fileio import atomic_write_json, atomic_write_text, bundle_format, canonical_json, sha256_bytes, try_lock
from .records import ArmRecord, ArmSpec, OrderItem, PhaseResult
from .stats import tokens_per_s

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)   # documents.log.line_prefix


def arm_log_line(item: OrderItem, rec: ArmRecord) -> str:
    """The line the session prints for a record it wrote (the contract's ``documents.log.arm_line``); the auditor
    holds the record's figures to it."""
    log = bundle_format()["documents"]["log"]
    key = log["arm_line_key"].format(seq=item.seq, point=item.point, comparison=item.comparison, pair=item.pair,
                                     position=item.position, arm=item.arm)
    return log["arm_line"].format(key=key, elapsed_s=rec.measured.elapsed_s, tokens_per_s=rec.tokens_per_s)


def _sync(device: dict) -> None:
    if device["kind"] == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ inputs

def load_model(checkpoint_path: str, dtype: str, device: dict, max_model_len: int):
    """The checkpoint cast to ``dtype`` (a ``TORCH_DTYPES`` name) on ``device["torch"]``, rotary tables
    for ``max_model_len`` positions."""
    from loopbench.runtime.checkpoint import load_checkpoint
    from loopbench.runtime.model import OuroModel

    cfg, tensors = load_checkpoint(checkpoint_path, dtype=TORCH_DTYPES[dtype], device=device["torch"])
    return OuroModel.from_tensors(cfg, tensors, device=device["torch"], dtype=TORCH_DTYPES[dtype],
                                  rope_len=max_model_len)


def build_requests(prompts: list[list[int]], num_requests: int, output_len: int, exit_conf: dict,
                   listed: list[dict] | None = None) -> list:
    """The point's requests, exactly D tokens each, EOS ignored: those the plan point lists (``listed``:
    request_id and prompt_index each), or else the first C prompts of the pool with ids r0000.."""
    from loopbench.runtime.api import Request

    if listed is None:
        listed = [{"request_id": f"r{i:04d}", "prompt_index": i} for i in range(num_requests)]
    if len(prompts) < num_requests or any(r["prompt_index"] >= len(prompts) for r in listed):
        raise ValueError(f"the prompt pool has {len(prompts)} prompts, the point needs {num_requests}")
    return [Request(request_id=r["request_id"], prompt_token_ids=tuple(prompts[r["prompt_index"]]),
                    max_tokens=output_len, min_loops=exit_conf["min_loops"], max_loops=exit_conf["max_loops"],
                    exit_threshold=exit_conf["threshold"], ignore_eos=True)
            for r in listed]


def point_requests(prompts: list[list[int]], point: dict, output_len: int, exit_conf: dict) -> list:
    """:func:`build_requests` for a plan point: its C, its listed requests, and its own D (format 5) where it
    sets one, else ``output_len`` (the workload's). Every run of a point builds its requests here."""
    return build_requests(prompts, point["num_requests"], point.get("output_len", output_len), exit_conf,
                          point.get("requests"))


def build_engine(arm: ArmSpec, model, max_num_seqs: int, max_model_len: int, policy: str, schedule=None):
    """A fresh engine of ``arm`` (its ``engine`` factory) at one point."""
    return engines.build_engine(arm.engine, model, arm.engine_config(max_num_seqs, max_model_len, policy, schedule))


# --------------------------------------------------------------------------------------- one phase

def run_phase(engine, requests: list, device: dict, timer=None) -> PhaseResult:
    """Submit every request and drain; timed from the first submission to the drained outputs.

    ``engine``: an ``Engine``; ``requests``: runtime ``Request``s; ``device``: ``machine.child_device``;
    ``timer``: a ``loop_timing.DecodeLoopTimer`` the engine calls around each decode loop of this run.
    """
    if timer is not None:
        engine.decode_timer = timer
    before = engine.stats.copy()
    cuda = device["kind"] == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    gc.collect()
    gc.disable()
    try:
        _sync(device)
        t0 = time.perf_counter()
        for req in requests:
            engine.add_request(req)
        outputs = engine.run()
        _sync(device)
        elapsed_s = time.perf_counter() - t0
    finally:
        gc.enable()
        if timer is not None:
            engine.decode_timer = None
    return PhaseResult(elapsed_s=elapsed_s, outputs=outputs, stats=engine.stats.minus(before),
                       peak_allocated_bytes=torch.cuda.max_memory_allocated() if cuda else None,
                       peak_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None,
                       trace_sha256=engine.trace_sha256)


# ------------------------------------------------------------------------------------ references

def reference_cache_key(material: dict, device: dict) -> str:
    """What a frozen reference depends on: inputs, runtime code, device model and torch version."""
    return sha256_bytes(canonical_json({**material, "device_name": device["name"],
                                        "torch": torch.__version__}).encode())


def _cached_reference(cached: Path) -> tuple[str, dict] | None:
    """(schedule text, meta) of a cache entry, or None when absent or damaged (recaptured, never trusted)."""
    if not ((cached / "schedule.json").is_file() and (cached / "meta.json").is_file()):
        return None
    text = (cached / "schedule.json").read_text()
    meta = json.loads((cached / "meta.json").read_text())
    if meta.get("schedule_sha256") != sha256_bytes(text.encode()):
        return None
    return text, {**meta, "reused": True}


def _capture_reference(spec: dict, model, prompts: list, point: dict, device: dict, key: str) -> tuple[str, dict]:
    """A natural run of the reference arm at ``point``: (frozen schedule text, meta)."""
    arm = ArmSpec.from_plain(spec["arm_config"])
    reqs = point_requests(prompts, point, spec["output_len"], spec["exit"])
    eng = build_engine(arm, model, point["max_num_seqs"], spec["max_model_len"], spec["exit"]["policy"])
    phase = run_phase(eng, reqs, device)
    text = eng.capture_schedule().to_json()
    meta = {"point": point["key"], "arm": spec["arm"], "arm_config": spec["arm_config"],
            "policy": spec["exit"]["policy"], "work": phase.work(), "graphs": phase.graphs(),
            "elapsed_s": phase.elapsed_s, "device": device, "torch": torch.__version__,
            "cache_key": key, "schedule_sha256": sha256_bytes(text.encode()), "reused": False}
    return text, meta


def capture_references(job: dict) -> None:
    """The ``reference`` job: every point's frozen schedule and meta into ``references/`` (and the cache)."""
    bundle, spec = Path(job["bundle"]), job["spec"]
    engines.check_sources(spec.get("engine_sources", {}))   # the reference's and the natural traces' engines
    device = machine.child_device(job["name"], job["device"])
    prompts = json.loads((bundle / spec["prompts_file"]).read_text())
    model = None
    cache = Path(spec["cache_dir"]) / "references"
    for point in spec["points"]:
        key = reference_cache_key({**spec["key_material"], "point": point}, device)
        found = _cached_reference(cache / key) if spec["reuse"] else None
        if found is not None:
            _log(f"reference {point['key']}: reused {key[:12]}")
            text, meta = found
        else:
            if model is None:
                model = load_model(spec["checkpoint_path"], spec["dtype"], device, spec["max_model_len"])
            text, meta = _capture_reference(spec, model, prompts, point, device, key)
            atomic_write_text(cache / key / "schedule.json", text)
            atomic_write_json(cache / key / "meta.json", meta)
            _log(f"reference {point['key']}: captured {key[:12]} in {meta['elapsed_s']:.2f}s")
        atomic_write_text(bundle / "references" / f"{point['key']}.schedule.json", text)
        atomic_write_json(bundle / "references" / f"{point['key']}.meta.json", meta)
        if any(t["point"] == point["key"] for t in spec.get("natural_traces", [])):   # the natural track
            model = model or load_model(spec["checkpoint_path"], spec["dtype"], device, spec["max_model_len"])
            natural.run_traces(spec, model, prompts, point, device, bundle)
            _log(f"reference {point['key']}: natural-track traced runs written")


# ------------------------------------------------------------------------------------- measuring

@dataclass(frozen=True)
class SessionInputs:
    """What every arm of one session shares: the model, and per point its frozen schedule and requests."""

    job: dict
    device: dict
    plan: dict                    # plan.json, read once per session
    config: dict                  # the plan's resolved config
    points: dict[str, dict]       # the plan's points by key
    max_model_len: int
    model: object
    frozen: dict[str, str]        # point key -> frozen schedule JSON text
    schedules: dict[str, object]  # point key -> runtime Schedule
    requests: dict[str, list]     # point key -> runtime Requests
    order: tuple[OrderItem, ...]  # this device's planned order


def load_session(job: dict) -> SessionInputs:
    """Read the plan, load the model once, parse every point's frozen schedule and build its requests."""
    from loopbench.runtime.schedule import Schedule

    bundle = Path(job["bundle"])
    raw_plan = (bundle / "plan.json").read_bytes()
    plan = json.loads(raw_plan)
    _log(bundle_format()["documents"]["log"]["plan_line"].format(   # the auditor holds plan.json to this line
        session=job.get("session", job["name"]), sha256=hashlib.sha256(raw_plan).hexdigest()))
    engines.check_sources((plan.get("code") or {}).get("engine_sources", {}))   # the planned versions, or nothing
    cfg = plan["config"]
    device = machine.child_device(job["name"], job["device"])
    prompts = json.loads((bundle / plan["prompts"]["file"]).read_text())
    points = {p["key"]: p for p in plan["points"]}
    _log(f"session {job['name']} on {device['label']}: loading {plan['checkpoint']['path']}")
    model = load_model(plan["checkpoint"]["path"], cfg["model"]["dtype"], device, plan["max_model_len"])
    frozen = {key: (bundle / pt["reference"]["file"]).read_text() for key, pt in points.items()}
    return SessionInputs(
        job=job, device=device, plan=plan, config=cfg, points=points, max_model_len=plan["max_model_len"], model=model,
        frozen=frozen, schedules={key: Schedule.from_json(text) for key, text in frozen.items()},
        requests={key: point_requests(prompts, pt, cfg["workload"]["output_len"], cfg["exit"])
                  for key, pt in points.items()},
        order=tuple(map(OrderItem.from_dict, plan["order"][job["name"]])))


def measure_arm(s: SessionInputs, item: OrderItem, covered) -> ArmRecord:
    """One arm of the order: a fresh engine, its untimed warmup, its measured run; the record."""
    pt, arm = s.points[item.point], ArmSpec.from_plain(s.config["arms"][item.arm])
    own = natural.is_natural(s.config, item.comparison)   # the natural track: its own exits, no replay
    policy, schedule = (s.config["exit"]["policy"], None) if own else ("replay", s.schedules[item.point])
    eng = build_engine(arm, s.model, pt["max_num_seqs"], s.max_model_len, policy, schedule)
    warm = run_phase(eng, s.requests[item.point], s.device) if s.config["warmup"] else None
    if warm is not None:
        eng.reset_run()   # the same request ids again; graphs, buffers and cumulative stats stay
    tele_start = telemetry.sample(s.device["gpu_index"])
    sampler = Sampler(s.device["gpu_index"], s.config.get("telemetry", {}).get("sample_hz", 20.0)).start()
    # roofline (format 7): each decode loop's device time, where the engine calls a decode_timer
    timer = loop_timing.DecodeLoopTimer(s.device["kind"]) if hasattr(eng, "decode_timer") else None
    start_unix_s = time.time()
    meas = run_phase(eng, s.requests[item.point], s.device, timer)
    end_unix_s = time.time()
    samples = sampler.stop()
    tele_end = telemetry.sample(s.device["gpu_index"])
    settings = engines.engine_settings(eng)   # what the measured run ran with (format 9), read after it
    # a natural arm's coverage is of its own schedule (captured after the timer), not the frozen one
    covered_here = coverage.derive(json.loads(eng.capture_schedule().to_json()), s.config["arms"][item.arm],
                                   s.model.cfg.total_ut_steps) if own else covered(item.point, item.arm)
    del eng
    gc.collect()
    if s.device["kind"] == "cuda":  # the next arm starts from the same allocator state
        torch.cuda.empty_cache()
    output_len = pt.get("output_len", s.config["workload"]["output_len"])   # the point's own D (format 5)
    return ArmRecord(
        job=s.job["name"], session=s.job.get("session", s.job["name"]), device=s.device, item=item,
        max_num_seqs=pt["max_num_seqs"], num_requests=pt["num_requests"], output_len=output_len, arm_config=arm,
        tokens_per_s=tokens_per_s(pt["num_requests"], output_len, meas.elapsed_s), warmup=warm, measured=meas,
        coverage=covered_here, telemetry_start=tele_start, telemetry_end=tele_end,
        telemetry_samples=samples if sampler.active else None, sampler=sampler.record(),
        measured_start_unix_s=start_unix_s, measured_end_unix_s=end_unix_s,
        decode_timing=None if timer is None else timer.record(), engine_settings=settings)


def measure(job: dict) -> None:
    """The ``session`` job: every arm of this device's order (or of ``job["seqs"]``), one record each."""
    s = load_session(job)
    write_ceiling(job, s.device)
    out_dir = Path(job["bundle"]) / "raw" / job["name"]
    covered = arm_coverage(s.frozen, s.config["arms"], s.model)
    kill_after = s.config["fault"]["kill_after_arms"]
    seqs = set(job["seqs"]) if job.get("seqs") is not None else None
    from .online.arms import measure_online, track_here   # the online track (harness/online/), when the plan has one

    todo = [item for item in s.order if seqs is None or item.seq in seqs]
    online = track_here(s.plan, job) is not None
    if not todo and not online:
        _job_recorded()
    for done, item in enumerate(todo):
        _exit_if_orphaned()
        if kill_after is not None and done >= kill_after:
            _log(f"fault.kill_after_arms={kill_after}: SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)
        rec = measure_arm(s, item, covered)
        with _record_and_log_line():
            atomic_write_json(out_dir / item.file_name, rec.to_dict())
            _log(arm_log_line(item, rec))
            if done == len(todo) - 1 and not online:
                _job_recorded()
    measure_online(job, _log, s.plan)
    _job_recorded()


def write_ceiling(job: dict, device: dict) -> None:
    """The session's copy ceiling (harness/loop_timing.py), measured before its first arm, into
    ``ceilings/<session>.json`` (format 7: the roofline's denominator)."""
    session = job.get("session", job["name"])
    ceiling = {"session": session, "job": job["name"], "device": device["label"], **loop_timing.copy_ceiling(device)}
    atomic_write_json(Path(job["bundle"]) / "ceilings" / f"{session}.json", ceiling)
    _log(bundle_format()["documents"]["log"]["ceiling_line"].format(   # the auditor holds the file to this line
        session=session, gb_per_s=ceiling["bytes_per_copy"] / min(ceiling["times_s"]) / 1e9))


def arm_coverage(frozen: dict[str, str], arms: dict, model):
    """``(point, arm) -> coverage counts`` (harness/coverage.py) of replaying the point's frozen schedule.

    ``frozen`` maps a point key to its schedule's JSON text; ``model`` gives the number of planes
    (``cfg.total_ut_steps``). Pure host arithmetic, computed once per (point, arm) when the first record
    asks, i.e. after that arm's measured run and outside its timer.
    """
    cache: dict[tuple[str, str], dict] = {}

    def covered(point: str, arm: str) -> dict:
        if (point, arm) not in cache:
            cache[point, arm] = coverage.derive(json.loads(frozen[point]), arms[arm], model.cfg.total_ut_steps)
        return cache[point, arm]
    return covered


# ------------------------------------------------------------------------------ process control

def _exit_with_controller() -> None:
    """Linux: have the kernel SIGTERM this child when the controller that started it dies (prctl
    PR_SET_PDEATHSIG), however it dies; elsewhere :func:`_exit_if_orphaned` checks between arms."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    _exit_if_orphaned()  # the controller may have died before the prctl took effect


def _exit_if_orphaned() -> None:
    parent = os.environ.get("LOOPBENCH_CONTROLLER_PID")
    if parent and parent.isdigit() and os.getppid() != int(parent):
        _log(f"controller {parent} is gone: stopping")
        raise SystemExit(128 + int(signal.SIGTERM))


class _Stopped(SystemExit):
    """A signal's stop, raised by its handler: it unwinds the job like any SystemExit, then :func:`main`
    ends the process by the signal itself."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)   # the shell's status, should anything but main() end the process
        self.signum = signum


# A stop while a record and its log line are written waits for both (``held``: the signal, if one came); once
# everything the job asked for is recorded (``recorded``), SIGTERM is ignored (module docstring, "Stopping").
_STOPS: dict = {"holding": False, "held": None, "recorded": False}


def _stop_on_sigterm(signum, frame) -> None:
    if _STOPS["holding"]:
        _STOPS["held"] = signum
        return
    _log(f"{signal.Signals(signum).name}: stopping; an arm in flight is not recorded")
    # SystemExit unwinds through atomic_write_bytes, which removes its temporary file: no half record.
    raise _Stopped(signum)


@contextlib.contextmanager
def _record_and_log_line():
    """A record and its log line, written as one: a SIGTERM that comes meanwhile stops the job after both (the
    auditor holds a completed session to a log line per record), unless the job has then recorded everything."""
    _STOPS["holding"] = True
    try:
        yield
    finally:
        _STOPS["holding"] = False
    held, _STOPS["held"] = _STOPS["held"], None
    if held is not None and not _STOPS["recorded"]:
        _stop_on_sigterm(held, None)


def _job_recorded() -> None:
    """Everything the job asked for is recorded: a SIGTERM from now on is ignored, so the child ends normally (exit
    0) rather than by the signal. SIG_IGN, not a Python handler: it holds through the interpreter's finalisation too,
    where the signal module puts a Python handler's signal back to its default action."""
    _STOPS["recorded"] = True
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _end_by_signal(signum: int) -> None:
    """End this process by ``signum``'s default action, so that its parent records it as signalled
    (returncode -signum; harness/exit_status.py), not as an exit with the shell's 128 + signum."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _hold_jobs_lock(bundle: Path) -> int:
    """A shared lock on ``jobs/`` while the job runs; SystemExit when ``finish`` or a resume holds it."""
    fd = try_lock(bundle / "jobs", shared=True)
    if fd is None:
        _log(f"{bundle} is being finished or resumed by another process: not starting")
        raise SystemExit(1)
    return fd


def run_job(job_path: str) -> int:
    """Run one job file; returns 0 (an exception propagates, so its exit code is non-zero)."""
    job = json.loads(Path(job_path).read_text())
    _STOPS.update(holding=False, held=None, recorded=False)
    lock = _hold_jobs_lock(Path(job["bundle"]))
    try:
        if job["kind"] == "reference":
            capture_references(job)
        elif job["kind"] == "session":
            measure(job)
        else:
            raise ValueError(f"unknown job kind {job['kind']!r} in {job_path}")
    finally:
        os.close(lock)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m loopbench.harness.session JOB.json", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        _exit_with_controller()
        return run_job(argv[0])
    except _Stopped as stop:
        _end_by_signal(stop.signum)
        raise   # not reached: the signal's default action ends the process


if __name__ == "__main__":
    sys.exit(main())
