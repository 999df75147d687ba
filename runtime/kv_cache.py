"""Depth-aware paged KV cache (LAST_EXITED), with its block allocator.

Layout (DESIGN.md): ``k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]``;
one block table per (request slot, depth plane): ``block_tables: [max_num_seqs, num_planes,
max_blocks_per_seq] int32``; the exit map ``exit_map: [max_num_seqs, max_model_len] int32`` holds e_p
(positions still being computed hold ``num_planes``, so that ``min(d, e_p) == d`` for them).

This module allocates and frees blocks on the host and owns the device tensors; it knows nothing about
the model or about how attention reads the planes (``attention.py`` does).
"""
from __future__ import annotations

import numpy as np
import torch

from .descriptors import to_device_async


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than an admission or a step needs."""


class BlockAllocator:
    """A LIFO free list of physical block ids, with a high-water mark (host only)."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # Block 0 stays reserved so that an unused block-table entry (0) never aliases live data.
        self._free = list(range(num_blocks - 1, 0, -1))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, only {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n)]
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class DepthKVCache:
    """Device tensors of the paged, depth-aware KV cache plus host mirrors of each slot's blocks."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_planes: int,
                 max_num_seqs: int, max_model_len: int, block_size: int, num_blocks: int,
                 device, dtype: torch.dtype, poison: bool = False):
        """``poison`` (tests and debugging): every KV cell that holds no live value is NaN, at
        construction and again whenever a slot's blocks are freed, so a reader that depends on the
        contents of never-written, recycled or reserved memory produces NaN instead of passing by luck.
        Off by default: the fast path pays nothing."""
        if block_size <= 0 or max_model_len <= 0:
            raise ValueError(f"block_size and max_model_len must be > 0, got {block_size}, {max_model_len}")
        self.block_size, self.num_planes, self.max_model_len = block_size, num_planes, max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.poison = poison
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        fill = float("nan") if poison else 0.0
        self.k = torch.full(shape, fill, device=device, dtype=dtype)
        self.v = torch.full(shape, fill, device=device, dtype=dtype)
        self.block_tables = torch.zeros((max_num_seqs, num_planes, self.max_blocks_per_seq),
                                        dtype=torch.int32, device=device)
        self.exit_map = torch.full((max_num_seqs, max_model_len), num_planes, dtype=torch.int32, device=device)
        self.allocator = BlockAllocator(num_blocks)
        # host mirror: blocks[slot][plane] -> list of physical block ids
        self._blocks: list[list[list[int]] | None] = [None] * max_num_seqs
        # Block-table entries assigned on the host but not yet on the device: (flat index, block id).
        # They travel in one pinned async copy per step (flush_tables), never a pageable, syncing one.
        self._pending: list[tuple[np.ndarray, list[int]]] = []

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def open_slot(self, slot: int, num_planes: int, prompt_len: int, prompt_exit_depth: int) -> None:
        """Start a request in ``slot``: planes 1..num_planes get blocks for the prompt; the exit map is
        reset (stale entries of the slot's previous request must never be read) and the prompt
        positions marked as exited at ``prompt_exit_depth``."""
        self._blocks[slot] = [[] for _ in range(num_planes)]
        try:
            self.ensure_capacity(slot, prompt_len)
        except Exception:
            self.close_slot(slot)
            raise
        self.exit_map[slot].fill_(self.num_planes)
        self.exit_map[slot, :prompt_len] = prompt_exit_depth

    def blocks_for(self, num_positions: int) -> int:
        """Blocks one plane needs for positions 0..num_positions-1."""
        return -(-num_positions // self.block_size)

    def new_blocks_needed(self, slot: int, num_positions: int) -> int:
        """Blocks ``ensure_capacity(slot, num_positions)`` would allocate (all planes of the slot)."""
        planes = self._blocks[slot]
        return max(0, self.blocks_for(num_positions) - len(planes[0])) * len(planes)

    def ensure_capacity(self, slot: int, num_positions: int) -> None:
        """Give every plane of ``slot`` enough blocks for positions 0..num_positions-1."""
        planes = self._blocks[slot]
        need = -(-num_positions // self.block_size)
        if need > self.max_blocks_per_seq:
            raise ValueError(f"{num_positions} positions exceed max_model_len={self.max_model_len}")
        have = len(planes[0])
        if need <= have:
            return
        new = self.allocator.allocate((need - have) * len(planes))
        _, num_planes, width = self.block_tables.shape
        cols = np.arange(have, need)
        for p, plane in enumerate(planes):
            plane.extend(new[p * (need - have):(p + 1) * (need - have)])
            self._pending.append(((slot * num_planes + p) * width + cols, plane[have:need]))

    def flush_tables(self) -> None:
        """Write the block-table entries assigned since the last flush to the device: one pinned host
        buffer, one async copy and one scatter, in stream order (no host sync; the caching host
        allocator keeps the pinned buffer until the copy has run). The runner calls it before each
        step's device work."""
        if not self._pending:
            return
        idx = np.concatenate([i for i, _ in self._pending])
        ids = np.concatenate([np.asarray(b, dtype=np.int64) for _, b in self._pending])
        self._pending.clear()
        both = to_device_async(np.stack([idx.astype(np.int64), ids]), self.block_tables.device)
        self.block_tables.view(-1)[both[0]] = both[1].to(torch.int32)

    def close_slot(self, slot: int) -> None:
        """Free the slot's blocks and point its table entries back at the reserved block 0, so no stale
        entry aliases a block that is reused elsewhere (device writes in stream order, after every read
        already issued). With ``poison`` the freed blocks are NaN-filled first."""
        planes = self._blocks[slot]
        if planes is not None:
            self.flush_tables()              # entries assigned to this slot must land before the reset
            self.block_tables[slot].zero_()
            if self.poison and any(planes):
                ids = torch.tensor([b for plane in planes for b in plane], dtype=torch.long).to(self.k.device)
                self.k[:, ids] = float("nan")
                self.v[:, ids] = float("nan")
            for plane in planes:
                self.allocator.free(plane)
        self._blocks[slot] = None
