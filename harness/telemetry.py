"""GPU telemetry through NVML (``nvidia-ml-py``, imported as ``pynvml``); empty where there is no GPU.

Sampled outside every timed region (start and end of each measured arm) and once per bundle for the
environment. NVML numbers GPUs in PCI bus order, so sessions run with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
and address NVML by the same physical index as ``CUDA_VISIBLE_DEVICES``. Every failure (no library, no
driver, a field the GPU does not report) degrades to ``None`` for that field: telemetry describes a
run, it never stops one.
"""
from __future__ import annotations

import time
from typing import Any, Callable


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


def _handle(index: int) -> tuple[Any, Any] | None:
    """(the NVML module, the handle of physical GPU ``index``), or None without NVML or that GPU."""
    nv = _nvml()
    if nv is None:
        return None
    h = _try(lambda: nv.nvmlDeviceGetHandleByIndex(index))
    return None if h is None else (nv, h)


def device_info(index: int) -> dict | None:
    """Static facts of physical GPU ``index``: name, UUID, memory, max clocks, driver; None without NVML."""
    found = _handle(index)
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
        "driver": _try(nv.nvmlSystemGetDriverVersion),
        "cuda_driver_version": _try(nv.nvmlSystemGetCudaDriverVersion),
        "persistence_mode": _try(lambda: nv.nvmlDeviceGetPersistenceMode(h)),
    }


def _milli(x: Any) -> float | None:
    return None if x is None else x / 1000.0


def sample(index: int | None) -> dict | None:
    """One reading of physical GPU ``index``: clocks, temperature, power, throttle reasons; None on CPU.

    ``throttle_reasons`` is NVML's bitmask of current clock-event reasons (0 = none; 1 = idle;
    see ``nvmlClocksEventReasons``), kept raw so that a report can decode it.
    """
    found = _handle(index) if index is not None else None
    if found is None:
        return None
    nv, h = found
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    mem = _try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
    util = _try(lambda: nv.nvmlDeviceGetUtilizationRates(h))
    return {
        "time_unix_s": time.time(),
        "sm_clock_mhz": _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
        "mem_clock_mhz": _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
        "temperature_c": _try(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        "power_w": _milli(_try(lambda: nv.nvmlDeviceGetPowerUsage(h))),
        "throttle_reasons": _try(lambda: reasons(h)) if reasons else None,
        "memory_used_bytes": getattr(mem, "used", None),
        "gpu_utilization_pct": getattr(util, "gpu", None),
    }
