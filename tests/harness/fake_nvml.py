"""A scripted stand-in for ``pynvml`` (nvidia-ml-py): no GPU here, so tests put this object into
``sys.modules["pynvml"]`` and script what each NVML call returns.

Readings come from the script's functions of the call count, so a test can change a clock or set a
throttle bit from the k-th reading on; ``handles`` records every physical index asked for.
"""
from __future__ import annotations

import threading
import types


class FakeNVML(types.ModuleType):
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, sm=lambda k: 1980, mem=lambda k: 3201, reasons=lambda k: 0, power_mw=lambda k: 450_000,
                 energy_mj=None, gpus: int = 8):
        super().__init__("pynvml")
        self.sm, self.mem, self.reasons, self.power_mw, self.gpus = sm, mem, reasons, power_mw, gpus
        self.energy_mj = energy_mj or (lambda k: 1_000_000 + 5_000 * k)
        self.handles: list[int] = []
        self.readings = 0        # throttle-reason calls: one per sampler reading
        self.energy_reads = 0
        self._lock = threading.Lock()

    def nvmlInit(self):
        return None

    def nvmlDeviceGetHandleByIndex(self, index: int):
        if not 0 <= index < self.gpus:
            raise RuntimeError(f"NVML_ERROR_INVALID_ARGUMENT: no GPU {index}")
        self.handles.append(index)
        return ("handle", index)

    @staticmethod
    def uuid_of(index: int) -> str:
        """The fake card's UUID: distinct per physical index, in NVML's spelling."""
        return f"GPU-{index:08x}-0000-4000-8000-00000000fake"

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        for index in range(self.gpus):
            if self.uuid_of(index) == uuid:
                return ("handle", index)
        raise RuntimeError(f"NVML_ERROR_NOT_FOUND: no GPU {uuid}")

    def nvmlDeviceGetIndex(self, h):
        return h[1]

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return self.uuid_of(h[1])

    def nvmlDeviceGetClockInfo(self, h, kind):
        return (self.sm if kind == self.NVML_CLOCK_SM else self.mem)(self.readings)

    def nvmlDeviceGetTemperature(self, h, kind):
        return 41

    def nvmlDeviceGetPowerUsage(self, h):
        return self.power_mw(self.readings)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        with self._lock:
            k = self.readings
            self.readings += 1
        return self.reasons(k)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.energy_reads += 1
        return self.energy_mj(self.energy_reads - 1)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=141 * 2**30, used=2**30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=97)
