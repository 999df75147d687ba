"""The two device measurements of the roofline (harness/roofline.py): each decode loop's device time, and
the session's copy ceiling.

- :class:`DecodeLoopTimer`: installed as a ``LoopEngine``'s ``decode_timer`` for the measured run only, it
  brackets each decode loop's device work (``Runner.decode``: one recurrent-core loop, exit rule, lm_head
  and sampling over the step's rows). On CUDA a pair of timing events per loop is recorded on the current
  stream and read once after the run, so nothing inside a measured step waits for the device (the GPU's
  time from the loop's first launch to its last kernel's end, idle gaps between its launches included, and with
  ``EngineConfig.prefill_stream`` what it loses to a prefill loop running beside it on its own stream);
  on the CPU, where every op runs before it returns, ``time.perf_counter`` around the call.
- :func:`copy_ceiling`: a device-to-device copy of a buffer much larger than the last-level cache, best
  of several timed copies, counting the bytes read and written; run once per session before its arms,
  so every run's achieved bandwidth is compared with a ceiling of the same process on the same device.

Nothing here decides a figure: the session records the raw seconds (``decode_timing.loop_s``, the ceiling
file's ``times_s``) and the roofline table is derived from them (and re-derived by the auditor).
"""
from __future__ import annotations

import time

import torch

CUDA_EVENTS, WALL_CLOCK = "cuda_events", "wall_clock"
# Copy-ceiling buffers: 1 GiB on a GPU (an H200's L2 is 50 MB), 64 MiB on a CPU (beyond a server's LLC,
# small enough for a shared CI box); repeats: the best of these timed copies after one untimed copy.
CEILING_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}
CEILING_REPEATS = 10


class DecodeLoopTimer:
    """``start()`` / ``stop()`` around each decode loop; :meth:`loop_s` after the run (synchronises once).

    ``device_kind``: ``"cuda"`` (timing events on the current stream) or ``"cpu"`` (wall clock).
    """

    def __init__(self, device_kind: str):
        if device_kind not in CEILING_BYTES:
            raise ValueError(f"device_kind must be one of {sorted(CEILING_BYTES)}, got {device_kind!r}")
        self.method = CUDA_EVENTS if device_kind == "cuda" else WALL_CLOCK
        self._marks: list = []

    def start(self) -> None:
        self._marks.append(self._mark())

    def stop(self) -> None:
        self._marks.append(self._mark())

    def _mark(self):
        if self.method == WALL_CLOCK:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()                      # enqueued on the stream: no host-device synchronisation
        return event

    def loop_s(self) -> list[float]:
        """Seconds of each bracketed loop, in order (CUDA: waits for the last event first)."""
        if len(self._marks) % 2:
            raise RuntimeError("a decode loop was started but not stopped")
        pairs = list(zip(self._marks[0::2], self._marks[1::2]))
        if self.method == WALL_CLOCK:
            return [b - a for a, b in pairs]
        if pairs:
            pairs[-1][1].synchronize()
        return [a.elapsed_time(b) * 1e-3 for a, b in pairs]

    def record(self) -> dict:
        """The raw record's ``decode_timing``: ``method`` and ``loop_s`` (contract documents.record)."""
        return {"method": self.method, "loop_s": self.loop_s()}


def copy_ceiling(device: dict, buffer_bytes: int | None = None, repeats: int = CEILING_REPEATS) -> dict:
    """Time ``repeats`` copies of a ``buffer_bytes`` uint8 buffer into another on ``device``
    (``machine.child_device``: its ``kind`` and ``torch``); returns the ceiling document's measurement
    fields: ``method``, ``buffer_bytes``, ``bytes_per_copy`` (read + written = 2 x buffer) and ``times_s``
    (each copy's seconds; the ceiling is bytes_per_copy / min(times_s), derived by the readers)."""
    kind = device["kind"]
    size = CEILING_BYTES[kind] if buffer_bytes is None else buffer_bytes
    if size <= 0 or repeats <= 0:
        raise ValueError(f"buffer_bytes and repeats must be positive, got {size}, {repeats}")
    src = torch.ones(size, dtype=torch.uint8, device=device["torch"])
    dst = torch.empty_like(src)
    dst.copy_(src)                           # untimed: first-touch page faults, allocator, clocks up
    timer = DecodeLoopTimer(kind)
    if kind == "cuda":
        torch.cuda.synchronize()
    for _ in range(repeats):
        timer.start()
        dst.copy_(src)
        timer.stop()
    times = timer.loop_s()
    del src, dst
    if kind == "cuda":
        torch.cuda.empty_cache()             # the first arm starts from the allocator state the others do
    return {"method": f"torch copy_ of a uint8 buffer ({timer.method})", "buffer_bytes": size,
            "bytes_per_copy": 2 * size, "times_s": times}
