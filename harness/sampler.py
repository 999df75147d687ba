"""NVML telemetry during a measured run: a background thread that samples the GPU at a fixed rate.

``Sampler(index, hz)`` is started right before a measured run's first submission and stopped after its
drain (harness/session.py ``measure_arm``); it reads SM and memory clocks, temperature, power and the
clock-event (throttle) reasons bitmask every ``1 / hz`` s. The energy counter
(``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver loaded) is read by the arm's start and end
samples (harness/telemetry.py), so energy per output token is their difference over C * D.

Why it does not perturb the timing: the thread sleeps on an ``Event`` between samples and each NVML call
goes through ctypes, which releases the GIL, so the measuring thread waits for the GIL only while the
sampler builds one small dict (a few microseconds, at 10-20 Hz). The sampler measures its own cost: the
CPU time of its thread (``time.thread_time``) over the run, kept in the record as ``sampler.cpu_s``
(the report shows it per run); ``loopbench.harness.throughput --telemetry on|off`` is the GPU A/B of
the same workload with and without it.

Without NVML (no library, no driver, no GPU) ``start`` samples nothing and ``samples`` is empty: telemetry
describes a run, it never stops one.
"""
from __future__ import annotations

import threading
import time

from . import telemetry

FIELDS = ("sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w", "throttle_reasons")


class Sampler:
    """Samples physical GPU ``index`` at ``hz`` until :meth:`stop`; ``index`` None (a CPU) samples nothing.

    ``samples``: one dict per reading, ``time_unix_s`` and :data:`FIELDS` (each None when NVML lacks it).
    """

    def __init__(self, index: int | None, hz: float):
        if not hz > 0:
            raise ValueError(f"telemetry.sample_hz must be > 0, got {hz!r}")
        self.index, self.interval_s = index, 1.0 / hz
        self.samples: list[dict] = []
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._found = telemetry.handle(index) if index is not None else None

    @property
    def active(self) -> bool:
        """True when NVML answered for this GPU (samples are being taken)."""
        return self._found is not None

    def start(self) -> Sampler:
        if self.active:
            self._thread = threading.Thread(target=self._run, name="loopbench-nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> list[dict]:
        """Stop and join the thread (one last sample is taken at the stop); the samples."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples

    def _run(self) -> None:
        nv, h = self._found
        cpu0 = time.thread_time()
        next_t = time.monotonic()
        while True:
            self.samples.append(telemetry.fast_sample(nv, h))
            next_t += self.interval_s
            if self._stop.wait(max(0.0, next_t - time.monotonic())):
                break
        self.samples.append(telemetry.fast_sample(nv, h))   # the drain's state
        self.cpu_s = time.thread_time() - cpu0

    def record(self) -> dict:
        """The raw record's ``telemetry.sampler``: requested rate, samples taken, the thread's CPU seconds."""
        return {"sample_hz": 1.0 / self.interval_s, "samples": len(self.samples), "cpu_s": self.cpu_s,
                "active": self.active}
