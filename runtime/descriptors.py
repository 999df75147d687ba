"""Step descriptors: the host's per-row decisions for one decode step, staged for the device.

A decode step is described by DESC_ROWS int32 rows over its N batch rows: slot, depth, position,
first-alias position, forced exit (DESIGN.md "Replay scheduling"). The host writes them into a pinned
bank; the device reads them by an async copy (``h2d``) or directly through unified addressing
(``mapped``). This module knows nothing of requests or models.
"""
from __future__ import annotations

import numpy as np
import torch

from .api import DescriptorMode

DESC_ROWS = 5                      # slot, depth, position, first-alias, forced exit
PADDING_ROW = (-1, 1, 0, 1, 0)     # a padding row: scratch slot, depth 1, position 0, no exit
PADDING_COLUMNS = np.array(PADDING_ROW, dtype=np.int32)[:, None]   # [DESC_ROWS, 1]: pads a bank's tail


class DescriptorBanks:
    """A ring of host descriptor banks ([DESC_ROWS, max_num_seqs] int32: slot, depth, position, first-alias, forced exit).

    On CUDA the banks are pinned; a bank is rewritten only after the GPU has finished reading it (an
    event recorded after its read, waited on before reuse), so the host can run ahead of the GPU
    without a device-wide sync. ``h2d`` moves a bank with an async copy engine transfer; ``mapped``
    has a device kernel read the pinned bank directly (zero-copy through unified addressing).
    """

    def __init__(self, max_num_seqs: int, device: torch.device, mode: str, num_banks: int = 4):
        self.device, self.mode = device, mode
        cuda = device.type == "cuda"
        self.banks = [torch.zeros(DESC_ROWS * max_num_seqs, dtype=torch.int32, pin_memory=cuda)
                      for _ in range(num_banks)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(num_banks)]
        self.pending = [False] * num_banks
        self.i = -1
        self.waits = 0          # times the host found a bank still in use by the GPU

    def acquire(self, cols: int) -> torch.Tensor:
        """Next bank as a contiguous [DESC_ROWS, cols] view, once the GPU no longer reads it."""
        self.i = (self.i + 1) % len(self.banks)
        if self.pending[self.i]:
            if not self.events[self.i].query():
                self.waits += 1
                self.events[self.i].synchronize()
            self.pending[self.i] = False
        return self.banks[self.i][:DESC_ROWS * cols].view(DESC_ROWS, cols)

    def publish(self, src: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Make the bank view ``src`` [DESC_ROWS, n] visible on the device (into ``into`` if given)."""
        n = src.shape[1]
        if self.device.type != "cuda":
            return src.clone() if into is None else into.copy_(src)
        dst = into if into is not None else torch.empty((DESC_ROWS, n), dtype=torch.int32, device=self.device)
        if self.mode == DescriptorMode.MAPPED:
            from loopbench.kernels.descriptor import copy_mapped
            copy_mapped(src, dst)
        else:
            dst.copy_(src, non_blocking=True)
        self.events[self.i].record()
        self.pending[self.i] = True
        return dst


def pinned(array: np.ndarray) -> torch.Tensor:
    """A copy of a host array in pinned (page-locked) memory, the source an async host-to-device copy needs."""
    return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()


def to_device_async(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` without a host sync: on CUDA through a pinned buffer and an
    async copy (torch's caching host allocator keeps the buffer until the copy has run, so the caller may
    reuse or free ``array`` at once); elsewhere a copy. A pageable host-to-device copy would block the host
    until the GPU drained its queue, the idle time this runtime removes."""
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(array)).clone()
    return pinned(array).to(device, non_blocking=True)


def unpack_prefill_descriptor(meta: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """Views of a prefill descriptor tensor (``runner.prefill_descriptor``): slot, depth, position [rows]
    int32 and tiles [3, num_tiles] int32."""
    return meta[:rows], meta[rows:2 * rows], meta[2 * rows:3 * rows], meta[3 * rows:].view(3, -1)
