"""The controller: validate, freeze the plan, capture or reuse the references, run sessions, check, bundle.

Order of work (BRIEF section 2, issue 3):

1. :func:`conf.validate`, then :func:`conf.check_fits_model` against the model's config (loops,
   positions) and the prompt pool - a bad key or value fails here, before anything is written or measured.
2. Inputs: the checkpoint (a synthetic one of the preset, written once into the cache, or a real one),
   the prompt pool, and their sha256s; the code's git SHA, dirty flag and a hash of the runtime sources.
3. References: one ``reference`` child on the first device runs (or reuses by hash) a natural capture
   of the reference arm per point; the frozen ``Schedule`` files land in ``references/``.
4. ``plan.json``: resolved config and its sha256, code identity, checkpoint and prompts hashes, the
   references' sha256s, the devices and the full measurement order, written before any measurement.
5. Sessions: one child per device (local processes or submitit jobs) with timeouts and a progress bar
   fed by the raw records the sessions write as each arm completes.
6. :mod:`checker`, :mod:`stats` and :mod:`evidence` turn whatever was recorded into the bundle; a
   failed, killed, timed-out or interrupted run is marked incomplete and publishes no verdict.

Interruption (issue 8, item 4): while children run, SIGTERM and Ctrl-C only request a stop
(:class:`StopSignals`); the executor stops the children's process groups (SIGTERM, then SIGKILL after
``executor.stop_grace_s``), marks them ``interrupted`` and the controller publishes what was recorded.
``children.json`` is kept current as children start and end, so the bundle of a controller that died
without publishing can be finished (:func:`resume.finish`) or resumed (:func:`resume.resume`).

The measurement order: per point, the comparisons' pairs interleaved (pair 0 of every comparison,
then pair 1, ...), each pair's first arm from ``stats.balanced_first`` seeded with
(order_seed, point index, comparison index); every session runs the same order.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from . import checker, conf, evidence, stats, telemetry
from .executors import REPO_ROOT, ChildSpec, LocalExecutor, SubmititExecutor, running_result

PLAN_SCHEMA = 1


@dataclass(frozen=True)
class RunResult:
    bundle: Path
    summary: dict


# ---------------------------------------------------------------------------------------- identity

GIT_SHA_ENV = "LOOPBENCH_GIT_SHA"
_HEX_SHA = re.compile(r"[0-9a-f]{7,64}")


def _git(root: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def own_git_repo(root: Path) -> bool:
    """Whether ``root`` is the top of its own git work tree (a clone or a ``git worktree``), symlinks resolved.

    A project tree copied into a folder of some other repository has no ``.git`` of its own; git would
    still answer from the enclosing repository, whose SHA and dirty flag say nothing about this tree.
    """
    top = _git(root, "rev-parse", "--show-toplevel")
    return top is not None and Path(top).resolve() == Path(root).resolve()


def _env_git_sha() -> str | None:
    """``LOOPBENCH_GIT_SHA`` lower-cased, or None when unset; ValueError when it is no hex SHA."""
    value = os.environ.get(GIT_SHA_ENV)
    if value is None:
        return None
    if not _HEX_SHA.fullmatch(value.strip().lower()):
        raise ValueError(f"{GIT_SHA_ENV} = {value!r} is not a git commit SHA (7 to 64 hex digits)")
    return value.strip().lower()


def code_identity(root: Path = REPO_ROOT) -> dict:
    """Which code ran: {git_sha, git_dirty, git_sha_source, code_sha256} (+ git_head_observed, git_dirty_observed).

    ``git_sha``/``git_dirty`` (tracked files) come from git only when ``root`` is its own repository's
    top level (:func:`own_git_repo`); otherwise from ``LOOPBENCH_GIT_SHA`` (a copied tree, e.g. on a lent
    GPU host: the caller names the commit it copied, and the dirty flag is unknowable, None), else both
    None ("unknown"). A ``LOOPBENCH_GIT_SHA`` that disagrees with the project's own HEAD wins too: a copy
    may carry a stale ``.git`` (seen on the lent GPU host, whose copy's HEAD was the session's first
    commit), and the operator's explicit statement outranks it; git's HEAD and dirty flag are then kept as
    ``git_head_observed``/``git_dirty_observed`` so nothing is hidden. ``code_sha256`` hashes the runtime
    sources (runtime, harness, kernels) and is what ties the run to its source in every case. Raises ValueError
    when ``LOOPBENCH_GIT_SHA`` is set and no hex SHA.
    """
    root = Path(root)
    h = hashlib.sha256()
    for folder in ("runtime", "harness", "kernels"):
        for p in sorted((root / folder).rglob("*.py")):
            h.update(f"{p.relative_to(root).as_posix()}\0{p.stat().st_size}\0".encode())
            h.update(p.read_bytes())
    env_sha = _env_git_sha()
    sha = _git(root, "rev-parse", "HEAD") if own_git_repo(root) else None
    dirty = None
    if sha is not None:
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        dirty = bool(status) if status is not None else None
    if sha is not None and (env_sha is None or sha.startswith(env_sha)):
        return {"git_sha": sha, "git_dirty": dirty, "git_sha_source": "git", "code_sha256": h.hexdigest()}
    ident = {"git_sha": env_sha, "git_dirty": None, "git_sha_source": GIT_SHA_ENV if env_sha else None,
             "code_sha256": h.hexdigest()}
    if sha is not None:
        ident.update(git_head_observed=sha, git_dirty_observed=dirty)
    return ident


# ------------------------------------------------------------------------------------------ inputs

def model_config(plain: dict) -> dict:
    """The model's ``config.json`` keys (vocab, loops, positions) before anything is written: the preset's
    table entry, or a real checkpoint's own ``config.json``."""
    from loopbench.runtime.checkpoint import CONFIG_NAME, config_from_hf_dict
    from loopbench.runtime.model import PRESETS

    m = plain["model"]
    path = _checkpoint_path(m)
    if path is not None:
        return config_from_hf_dict(json.loads((path / CONFIG_NAME).read_text())).to_dict()
    if m["preset"] not in PRESETS:
        raise ValueError(f"model.preset = {m['preset']!r} is not a preset; known: {sorted(PRESETS)}")
    return PRESETS[m["preset"]].to_dict()


def _checkpoint_path(m: dict) -> Path | None:
    """``model.checkpoint`` resolved, or None for a preset; ValueError when it is no HF checkpoint."""
    from loopbench.runtime.checkpoint import CONFIG_NAME

    if not m["checkpoint"]:
        return None
    path = Path(m["checkpoint"]).expanduser().resolve()
    if not (path / CONFIG_NAME).is_file():
        raise ValueError(f"model.checkpoint = {m['checkpoint']!r} is not an HF checkpoint directory "
                         f"(no {CONFIG_NAME})")
    return path


def prepare_checkpoint(plain: dict, cache: Path) -> dict:
    """The checkpoint directory, its sha256 (of the stored bytes), model config and stored dtypes; a
    synthetic one is written once, then reused.

    ``stored_dtypes`` is ``checkpoint.dtype_record``: HF dtype name -> tensor names as stored, before the
    sessions cast every tensor to ``model.dtype``; reading it validates every tensor header (names,
    shapes, floating dtypes), so a broken checkpoint fails here, before anything is measured.
    """
    from loopbench.runtime.checkpoint import CONFIG_NAME, checkpoint_sha256, config_from_hf_dict, dtype_record, stored_dtypes
    from .fixtures import write_calibrated_checkpoint
    from .session import _DTYPES

    m = plain["model"]
    path = _checkpoint_path(m)
    if path is not None:
        source, description = "path", f"checkpoint {path}"
    else:
        from loopbench.runtime.model import PRESETS

        if m["preset"] not in PRESETS:
            raise ValueError(f"model.preset = {m['preset']!r} is not a preset; known: {sorted(PRESETS)}")
        path = cache / "checkpoints" / f"{m['preset']}-seed{m['seed']}-{m['dtype']}-calibrated"
        if not (path / CONFIG_NAME).is_file():
            import torch

            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            # the exit-gate bias is calibrated on the model's own loop-1/2 states (harness/fixtures.py)
            write_calibrated_checkpoint(tmp, m["preset"], seed=m["seed"], dtype=_DTYPES[m["dtype"]],
                                        device="cuda" if torch.cuda.is_available() else "cpu")
            tmp.rename(path)  # atomic: a half-written checkpoint is never found under the final name
            if torch.cuda.is_available():  # give the calibration's memory back before any session starts
                torch.cuda.empty_cache()
        source, description = "synthetic", f"synthetic `{m['preset']}` (seed {m['seed']})"
    cfg = config_from_hf_dict(json.loads((path / CONFIG_NAME).read_text()))
    return {"source": source, "path": str(path), "preset": None if m["checkpoint"] else m["preset"],
            "description": description, "sha256": checkpoint_sha256(path), "model_config": cfg.to_dict(),
            "stored_dtypes": dtype_record(stored_dtypes(path))}


def read_prompts_file(path: Path) -> list[list[int]]:
    """Token-id prompts from parquet (a ``prompt_token_ids`` list column) or JSONL (a list, or an object
    with ``prompt_token_ids``, per line)."""
    if path.suffix == ".parquet":
        import pandas as pd

        df = pd.read_parquet(path)
        if "prompt_token_ids" not in df.columns:
            raise ValueError(f"{path}: no 'prompt_token_ids' column (columns: {list(df.columns)})")
        return [[int(t) for t in row] for row in df["prompt_token_ids"]]
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        ids = item.get("prompt_token_ids") if isinstance(item, dict) else item
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{path}:{n}: expected a non-empty list of token ids, got {str(item)[:80]!r}")
        prompts.append(ids)
    return prompts


def make_prompts(plain: dict, vocab_size: int) -> list[list[int]]:
    """The prompt pool: seeded uniform token ids (numpy ``default_rng(prompt_seed)``), or the user's file.

    With ``prompt_lens`` prompt i has ``prompt_lens[i % len(prompt_lens)]`` tokens, drawn in prompt order
    from the same generator; with one ``prompt_len`` the pool is one [C, P] draw, as it always was.
    """
    wl = plain["workload"]
    need = max(p["num_requests"] for p in plain["points"])
    if wl["prompts_file"]:
        prompts = read_prompts_file(Path(wl["prompts_file"]).expanduser())
        if len(prompts) < need:
            raise ValueError(f"workload.prompts_file has {len(prompts)} prompts; the largest point needs {need}")
        bad = [(i, t) for i, p in enumerate(prompts) for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"workload.prompts_file: prompt {bad[0][0]} has token id {bad[0][1]} outside "
                             f"[0, {vocab_size})")
        return prompts[:need]
    rng = np.random.default_rng(wl["prompt_seed"])
    if wl.get("prompt_lens"):
        lens = wl["prompt_lens"]
        return [rng.integers(0, vocab_size, size=lens[i % len(lens)]).tolist() for i in range(need)]
    return rng.integers(0, vocab_size, size=(need, wl["prompt_len"])).tolist()


# ----------------------------------------------------------------------------------------- devices

def resolve_devices(plain: dict) -> list[dict]:
    """One entry per session: {name, kind, gpu_index, label}. CPU: a single session."""
    exe = plain["executor"]
    kind = exe["device"]
    if exe["kind"] == "slurm":
        use_gpu = kind != "cpu"
        return [{"name": f"slurm{i}", "kind": "cuda" if use_gpu else "cpu", "gpu_index": None,
                 "label": f"slurm job {i}" if use_gpu else "cpu"} for i in range(exe["slurm"]["jobs"])]
    import torch

    n_gpus = torch.cuda.device_count() if kind != "cpu" else 0
    if kind == "cuda" and n_gpus == 0:
        raise ValueError("executor.device = cuda, but no CUDA device is visible")
    if n_gpus == 0:
        return [{"name": "cpu0", "kind": "cpu", "gpu_index": None, "label": "cpu"}]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [int(x) for x in visible.split(",")] if visible and all(x.strip().isdigit() for x in visible.split(",")) \
        else list(range(n_gpus))
    gpus = exe["gpus"] if exe["gpus"] is not None else physical
    for g in gpus:
        if g not in physical:
            raise ValueError(f"executor.gpus lists GPU {g}, visible GPUs are {physical}")
    out = []
    for g in gpus:
        info = telemetry.device_info(g) or {}
        short = (info.get("name") or "GPU").replace("NVIDIA ", "").replace("GeForce ", "")
        out.append({"name": f"gpu{g}", "kind": "cuda", "gpu_index": g, "label": f"{short} #{g}"})
    return out


def measurement_order(plain: dict, points: list[dict]) -> list[dict]:
    """Every arm run of one session, in order (see the module docstring)."""
    order, seq = [], 0
    comps = plain["comparisons"]
    for pi, pt in enumerate(points):
        firsts = [stats.balanced_first(plain["pairs"], [plain["order_seed"], pi, ci]) for ci in range(len(comps))]
        for pair in range(plain["pairs"]):
            for ci, comp in enumerate(comps):
                positions = ("baseline", "candidate") if firsts[ci][pair] == "baseline" else ("candidate", "baseline")
                for slot, pos in enumerate(positions):
                    order.append({"seq": seq, "point": pt["key"], "comparison": comp["name"], "pair": pair,
                                  "position": pos, "slot": slot, "arm": comp[pos]})
                    seq += 1
    return order


# ------------------------------------------------------------------------------------- environment

def environment(devices: list[dict]) -> dict:
    from importlib import metadata

    import torch

    pkgs = {}
    for name in ("torch", "triton", "numpy", "scipy", "pandas", "pyarrow", "hydra-core", "omegaconf", "submitit",
                 "safetensors", "matplotlib", "nvidia-ml-py", "tqdm"):
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    from .session import _cpu_name

    gpus = [telemetry.device_info(d["gpu_index"]) for d in devices if d["gpu_index"] is not None]
    return {
        "host": socket.gethostname(), "platform": platform.platform(),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "cpu": {"model": _cpu_name(), "logical_cores": os.cpu_count()},
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
                  "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None},
        "packages": pkgs, "gpus": gpus,
        "gpu_telemetry_at_start": [telemetry.sample(d["gpu_index"]) for d in devices if d["gpu_index"] is not None],
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "OMP_NUM_THREADS")},
    }


# -------------------------------------------------------------------------------------------- run

def _executor(plain: dict, bundle: Path, cache: Path, devices: list[dict]):
    if plain["executor"]["kind"] == "slurm":
        return SubmititExecutor(cache / "submitit" / bundle.name, plain["executor"]["slurm"],
                                use_gpus=devices[0]["kind"] == "cuda")
    return LocalExecutor()


def _progress(bundle: Path, total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but a bar is never worth failing a run for
        return lambda: None, lambda: None
    bar = tqdm(total=total, desc="arms", unit="arm", dynamic_ncols=True, file=sys.stderr)

    def update() -> None:
        done = len(list((bundle / "raw").glob("*/*.json")))
        if done > bar.n:
            bar.update(done - bar.n)
    return update, bar.close


def _job(bundle: Path, kind: str, dev: dict, stem: str | None = None, **extra) -> Path:
    """Write ``jobs/<kind>-<stem>.json`` (stem: the device's name, or a resumed session's id)."""
    job = {"kind": kind, "name": dev["name"], "bundle": str(bundle),
           "device": {"kind": dev["kind"], "gpu_index": dev["gpu_index"], "cpu_threads": dev["cpu_threads"]},
           **extra}
    path = bundle / "jobs" / f"{kind}-{stem or dev['name']}.json"
    evidence.atomic_write_json(path, job)
    return path


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


def write_children(bundle: Path, children: list[dict]) -> None:
    """``children.json`` is rewritten at every change (a child starts, ends), so that a controller that
    dies leaves the list of children it had started for ``finish``."""
    evidence.atomic_write_json(bundle / "children.json", children)


def session_id(name: str, attempt: int) -> str:
    """A session child's id: its device's name in the first run, ``<name>.r<k>`` in the k-th resume."""
    return name if attempt == 0 else f"{name}.r{attempt}"


def run_sessions(plain: dict, executor, bundle: Path, devices: list[dict], children: list[dict], stop: StopSignals,
                 attempt: int = 0, seqs: dict[str, list[int]] | None = None) -> list[dict]:
    """Start one session child per device (measuring ``seqs[name]`` of its order, or all of it), wait for
    them or for ``stop``; returns their children.json entries."""
    ex = plain["executor"]
    specs = []
    for d in devices:
        sid = session_id(d["name"], attempt)
        extra = {"session": sid} if seqs is None else {"session": sid, "seqs": seqs[d["name"]]}
        specs.append(ChildSpec(d["name"], _job(bundle, "session", d, sid, **extra), bundle / "logs" / f"{sid}.log",
                               d["gpu_index"], d["label"], ex["session_timeout_s"], sid, attempt))
    write_children(bundle, children + [running_result(s).to_dict() for s in specs])
    total = sum(len(v) for v in json.loads((bundle / "plan.json").read_text())["order"].values())
    update, close = _progress(bundle, total)
    try:
        results = executor.run(specs, progress=update, poll_s=ex["poll_s"], stop=stop, grace_s=ex["stop_grace_s"])
    finally:
        close()
    return [r.to_dict() for r in results]


REFERENCE_FAILED = "reference_failed"   # a status code of loopbench/bundle_format.json


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


def publish(bundle: Path, plan: dict, children: list[dict], env: dict) -> RunResult:
    """Check and bundle whatever the raw records hold: tables, summary, report, plot, manifest (last)."""
    for rel in evidence.remove_stale_temp_files(bundle):
        print(f"loopbench: removed {rel}, a temporary file of a writer killed mid-write", flush=True)
    write_children(bundle, children)
    references = {}
    for pt in plan["points"]:
        if "reference" in pt:
            references[pt["key"]] = {"schedule": json.loads((bundle / pt["reference"]["file"]).read_text()),
                                     "work": json.loads((bundle / pt["reference"]["meta_file"]).read_text())["work"]}
    report = checker.check(evidence.load_records(bundle), references, warmup=plan["config"]["warmup"])
    summary = evidence.finalize(bundle, plan, report.to_dict(), children, env, reference_failure(plan, children))
    return RunResult(bundle, summary)


def make_plan(plain: dict, code: dict, ckpt: dict, prompts: list[list[int]], prompts_text: str, max_model_len: int,
              points: list[dict], devices: list[dict]) -> dict:
    """``plan.json``: everything a measurement depends on, hashed, and the full measurement order."""
    order = measurement_order(plain, points)
    return {
        "schema_version": PLAN_SCHEMA, "name": plain["name"],
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": plain, "config_sha256": evidence.sha256_bytes(evidence.canonical_json(plain).encode()),
        "code": code, "checkpoint": ckpt,
        "prompts": {"file": "prompts.json", "sha256": evidence.sha256_bytes(prompts_text.encode()),
                    "count": len(prompts), "lengths": sorted({len(p) for p in prompts})},
        "max_model_len": max_model_len, "points": points, "reference_arm": conf.reference_arm(plain),
        "devices": devices, "order": {d["name"]: order for d in devices},
    }


def inputs(plain: dict) -> dict:
    """What a plan is made of, before the bundle: model config, prompts, devices, code identity; a value
    the model or the devices cannot take fails here, before anything is written."""
    model_cfg = model_config(plain)
    prompts = make_prompts(plain, model_cfg["vocab_size"])
    conf.check_fits_model(plain, model_cfg, max(len(p) for p in prompts))
    devices = [{**d, "cpu_threads": plain["executor"]["cpu_threads"]} for d in resolve_devices(plain)]
    if all(d["kind"] == "cpu" for d in devices):
        for name, arm in plain["arms"].items():
            if arm["cuda_graphs"]:
                raise ValueError(f"arms.{name}.cuda_graphs = true needs a CUDA device, but the sessions would run "
                                 f"on the CPU (executor.device = {plain['executor']['device']}); use a CUDA host, "
                                 f"--config-name cpu-smoke, or arms.{name}.cuda_graphs=false")
    prompts_text = json.dumps(prompts, separators=(",", ":")) + "\n"
    # positions 0..P+D-2: the D-th output token is sampled, never fed back (the engine's admission rule)
    max_model_len = max(len(p) for p in prompts) + plain["workload"]["output_len"] - 1
    points = [{"key": f"B{p['max_num_seqs']}C{p['num_requests']}", **p,
               "requests": evidence.point_requests(p["num_requests"])} for p in plain["points"]]
    return {"prompts": prompts, "prompts_text": prompts_text, "max_model_len": max_model_len, "points": points,
            "devices": devices, "code": code_identity(), "cache": conf.cache_dir(plain)}


def run(cfg: DictConfig | dict) -> RunResult:
    """Run one benchmark end to end, or resume one (``resume``); returns the bundle and its summary (never a
    verdict for a partial run). SIGTERM or Ctrl-C stops the children and publishes an incomplete bundle."""
    plain = conf.validate(cfg)
    if plain["resume"] is not None:
        from .resume import resume

        return resume(plain)
    got = inputs(plain)
    code, devices, cache, points = got["code"], got["devices"], got["cache"], got["points"]
    short = code["git_sha"][:8] if code["git_sha"] else "nogit"
    results_dir = Path(plain["results_dir"])
    if not results_dir.is_absolute():
        results_dir = REPO_ROOT / results_dir
    bundle = evidence.bundle_dir(results_dir, plain["name"], short)
    lock = evidence.try_lock(bundle)  # held while this controller lives: finish and resume keep off
    print(f"loopbench: bundle {bundle}", flush=True)
    try:
        ckpt = prepare_checkpoint(plain, cache)
        evidence.atomic_write_text(bundle / "prompts.json", got["prompts_text"])
        env = environment(devices)
        evidence.atomic_write_json(bundle / "environment.json", env)
        executor = _executor(plain, bundle, cache, devices)
        ex = plain["executor"]
        with StopSignals() as stop:
            # --- references (a natural run of the reference arm per point, or the cached one)
            ref_arm = conf.reference_arm(plain)
            key_material = {"checkpoint_sha256": ckpt["sha256"],
                            "prompts_sha256": evidence.sha256_bytes(got["prompts_text"].encode()),
                            "workload": plain["workload"], "exit": plain["exit"], "arm": plain["arms"][ref_arm],
                            "dtype": plain["model"]["dtype"], "code_sha256": code["code_sha256"]}
            ref_job = _job(bundle, "reference", devices[0], spec={
                "checkpoint_path": ckpt["path"], "dtype": plain["model"]["dtype"], "prompts_file": "prompts.json",
                "points": points, "output_len": plain["workload"]["output_len"], "exit": plain["exit"],
                "arm": ref_arm, "arm_config": plain["arms"][ref_arm], "max_model_len": got["max_model_len"],
                "cache_dir": str(cache), "reuse": plain["reuse_references"], "key_material": key_material})
            ref_spec = ChildSpec("reference", ref_job, bundle / "logs" / "reference.log", devices[0]["gpu_index"],
                                 devices[0]["label"], ex["reference_timeout_s"])
            write_children(bundle, [running_result(ref_spec).to_dict()])
            children = [c.to_dict() for c in executor.run([ref_spec], poll_s=ex["poll_s"], stop=stop,
                                                          grace_s=ex["stop_grace_s"])]
            write_children(bundle, children)
            for pt in points:
                f = bundle / "references" / f"{pt['key']}.schedule.json"
                meta = bundle / "references" / f"{pt['key']}.meta.json"
                if f.is_file() and meta.is_file():
                    pt["reference"] = {"file": f.relative_to(bundle).as_posix(), "sha256": evidence.sha256_file(f),
                                       "meta_file": meta.relative_to(bundle).as_posix(),
                                       "meta_sha256": evidence.sha256_file(meta)}

            # --- the frozen plan, then the sessions (not after a failed or stopped reference capture)
            plan = make_plan(plain, code, ckpt, got["prompts"], got["prompts_text"], got["max_model_len"], points,
                             devices)
            evidence.atomic_write_json(bundle / "plan.json", plan)
            if children[0]["state"] == "completed" and all("reference" in pt for pt in points):
                children += run_sessions(plain, executor, bundle, devices, children, stop)
            return publish(bundle, plan, children, env)
    finally:
        os.close(lock)
