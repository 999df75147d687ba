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
  one raw JSON record (atomic), so a killed session leaves every completed arm behind. A job may name
  the ``seqs`` of the plan's order it measures (a resumed run's session measures the rest) and its
  ``session`` id, which every record it writes carries. A record also carries the arm's ``coverage``:
  how often each path where the layouts differ ran, derived from the frozen schedule on the host after
  the measured run (harness/coverage.py), never counted while timed.

Stopping: SIGTERM ends the child at once (an arm in flight is not recorded, and a record being written
is either whole or absent); on Linux the kernel sends that SIGTERM when the controller dies, even by
SIGKILL, so no child outlives its controller. While it runs, the child holds a shared lock on the
bundle's ``jobs/`` folder, by which ``finish`` and a resume tell that no child of the bundle still runs.

Timing: ``time.perf_counter`` around add_request ... run() (whose end synchronises the device and
copies the tokens to the host, i.e. the drain); on CUDA a ``torch.cuda.synchronize`` precedes both clock
reads. The garbage collector is collected before and disabled inside the timed region, as ``timeit``
does, so a collection of earlier garbage cannot land in one arm. Checking, telemetry and file writing
are outside the timer. Peak memory is reset before and read after each phase (CUDA; None on CPU).

This module is the only harness module that drives the runtime; it sees the plan as plain JSON.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from . import telemetry
from .evidence import atomic_write_json, atomic_write_text, canonical_json, sha256_bytes, try_lock
from .stats import tokens_per_s

RECORD_SCHEMA = 2   # 2: records carry ``coverage`` (harness/coverage.py)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _runtime():
    # Imported lazily: the controller imports this module for job helpers without loading the runtime.
    from loopbench.runtime import checkpoint, engine, model, schedule
    return checkpoint, engine, model, schedule


# ------------------------------------------------------------------------------------------ device

def resolve_device(job: dict) -> dict:
    """This child's device: torch device string, NVML index and a label for tables ("H200 #0", "cpu").

    A CPU job runs torch with ``cpu_threads`` intra-op threads (default 1): the CPU arms are tiny, and
    OpenMP threads that spin-wait for cores held by other processes made single arms 10-80x slower
    on a busy 2-core machine (measured), which is noise, not signal.
    """
    if job["device"]["kind"] == "cpu":
        torch.set_num_threads(job["device"].get("cpu_threads", 1))
        return {"kind": "cpu", "torch": "cpu", "gpu_index": None, "label": "cpu", "name": _cpu_name(), "uuid": None}
    if not torch.cuda.is_available():
        raise RuntimeError(f"job {job['name']} asks for CUDA, but torch.cuda.is_available() is False")
    index = job["device"].get("gpu_index")
    if index is None:  # a Slurm job: the scheduler pinned one GPU through CUDA_VISIBLE_DEVICES
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0]
        index = int(first) if first.isdigit() else None
    info = telemetry.device_info(index) if index is not None else None
    name = (info or {}).get("name") or torch.cuda.get_device_name(0)
    short = name.replace("NVIDIA ", "").replace("GeForce ", "")
    return {"kind": "cuda", "torch": "cuda:0", "gpu_index": index, "name": name,
            "label": f"{short} #{index if index is not None else 0}", "uuid": (info or {}).get("uuid")}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _sync(device: dict) -> None:
    if device["kind"] == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ inputs

def load_model(checkpoint_path: str, dtype: str, device: dict, max_model_len: int):
    ckpt, _, model, _ = _runtime()
    cfg, tensors = ckpt.load_checkpoint(checkpoint_path, dtype=_DTYPES[dtype], device=device["torch"])
    return model.OuroModel.from_tensors(cfg, tensors, device=device["torch"], dtype=_DTYPES[dtype],
                                        rope_len=max_model_len)


def build_requests(prompts: list[list[int]], num_requests: int, output_len: int, exit_conf: dict) -> list:
    """The point's requests: the first C prompts of the pool, ids r0000.., exactly D tokens, EOS ignored."""
    _, engine, _, _ = _runtime()
    if len(prompts) < num_requests:
        raise ValueError(f"the prompt pool has {len(prompts)} prompts, the point needs {num_requests}")
    return [engine.Request(request_id=f"r{i:04d}", prompt_token_ids=tuple(prompts[i]), max_tokens=output_len,
                           min_loops=exit_conf["min_loops"], max_loops=exit_conf["max_loops"],
                           exit_threshold=exit_conf["threshold"], ignore_eos=True)
            for i in range(num_requests)]


def engine_config(arm: dict, max_num_seqs: int, max_model_len: int, policy: str, schedule=None):
    _, engine, _, _ = _runtime()
    return engine.EngineConfig(
        max_num_seqs=max_num_seqs, block_size=arm["block_size"], max_model_len=max_model_len,
        kv_layout=arm["kv_layout"], prefix_tiles=arm["prefix_tiles"], tile_size=arm["tile_size"],
        attention_backend=arm["attention_backend"], exit_policy=policy, schedule=schedule,
        cuda_graphs=arm["cuda_graphs"], graph_cache_size=arm["graph_cache_size"],
        descriptor_mode=arm["descriptor_mode"])


# --------------------------------------------------------------------------------------- one phase

def begin_repeat_run(engine) -> None:
    """Let ``engine`` run the same request ids again (the measured run after the warmup).

    ``LoopEngine.reset_run()`` forgets finished requests and restarts the row-trace hash; graphs,
    buffers, allocations and the cumulative stats stay (``run_phase`` takes per-run differences).
    """
    engine.reset_run()


def run_phase(engine, requests: list, device: dict) -> dict:
    """Submit every request and drain; timed from the first submission to the drained outputs."""
    before = engine.stats.copy()
    if device["kind"] == "cuda":
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
    run = engine.stats.minus(before)
    cuda = device["kind"] == "cuda"
    return {
        "elapsed_s": elapsed_s,
        "outputs": {rid: {"token_ids": [int(t) for t in o.token_ids], "exit_depths": [int(d) for d in o.exit_depths],
                          "finish_reason": o.finish_reason} for rid, o in sorted(outputs.items())},
        "work": run.work(),
        # decode-core graphs as captures/replays/fallbacks, prefill graphs under the prefill_ prefix:
        # every "*captures" counter of a measured run must be zero.
        "graphs": {**dataclasses.asdict(run.decode_graphs),
                   **{f"prefill_{k}": v for k, v in dataclasses.asdict(run.prefill_graphs).items()}},
        "memory": {"peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                   "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None},
        "kv_blocks_used": run.peak_kv_blocks,
        "trace_sha256": getattr(engine, "trace_sha256", None),
    }


# ------------------------------------------------------------------------------------------- jobs

def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def reference_cache_key(material: dict, device: dict) -> str:
    """What a frozen reference depends on: inputs, runtime code, device model and torch version."""
    return sha256_bytes(canonical_json({**material, "device_name": device["name"],
                                        "torch": torch.__version__}).encode())


def capture_references(job: dict) -> None:
    bundle, spec = Path(job["bundle"]), job["spec"]
    device = resolve_device(job)
    prompts = json.loads((bundle / spec["prompts_file"]).read_text())
    model = None
    cache = Path(spec["cache_dir"]) / "references"
    for point in spec["points"]:
        key = reference_cache_key({**spec["key_material"], "point": point}, device)
        cached = cache / key
        sched_text = meta = None
        if spec["reuse"] and (cached / "schedule.json").is_file() and (cached / "meta.json").is_file():
            sched_text = (cached / "schedule.json").read_text()
            meta = json.loads((cached / "meta.json").read_text())
            if meta.get("schedule_sha256") != sha256_bytes(sched_text.encode()):
                sched_text = meta = None  # a damaged cache entry is recaptured, never trusted
            else:
                meta["reused"] = True
                _log(f"reference {point['key']}: reused {key[:12]}")
        if sched_text is None:
            if model is None:
                model = load_model(spec["checkpoint_path"], spec["dtype"], device, spec["max_model_len"])
            reqs = build_requests(prompts, point["num_requests"], spec["output_len"], spec["exit"])
            _, engine_mod, _, _ = _runtime()
            eng = engine_mod.LoopEngine(model, engine_config(spec["arm_config"], point["max_num_seqs"],
                                                             spec["max_model_len"], spec["exit"]["policy"]))
            phase = run_phase(eng, reqs, device)
            sched_text = eng.capture_schedule().to_json()
            meta = {"point": point["key"], "arm": spec["arm"], "arm_config": spec["arm_config"],
                    "policy": spec["exit"]["policy"], "work": phase["work"], "graphs": phase["graphs"],
                    "elapsed_s": phase["elapsed_s"], "device": device, "torch": torch.__version__,
                    "cache_key": key, "schedule_sha256": sha256_bytes(sched_text.encode()), "reused": False}
            cached.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cached / "schedule.json", sched_text)
            atomic_write_json(cached / "meta.json", {**meta, "reused": False})
            _log(f"reference {point['key']}: captured {key[:12]} in {phase['elapsed_s']:.2f}s")
        atomic_write_text(bundle / "references" / f"{point['key']}.schedule.json", sched_text)
        atomic_write_json(bundle / "references" / f"{point['key']}.meta.json", meta)


def measure(job: dict) -> None:
    bundle = Path(job["bundle"])
    plan = json.loads((bundle / "plan.json").read_text())
    cfg = plan["config"]
    device = resolve_device(job)
    _, engine_mod, _, schedule_mod = _runtime()
    prompts = json.loads((bundle / plan["prompts"]["file"]).read_text())
    points = {p["key"]: p for p in plan["points"]}
    max_len = plan["max_model_len"]
    _log(f"session {job['name']} on {device['label']}: loading {plan['checkpoint']['path']}")
    model = load_model(plan["checkpoint"]["path"], cfg["model"]["dtype"], device, max_len)
    schedules, requests, frozen = {}, {}, {}
    for key, pt in points.items():
        frozen[key] = (bundle / pt["reference"]["file"]).read_text()
        schedules[key] = schedule_mod.Schedule.from_json(frozen[key])
        requests[key] = build_requests(prompts, pt["num_requests"], cfg["workload"]["output_len"], cfg["exit"])
    out_dir = bundle / "raw" / job["name"]
    covered = arm_coverage(frozen, cfg["arms"], model)
    kill_after = cfg["fault"]["kill_after_arms"]
    done = 0
    seqs = set(job["seqs"]) if job.get("seqs") is not None else None
    for item in plan["order"][job["name"]]:
        if seqs is not None and item["seq"] not in seqs:
            continue
        _exit_if_orphaned()
        if kill_after is not None and done >= kill_after:
            _log(f"fault.kill_after_arms={kill_after}: SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)
        pt, arm = points[item["point"]], cfg["arms"][item["arm"]]
        eng = engine_mod.LoopEngine(model, engine_config(arm, pt["max_num_seqs"], max_len, "replay",
                                                         schedules[item["point"]]))
        warm = run_phase(eng, requests[item["point"]], device) if cfg["warmup"] else None
        if warm is not None:
            begin_repeat_run(eng)
        tele_start = telemetry.sample(device["gpu_index"])
        start_unix_s = time.time()
        meas = run_phase(eng, requests[item["point"]], device)
        end_unix_s = time.time()
        tele_end = telemetry.sample(device["gpu_index"])
        del eng
        gc.collect()
        if device["kind"] == "cuda":  # the next arm starts from the same allocator state
            torch.cuda.empty_cache()
        rec = {"schema": RECORD_SCHEMA, "job": job["name"], "session": job.get("session", job["name"]),
               "device": device, "seq": item["seq"],
               "point": item["point"], "max_num_seqs": pt["max_num_seqs"], "num_requests": pt["num_requests"],
               "output_len": cfg["workload"]["output_len"], "comparison": item["comparison"], "pair": item["pair"],
               "position": item["position"], "slot": item["slot"], "arm": item["arm"], "arm_config": arm,
               "tokens_per_s": tokens_per_s(pt["num_requests"], cfg["workload"]["output_len"], meas["elapsed_s"]),
               "warmup": warm, "measured": meas, "coverage": covered(item["point"], item["arm"]),
               "telemetry": {"start": tele_start, "end": tele_end},
               "wall_clock": {"measured_start_unix_s": start_unix_s, "measured_end_unix_s": end_unix_s}}
        name = f"{item['seq']:05d}-{item['point']}-{item['comparison']}-p{item['pair']}-{item['position']}.json"
        atomic_write_json(out_dir / name, rec)
        done += 1
        _log(f"{item['seq']:4d} {item['point']} {item['comparison']} pair {item['pair']} {item['position']:9s} "
             f"{item['arm']:>14s}: {meas['elapsed_s']:.4f}s {rec['tokens_per_s']:.1f} tok/s")


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


def _stop_on_sigterm(signum, frame) -> None:
    _log(f"{signal.Signals(signum).name}: stopping; an arm in flight is not recorded")
    # SystemExit unwinds through atomic_write_bytes, which removes its temporary file: no half record.
    raise SystemExit(128 + signum)


def _hold_jobs_lock(bundle: Path) -> int:
    """A shared lock on ``jobs/`` while the job runs; SystemExit when ``finish`` or a resume holds it."""
    fd = try_lock(bundle / "jobs", shared=True)
    if fd is None:
        _log(f"{bundle} is being finished or resumed by another process: not starting")
        raise SystemExit(1)
    return fd


def arm_coverage(frozen: dict[str, str], arms: dict, model):
    """``(point, arm) -> coverage counts`` (harness/coverage.py) of replaying the point's frozen schedule.

    ``frozen`` maps a point key to its schedule's JSON text; ``model`` gives the number of planes
    (``cfg.total_ut_steps``). Pure host arithmetic, computed once per (point, arm) when the first record
    asks, i.e. after that arm's measured run and outside its timer.
    """
    from . import coverage

    cache: dict[tuple[str, str], dict] = {}

    def covered(point: str, arm: str) -> dict:
        if (point, arm) not in cache:
            cache[point, arm] = coverage.derive(json.loads(frozen[point]), arms[arm], model.cfg.total_ut_steps)
        return cache[point, arm]
    return covered


def run_job(job_path: str) -> int:
    """Run one job file; returns 0 (an exception propagates, so its exit code is non-zero)."""
    job = json.loads(Path(job_path).read_text())
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
    _exit_with_controller()
    return run_job(argv[0])


if __name__ == "__main__":
    sys.exit(main())
