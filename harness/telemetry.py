"""GPU telemetry through NVML (``nvidia-ml-py``, imported as ``pynvml``); empty where there is no GPU.

Sampled outside every timed region (start and end of each measured arm: the full reading and the energy
counter) and once per bundle for the environment; harness/sampler.py samples clocks, temperature, power
and throttle reasons during the measured run (:func:`fast_sample`). NVML numbers GPUs in PCI bus order, so sessions run with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
and address NVML by the same physical index as ``CUDA_VISIBLE_DEVICES``. Every failure (no library, no
driver, a field the GPU does not report) degrades to ``None`` for that field: telemetry describes a
run, it never stops one.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from .fileio import bundle_format


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _try(fn: Callable[[], Any]) -> Any:
    try:
        value = fn()
    except Exception:
        return None
    return value.decode() if isinstance(value, bytes) else value


def handle(index: int) -> tuple[Any, Any] | None:
    """(the NVML module, the handle of physical GPU ``index``), or None without NVML or that GPU."""
    nv = _nvml()
    if nv is None:
        return None
    h = _try(lambda: nv.nvmlDeviceGetHandleByIndex(index))
    return None if h is None else (nv, h)


def index_of_uuid(uuid: str) -> int | None:
    """The physical index of the GPU whose full UUID is ``uuid`` ("GPU-<hex>"); None without NVML or that GPU."""
    nv = _nvml()
    if nv is None:
        return None
    h = _try(lambda: nv.nvmlDeviceGetHandleByUUID(uuid))
    return None if h is None else _try(lambda: nv.nvmlDeviceGetIndex(h))


def device_info(index: int) -> dict | None:
    """Static facts of physical GPU ``index``: name, UUID, memory, max clocks, driver; None without NVML."""
    found = handle(index)
    if found is None:
        return None
    nv, h = found
    mem = _try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
    return {
        "index": index,
        "name": _try(lambda: nv.nvmlDeviceGetName(h)),
        "uuid": _try(lambda: nv.nvmlDeviceGetUUID(h)),
        "memory_total_bytes": getattr(mem, "total", None),
        "max_sm_clock_mhz": _try(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
        "max_mem_clock_mhz": _try(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM)),
        "power_limit_w": _milli(_try(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))),
        "driver": _try(lambda: nv.nvmlSystemGetDriverVersion()),
        "cuda_driver_version": _try(lambda: nv.nvmlSystemGetCudaDriverVersion()),
        "persistence_mode": _try(lambda: nv.nvmlDeviceGetPersistenceMode(h)),
    }


def _milli(x: Any) -> float | None:
    return None if x is None else x / 1000.0


def sample(index: int | None) -> dict | None:
    """One reading of physical GPU ``index``: clocks, temperature, power, throttle reasons; None on CPU.

    ``energy_mj`` is NVML's total-energy counter (mJ since the driver loaded; Volta and later).
    ``throttle_reasons`` is NVML's bitmask of current clock-event reasons (0 = none; 1 = idle;
    see ``nvmlClocksEventReasons``), kept raw so that a report can decode it.
    """
    found = handle(index) if index is not None else None
    if found is None:
        return None
    nv, h = found
    mem = _try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
    util = _try(lambda: nv.nvmlDeviceGetUtilizationRates(h))
    return {**fast_sample(nv, h), "memory_used_bytes": getattr(mem, "used", None),
            "gpu_utilization_pct": getattr(util, "gpu", None),
            "energy_mj": _try(lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h))}


def _reasons_fn(nv) -> Callable | None:
    """NVML's current clock-event reasons call (renamed from ...ThrottleReasons in newer bindings)."""
    return getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)


def fast_sample(nv, h) -> dict:
    """One reading for the sampler thread (five NVML calls): time, SM / memory clock (MHz), temperature
    (degC), power (W), throttle reasons bitmask; a field NVML does not give is None."""
    reasons = _reasons_fn(nv)
    return {
        "time_unix_s": time.time(),
        "sm_clock_mhz": _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
        "mem_clock_mhz": _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
        "temperature_c": _try(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        "power_w": _milli(_try(lambda: nv.nvmlDeviceGetPowerUsage(h))),
        "throttle_reasons": _try(lambda: reasons(h)) if reasons else None,
    }


# ------------------------------------------------------------------ per-arm summary (format 5)

# nvmlClocksEventReasonGpuIdle is not a throttle; every other set bit is (the report flags it). The auditor reads the
# same contract value.
IDLE_REASON = bundle_format()["telemetry"]["ignored_reasons_mask"]


def _span(values: list) -> tuple[Any, Any]:
    present = [v for v in values if v is not None]
    return (min(present), max(present)) if present else (None, None)


def arm_summary(record: dict) -> dict:
    """The arms table's telemetry columns of one raw record (all None without NVML samples).

    From the sampler's readings during the measured run: their count and achieved rate (Hz), mean power
    (W), min / max SM and memory clock (MHz), the OR of their throttle-reason bits other than idle, and
    the flags ``throttled`` (any such bit) and ``clock_changed`` (an SM or memory clock moved); from the
    start / end readings' energy counter: ``energy_j`` and ``joules_per_token`` (over C * D output
    tokens); ``sampler_cpu_s``: the sampler thread's CPU seconds (its cost).
    """
    tele = record.get("telemetry") or {}
    samples = tele.get("samples") or []
    start, end = tele.get("start") or {}, tele.get("end") or {}
    e0, e1 = start.get("energy_mj"), end.get("energy_mj")
    energy_j = None if e0 is None or e1 is None else (e1 - e0) / 1000.0
    out = {"telemetry_samples": len(samples) or None, "sample_rate_hz": None, "energy_j": energy_j,
           "joules_per_token": None if energy_j is None else energy_j / (record["num_requests"] * record["output_len"]),
           "mean_power_w": None, "min_sm_clock_mhz": None, "max_sm_clock_mhz": None, "min_mem_clock_mhz": None,
           "max_mem_clock_mhz": None, "throttle_reasons_seen": None, "throttled": None, "clock_changed": None,
           "sampler_cpu_s": (tele.get("sampler") or {}).get("cpu_s") if samples else None}
    if not samples:
        return out
    times = [s["time_unix_s"] for s in samples]
    if len(times) > 1 and times[-1] > times[0]:
        out["sample_rate_hz"] = (len(times) - 1) / (times[-1] - times[0])
    power = [s["power_w"] for s in samples if s.get("power_w") is not None]
    out["mean_power_w"] = sum(power) / len(power) if power else None
    out["min_sm_clock_mhz"], out["max_sm_clock_mhz"] = _span([s.get("sm_clock_mhz") for s in samples])
    out["min_mem_clock_mhz"], out["max_mem_clock_mhz"] = _span([s.get("mem_clock_mhz") for s in samples])
    reasons = [s["throttle_reasons"] for s in samples if s.get("throttle_reasons") is not None]
    if reasons:
        seen = 0
        for bits in reasons:
            seen |= int(bits) & ~IDLE_REASON
        out["throttle_reasons_seen"], out["throttled"] = seen, seen != 0
    spans = [(out[f"min_{k}"], out[f"max_{k}"]) for k in ("sm_clock_mhz", "mem_clock_mhz")]
    out["clock_changed"] = any(lo is not None and lo != hi for lo, hi in spans)
    return out
