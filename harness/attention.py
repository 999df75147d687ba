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

LAYOUTS = ("native", "alias")
BACKENDS = ("torch", "triton")


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
    slot = row_slot.long().clamp(min=0)
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
    tests; the Triton kernel is the fast path.
    """
    n, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    scale = D ** -0.5 if scale is None else scale
    if n == 0:
        return q.new_empty((0, H, D))
    max_ctx = int(row_pos.max().item()) + 1 if n else 0
    planes = key_planes(row_depth, row_pos, row_slot, row_first_alias, exit_map, max_ctx,
                        layout=layout, prefix_tiles=prefix_tiles, tile_size=tile_size)
    key = torch.arange(max_ctx, device=q.device)
    slot = row_slot.long().clamp(min=0)[:, None].expand(n, max_ctx)
    blocks = block_tables.long()[slot, planes, (key // bs)[None, :].expand(n, max_ctx)]
    off = (key % bs)[None, :].expand(n, max_ctx)
    k = k_cache[blocks, off]                                       # [N, max_ctx, Hkv, D]
    v = v_cache[blocks, off]
    acc = torch.promote_types(q.dtype, torch.float32)
    group = H // Hkv
    k = k.to(acc).repeat_interleave(group, dim=2)                  # [N, max_ctx, H, D]
    v = v.to(acc).repeat_interleave(group, dim=2)
    scores = torch.einsum("nhd,nkhd->nhk", q.to(acc), k) * scale   # [N, H, max_ctx]
    valid = key[None, :] <= row_pos.long()[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("nhk,nkhd->nhd", probs, v).to(q.dtype)


def write_kv_torch(k_cache, v_cache, k_new, v_new, block_tables, row_slot, row_depth, row_pos) -> None:
    """Write each row's new K/V ([N, Hkv, D]) into plane row_depth at row_pos (one layer's views)."""
    bs = k_cache.shape[1]
    slot, pos = row_slot.long(), row_pos.long()
    keep = slot >= 0
    slot, pos, depth = slot[keep], pos[keep], row_depth.long()[keep]
    blocks = block_tables.long()[slot, depth - 1, pos // bs]
    k_cache[blocks, pos % bs] = k_new[keep]
    v_cache[blocks, pos % bs] = v_new[keep]


def native_fill_torch(k_all, v_all, block_tables, slot, pos, exit_depth, max_depth) -> None:
    """Copy exited tokens' K/V from plane e into planes e+1..max, every layer (vectorised, no sync).

    k_all, v_all: [L, num_blocks, block_size, Hkv, D]; slot, pos, exit_depth, max_depth: [M] int.
    Entries with slot < 0 or e >= max copy nothing.
    """
    bs, planes = k_all.shape[2], block_tables.shape[1]
    s, p, e = slot.long(), pos.long(), exit_depth.long()
    m = max_depth.long().clamp(max=planes)
    keep = (s >= 0)[:, None]
    for d in range(2, planes + 1):                      # destination plane d: rows with e < d <= max
        take = keep[:, 0] & (e < d) & (d <= m)
        sc = s.clamp(min=0)
        src = block_tables.long()[sc, (e - 1).clamp(min=0), p // bs]
        dst = torch.where(take, block_tables.long()[sc, d - 1, p // bs], src)
        off = p % bs
        k_all[:, dst, off] = k_all[:, src, off]
        v_all[:, dst, off] = v_all[:, src, off]


def publish_exits_torch(exit_map, slot, pos, exit_depth) -> None:
    """exit_map[slot, pos] = exit_depth for entries with slot >= 0 (no sync)."""
    keep = slot >= 0
    s = torch.where(keep, slot, 0).long()
    p = torch.where(keep, pos, 0).long()
    exit_map[s, p] = torch.where(keep, exit_depth.to(exit_map.dtype), exit_map[s, p])


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
