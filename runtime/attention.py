"""Attention backends for the engine: the torch backend here, the Triton backend from ``kernels/``.

Both implement the contract of DESIGN.md: decode attention of N rows, each a (request slot, query
depth d, query position p), over the paged depth-aware KV cache, with the LAST_EXITED rule (BRIEF
section 1): key q < p is read from plane ``min(d, e_q)``.

- ``native``: every plane is complete (skipped planes were filled on exit), read plane d directly.
- ``alias``: resolve each key to plane ``min(d, e_q)`` through the exit map.
- ``alias`` + ``prefix_tiles``: key tiles of ``tile_size`` positions that end at or before the row's
  first-alias position read plane d directly; the boundary tile and later ones resolve per key.

The three read identical values and then run identical arithmetic, so their outputs are bitwise equal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .api import AttentionBackendName, KVLayout, choice_values

LAYOUTS = choice_values(KVLayout)
BACKENDS = choice_values(AttentionBackendName)


def key_planes(row_depth: torch.Tensor, row_pos: torch.Tensor, row_slot: torch.Tensor,
               row_first_alias: torch.Tensor, exit_map: torch.Tensor, max_ctx: int, *,
               layout: str, prefix_tiles: bool, tile_size: int) -> torch.Tensor:
    """Plane index (0-based) each row reads for key positions 0..max_ctx-1: [N, max_ctx] int64.

    Positions past a row's context are clamped to valid planes; the caller masks them.
    """
    n = row_depth.shape[0]
    d = row_depth.long()[:, None].expand(n, max_ctx)
    if layout == "native":
        return d - 1
    slot = row_slot.long().clamp(0, exit_map.shape[0] - 1)
    e = exit_map[slot, :max_ctx].long()                              # [N, max_ctx]
    routed = torch.minimum(d, e)
    if prefix_tiles:
        key = torch.arange(max_ctx, device=row_depth.device)
        tile_end = (key // tile_size + 1) * tile_size                # exclusive end of the key's tile
        direct = tile_end[None, :] <= row_first_alias.long()[:, None]
        routed = torch.where(direct, d, routed)
    return routed - 1


def decode_attention_torch(q, k_cache, v_cache, block_tables, row_slot, row_depth, row_pos, exit_map,
                           row_first_alias, *, layout: str = "native", prefix_tiles: bool = False,
                           tile_size: int = 32, scale: float | None = None) -> torch.Tensor:
    """Torch decode attention over paged depth-aware KV.

    q: [N, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (one layer); block_tables:
    [S, P, max_blocks] int32; row_slot, row_depth, row_pos, row_first_alias: [N] int32; exit_map:
    [S, max_model_len] int32. Returns [N, H, D] in q's dtype, softmax accumulated in fp32 (fp64 for fp64).
    Gathers each row's keys into a dense [N, max_ctx, Hkv, D] tensor, so it is meant for the CPU and for
    tests (it reads the batch's longest context on the host); the Triton kernel is the fast path.
    Keys past a row's context (and every key of a padding row, ``row_slot`` outside ``0..S-1``) contribute
    nothing whatever their memory holds, NaN included; a row without keys gives zeros, as in the kernel.
    """
    n, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    num_slots, num_planes = block_tables.shape[0], block_tables.shape[1]
    scale = D ** -0.5 if scale is None else scale
    if n == 0:
        return q.new_empty((0, H, D))
    live = (row_slot >= 0) & (row_slot < num_slots)
    limit = min(block_tables.shape[2] * bs, exit_map.shape[1])
    n_ctx = torch.where(live, row_pos.long() + 1, 0).clamp(0, limit)     # [N] keys each row reads
    max_ctx = int(n_ctx.max())
    if max_ctx == 0:
        return torch.zeros_like(q)
    depth = row_depth.clamp(1, num_planes)
    planes = key_planes(depth, row_pos, row_slot, row_first_alias, exit_map, max_ctx,
                        layout=layout, prefix_tiles=prefix_tiles, tile_size=tile_size)
    key = torch.arange(max_ctx, device=q.device)
    slot = row_slot.long().clamp(0, num_slots - 1)[:, None].expand(n, max_ctx)
    blocks = block_tables.long()[slot, planes, (key // bs)[None, :].expand(n, max_ctx)]
    off = (key % bs)[None, :].expand(n, max_ctx)
    valid = key[None, :] < n_ctx[:, None]                          # [N, max_ctx]
    acc = torch.promote_types(q.dtype, torch.float32)
    # Keys past a row's context lie in blocks it never wrote (not yet written, recycled, or the reserved
    # block 0 that unused table entries point at). Masking their scores alone is not enough: probability
    # 0 times a NaN value is NaN. So they are zeroed before any arithmetic.
    keep = valid[:, :, None, None]
    k = torch.where(keep, k_cache[blocks, off].to(acc), 0.0)       # [N, max_ctx, Hkv, D]
    v = torch.where(keep, v_cache[blocks, off].to(acc), 0.0)
    group = H // Hkv
    k = k.repeat_interleave(group, dim=2)                          # [N, max_ctx, H, D]
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("nhd,nkhd->nhk", q.to(acc), k) * scale   # [N, H, max_ctx]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    # A row without keys has only -inf scores, whose softmax is NaN: give it zero weights.
    probs = torch.softmax(scores, dim=-1).masked_fill(~valid[:, None, :], 0.0)
    return torch.einsum("nhk,nkhd->nhd", probs, v).to(q.dtype)


def write_kv_torch(k_cache, v_cache, k_new, v_new, block_tables, row_slot, row_depth, row_pos) -> None:
    """Write each row's new K/V ([N, Hkv, D]) into plane row_depth at row_pos (one layer's views).
    Rows with slot < 0 write nothing (a boolean selection: syncs on CUDA, like the rest of this backend)."""
    bs = k_cache.shape[1]
    slot, pos = row_slot.long(), row_pos.long()
    keep = slot >= 0
    slot, pos, depth = slot[keep], pos[keep], row_depth.long()[keep]
    blocks = block_tables.long()[slot, depth - 1, pos // bs]
    k_cache[blocks, pos % bs] = k_new[keep]
    v_cache[blocks, pos % bs] = v_new[keep]


def _scatter_rows(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which entry each of M entries scatters as, so that entries with ``keep`` false write nothing,
    without a host sync.

    Selecting the kept entries would need their count on the host. Instead each skipped entry repeats the
    first kept one: a duplicate index that writes the identical value, so whichever duplicate lands last
    the cell ends up with the kept entry's value (a skipped entry must never target a cell with its own
    index: when it collides with a real write, which duplicate wins is unspecified). keep: [M] bool.
    Returns (rows [M] int64, any_kept [] bool); without a kept entry ``rows`` is all 0 and the caller
    turns that write into a no-op (the cell's own value).
    """
    first = keep.to(torch.int32).argmax()                # index of the first True (0 if none)
    rows = torch.where(keep, torch.arange(keep.shape[0], device=keep.device), first)
    return rows, keep[first]


def native_fill_torch(k_all, v_all, block_tables, slot, pos, exit_depth, max_depth) -> None:
    """Copy exited tokens' K/V from plane e into planes e+1..max, every layer (vectorised, no sync).

    k_all, v_all: [L, num_blocks, block_size, Hkv, D]; block_tables: [S, P, max_blocks] int32; slot, pos,
    exit_depth, max_depth: [M] int. Entries with a slot outside 0..S-1 (rows that did not exit), a position
    outside the tables or e >= max write nothing, as in the Triton kernel.
    """
    num_slots, planes, max_blocks = block_tables.shape
    bs = k_all.shape[2]
    s, p, e = slot.long(), pos.long(), exit_depth.long()
    m = max_depth.long().clamp(max=planes)
    ok = (s >= 0) & (s < num_slots) & (p >= 0) & (p < max_blocks * bs) & (e >= 1)
    s, p, e = s.clamp(0, num_slots - 1), p.clamp(0, max_blocks * bs - 1), e.clamp(1, planes)
    bt = block_tables.long()
    src = bt[s, e - 1, p // bs]                         # [M] block of plane e holding the token
    for d in range(2, planes + 1):                      # destination plane d: entries with e < d <= max
        rows, any_take = _scatter_rows(ok & (e < d) & (d <= m))
        dst = torch.where(any_take, bt[s[rows], d - 1, p[rows] // bs], src[rows])
        off = p[rows] % bs
        k_all[:, dst, off] = k_all[:, src[rows], off]
        v_all[:, dst, off] = v_all[:, src[rows], off]


def publish_exits_torch(exit_map, slot, pos, exit_depth) -> None:
    """exit_map[slot, pos] = exit_depth for entries with slot in 0..S-1 and pos in range; others write
    nothing (no sync). exit_map: [S, max_model_len] int32; slot, pos, exit_depth: [M] int."""
    num_slots, max_len = exit_map.shape
    keep = (slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < max_len)
    rows, any_keep = _scatter_rows(keep)
    s = slot.long()[rows].clamp(0, num_slots - 1)
    p = pos.long()[rows].clamp(0, max_len - 1)
    exit_map[s, p] = torch.where(any_keep, exit_depth[rows].to(exit_map.dtype), exit_map[s, p])


@dataclass(frozen=True)
class AttentionBackend:
    """The four operations the engine needs, bound to one implementation."""
    name: str
    decode_attention: object
    write_kv: object
    native_fill: object
    publish_exits: object


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return AttentionBackend("torch", decode_attention_torch, write_kv_torch, native_fill_torch,
                                publish_exits_torch)
    if name == "triton":
        from loopbench.kernels import decode_attention as da, kv_write as kw
        return AttentionBackend("triton", da.decode_attention, kw.write_kv, kw.native_fill, kw.publish_exits)
    raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")
