"""Machine discovery: which devices the sessions run on, what they are called, what the host is.

Written once for the controller (the planned devices, the environment record) and the session child
(its own device). GPUs are numbered physically (PCI bus order, as NVML numbers them; the executors set
``CUDA_DEVICE_ORDER=PCI_BUS_ID``), so ``CUDA_VISIBLE_DEVICES``, NVML and the plan name a GPU alike; a
parent started with a narrowed mask (``1``, ``1,0``, a card's UUID) plans the physical cards it names.
A CPU run may simulate several devices (``executor.cpu_devices``): sessions ``cpu0``, ``cpu1``..., each
its own child pinned by :data:`CPU_DEVICE_ENV` as a GPU child is by ``CUDA_VISIBLE_DEVICES``.
torch is imported inside the functions that need it: importing this module loads no framework.
"""
from __future__ import annotations

import os
import platform
import socket
import sys
import time
from pathlib import Path

from . import telemetry
from .fileio import bundle_format

PACKAGES = ("torch", "triton", "numpy", "scipy", "pandas", "pyarrow", "hydra-core", "omegaconf", "submitit",
            "safetensors", "matplotlib", "nvidia-ml-py", "tqdm")
CPU_DEVICE_ENV = "LOOPBENCH_CPU_DEVICE"   # a simulated CPU device's index, set by the executor per child


def gpu_label(name: str | None, index: int | None) -> str:
    """A table label for a GPU: "H200 #0" from "NVIDIA H200" and physical index 0."""
    short = (name or "GPU").replace("NVIDIA ", "").replace("GeForce ", "")
    return f"{short} #{index if index is not None else 0}"


def visible_gpus(environ: dict | None = None) -> list[int] | None:
    """The physical GPU indices ``CUDA_VISIBLE_DEVICES`` lists, or None when it is unset, empty or not a
    list of integers (UUIDs, MIG names: then CUDA's own numbering is all there is)."""
    raw = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    parts = [x.strip() for x in raw.split(",")] if raw else []
    return [int(x) for x in parts] if parts and all(x.isdigit() for x in parts) else None


def physical_gpus(n_gpus: int, environ: dict | None = None) -> list[int]:
    """The physical indices of CUDA devices 0..n_gpus-1 of this process: ``CUDA_VISIBLE_DEVICES``'s integers
    (``1,0``: CUDA's 0 is physical 1), or its UUIDs resolved through NVML, or 0..n_gpus-1 without a mask.

    A child is pinned by physical index (``CUDA_VISIBLE_DEVICES=<index>``, PCI bus order), so a mask entry
    that names no physical index, a MIG instance, a UUID prefix or a UUID without NVML, raises ValueError
    naming it: falling back to CUDA's own numbering would pin the child to another card."""
    raw = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if not raw:
        return list(range(n_gpus))
    listed = visible_gpus(environ)
    if listed is not None:
        return listed[:n_gpus]   # CUDA stops enumerating at the first index it cannot use
    out = []
    for entry in [x.strip() for x in raw.split(",")][:n_gpus]:
        index = telemetry.index_of_uuid(entry) if entry.startswith("GPU-") else None
        if index is None:
            raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry!r} names no GPU by its full UUID (NVML) or index: "
                             "the sessions are pinned by physical index; list indices, e.g. CUDA_VISIBLE_DEVICES=0,1")
        out.append(index)
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one (Linux), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_average_1m() -> float | None:
    """The machine's 1-minute load average, or None where the OS gives none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)     # /proc/stat cpuN: user nice system (idle iowait) irq softirq steal


def _core_ticks(cores: set[int], stat: Path) -> tuple[int, int] | None:
    """(busy, total) clock ticks so far of the cores ``cores``, summed over their ``cpuN`` lines of ``stat``
    (proc(5)); None where the file is missing or lacks one of them."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = total = seen = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            ticks = [int(x) for x in rest.split()[:8]]
            busy += sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks))
            total += sum(ticks)
            seen += 1
    return (busy, total) if seen == len(cores) else None


def busy_cores_now(window_s: float = 0.2, stat: Path = Path("/proc/stat")) -> float | None:
    """How many of this process's usable cores other work kept busy over the next ``window_s`` seconds, while this
    process sleeps: the busy share of their ticks in /proc/stat (Linux; proc(5)) times their number. None where
    there is no /proc/stat. Unlike the load average, which decays over a minute, it does not count a run that
    has just ended, such as the previous job of a sweep."""
    try:
        cores = set(os.sched_getaffinity(0))
    except AttributeError:
        return None
    before = _core_ticks(cores, stat)
    if before is None:
        return None
    time.sleep(window_s)
    after = _core_ticks(cores, stat)
    if after is None or after[1] <= before[1]:
        return None
    return len(cores) * (after[0] - before[0]) / (after[1] - before[1])


BUSY_WINDOW_S = 0.2     # busy_cores_now's default window, as environment.json cpu_load records it


def cpu_load(threads: int) -> dict:
    """environment.json's ``cpu_load`` (bundle format 15) of a CPU run of ``threads`` threads, sampled now: the usable
    cores, how many of them other work keeps busy (:func:`busy_cores_now`) and the 1-minute load average."""
    return {"sampled": "run start", "usable_cores": usable_cores(), "threads": threads, "busy_cores": busy_cores_now(),
            "window_s": BUSY_WINDOW_S, "load_average_1m": load_average_1m()}


def cpu_load_kind(load: dict) -> str | None:
    """The warning a :func:`cpu_load` record calls for by the contract's ``documents.environment.cpu_load_rule``:
    ``oversubscribed`` (more threads than usable cores: the run's own sessions time each other), ``busy`` (other
    work leaves fewer idle cores than the threads, beyond the rule's allowance for the odd daemon), ``loaded`` (no
    per-core ticks, and a load average above the usable cores) or None. Any of them means the run's timings say
    more about the other processes than about the runtime, and two arms' pair ratios can read a change that is
    not there."""
    rule = bundle_format()["documents"]["environment"]["cpu_load_rule"]   # the thresholds the auditor applies too
    cores, threads, busy, load_1m = load["usable_cores"], load["threads"], load["busy_cores"], load["load_average_1m"]
    if threads > cores:     # executor.cpu_devices=100 on 2 cores
        return "oversubscribed"
    if busy is not None:
        return "busy" if busy > cores - min(threads, cores) + rule["busy_allowance_cores"] else None
    return "loaded" if load_1m is not None and load_1m > cores else None


def cpu_load_text(load: dict) -> str | None:
    """The one-line stderr warning of a :func:`cpu_load` record (:func:`cpu_load_kind`), or None."""
    kind, cores, threads = cpu_load_kind(load), load["usable_cores"], load["threads"]
    plural = "" if cores == 1 else "s"
    if kind == "oversubscribed":
        return (f"warning: the run's {threads} threads exceed the {cores} usable core{plural}, so they take turns on "
                "them and time each other: CPU timings are for smoke checks, not performance evidence")
    if kind == "loaded":
        return (f"warning: the 1-minute load average {load['load_average_1m']:.2f} exceeds the {cores} usable "
                f"core{plural}: CPU timings are for smoke checks, not performance evidence")
    if kind == "busy":
        return (f"warning: other work keeps {load['busy_cores']:.1f} of the {cores} usable core{plural} busy, leaving "
                f"fewer idle than the run's {threads} thread{'' if threads == 1 else 's'}: CPU timings are for smoke "
                "checks, not performance evidence")
    return None


def busy_cpu_warning(threads: int) -> str | None:
    """The one-line warning of a CPU run of ``threads`` threads (the throughput probe, a bench on CPU devices) on a
    busy machine, measured now (:func:`cpu_load`, :func:`cpu_load_kind`); else None."""
    return cpu_load_text(cpu_load(threads))


def run_cpu_load(devices: list[dict]) -> dict | None:
    """:func:`cpu_load` of a run on ``devices`` (:func:`planned_devices`' dicts), for environment.json: only where one
    is a CPU, since a GPU session's timings are the GPU's (None otherwise); the threads are every CPU session's (a
    round's sessions run at once, harness/executors.py)."""
    cpus = [d for d in devices if d["kind"] == "cpu"]
    return cpu_load(sum(d.get("cpu_threads", 1) for d in cpus)) if cpus else None


def busy_warning(devices: list[dict]) -> str | None:
    """:func:`busy_cpu_warning` for a run on ``devices`` (:func:`run_cpu_load`); None without a CPU session."""
    load = run_cpu_load(devices)
    return None if load is None else cpu_load_text(load)


def planned_devices(executor) -> list[dict]:
    """One entry per session: {name, kind, gpu_index, label, cpu_threads}; ValueError naming the key.

    ``executor``: the config's ``spec.ExecutorSpec``. A CPU run is a single session; a local CUDA run one
    session per GPU of ``executor.gpus`` (default: every visible GPU); a Slurm run one per job.
    """
    threads, kind = executor.cpu_threads, executor.device
    if executor.kind == "slurm":
        use_gpu = kind != "cpu"
        return [{"name": f"slurm{i}", "kind": "cuda" if use_gpu else "cpu", "gpu_index": None,
                 "label": f"slurm job {i}" if use_gpu else "cpu", "cpu_threads": threads}
                for i in range(executor.slurm.jobs)]
    import torch

    n_gpus = torch.cuda.device_count() if kind != "cpu" else 0
    if kind == "cuda" and n_gpus == 0:
        raise ValueError("executor.device = cuda, but no CUDA device is visible")
    if n_gpus == 0:
        if executor.gpus is not None:   # device auto without CUDA: a CPU run would ignore the GPUs asked for
            raise ValueError(f"executor.gpus = {list(executor.gpus)} names GPUs, but no CUDA device is visible")
        return cpu_devices(executor.cpu_devices, threads)
    physical = physical_gpus(n_gpus)
    gpus = list(executor.gpus) if executor.gpus is not None else physical
    for g in gpus:
        if g not in physical:
            raise ValueError(f"executor.gpus lists GPU {g}, visible GPUs are {physical}")
    return [{"name": f"gpu{g}", "kind": "cuda", "gpu_index": g,
             "label": gpu_label((telemetry.device_info(g) or {}).get("name"), g), "cpu_threads": threads}
            for g in gpus]


def cpu_devices(n: int, threads: int) -> list[dict]:
    """The CPU sessions: one ``cpu0`` (label "cpu"), or ``n`` > 1 simulated devices ``cpu<i>`` with
    ``cpu_index`` i and label "cpu #i" (``executor.cpu_devices``)."""
    if n == 1:
        return [{"name": "cpu0", "kind": "cpu", "gpu_index": None, "label": "cpu", "cpu_threads": threads}]
    return [{"name": f"cpu{i}", "kind": "cpu", "gpu_index": None, "cpu_index": i, "label": f"cpu #{i}",
             "cpu_threads": threads} for i in range(n)]


def child_device(job_name: str, device: dict) -> dict:
    """A child's own device: torch device string, NVML index and a label for tables ("H200 #0", "cpu").

    ``device``: the job's ``device`` entry (kind, gpu_index, cpu_threads). A CPU job runs torch with
    ``cpu_threads`` intra-op threads (default 1): the CPU arms are tiny, and OpenMP threads that
    spin-wait for cores held by other processes made single arms 10-80x slower on a busy 2-core
    machine (measured), which is noise, not signal. RuntimeError when CUDA is asked for and absent.
    """
    import torch

    if device["kind"] == "cpu":
        torch.set_num_threads(device.get("cpu_threads", 1))
        label, uuid = _cpu_identity(job_name, device.get("cpu_index"))
        return {"kind": "cpu", "torch": "cpu", "gpu_index": None, "label": label, "name": cpu_name(), "uuid": uuid}
    if not torch.cuda.is_available():
        raise RuntimeError(f"job {job_name} asks for CUDA, but torch.cuda.is_available() is False")
    index = device.get("gpu_index")
    if index is None:  # a Slurm job: the scheduler pinned one GPU through CUDA_VISIBLE_DEVICES
        index = (visible_gpus() or [None])[0]
    info = (telemetry.device_info(index) if index is not None else None) or {}
    name = info.get("name") or torch.cuda.get_device_name(0)
    uuid = _cuda_uuid()
    if uuid is not None and info.get("uuid") not in (None, uuid):
        raise RuntimeError(f"job {job_name} runs on card {uuid}, but NVML's GPU {index} is {info['uuid']}: "
                           "CUDA and NVML number the cards differently (CUDA_DEVICE_ORDER="
                           f"{os.environ.get('CUDA_DEVICE_ORDER')!r}, CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return {"kind": "cuda", "torch": "cuda:0", "gpu_index": index, "name": name, "label": gpu_label(name, index),
            "uuid": uuid or info.get("uuid")}


def _cuda_uuid() -> str | None:
    """The UUID of the card CUDA runs this process's ``cuda:0`` on, in NVML's spelling ("GPU-<hex>"); None
    where torch does not tell it. The card's own answer, whatever the NVML numbering."""
    import torch

    try:
        raw = str(torch.cuda.get_device_properties(0).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        return None
    return raw if raw.startswith("GPU-") else f"GPU-{raw}"


def _cpu_identity(job_name: str, index: int | None) -> tuple[str, str | None]:
    """(label, identity) of a CPU child: ("cpu", None), or for simulated device ``index`` the index its
    executor pinned it to (:data:`CPU_DEVICE_ENV`): ("cpu #i", "CPU-SIM-i"); RuntimeError when the two differ."""
    if index is None:
        return "cpu", None
    pinned = os.environ.get(CPU_DEVICE_ENV)
    if pinned != str(index):
        raise RuntimeError(f"job {job_name} is planned on simulated CPU device {index}, but its "
                           f"{CPU_DEVICE_ENV} is {pinned!r}")
    return f"cpu #{pinned}", f"CPU-SIM-{pinned}"


def environment(devices: list[dict]) -> dict:
    """``environment.json``: host, interpreter, CPU, torch build, library versions, GPUs and their state."""
    from importlib import metadata

    import torch

    pkgs = {}
    for name in PACKAGES:
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    gpus = [d["gpu_index"] for d in devices if d["gpu_index"] is not None]
    return {
        "host": socket.gethostname(), "platform": platform.platform(),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "cpu": {"model": cpu_name(), "logical_cores": os.cpu_count()},
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
                  "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None},
        "packages": pkgs, "gpus": [telemetry.device_info(g) for g in gpus],
        "gpu_telemetry_at_start": [telemetry.sample(g) for g in gpus],
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "OMP_NUM_THREADS")},
        "cpu_load": run_cpu_load(devices),   # format 15: a CPU run measured on a busy machine says so in its bundle
    }
