"""Writes into the paged, depth-planed KV cache (Triton), each with a plain torch reference.

- :func:`write_kv`: the new K/V of every row into its depth plane at its position (before attention).
- :func:`native_fill`: the ``native`` layout's copy of an exited token's K/V from plane ``e`` into planes
  ``e+1..max_depth``, every layer, batched over all tokens that exit in a step (BRIEF section 1).
- :func:`publish_exits`: ``exit_map[slot, pos] = e`` for the ``alias`` layout.

Layouts as in DESIGN.md: ``k_cache: [num_blocks, block_size, Hkv, D]`` (one layer) or
``[L, num_blocks, block_size, Hkv, D]`` (all layers); ``block_tables: [S, P, max_blocks] int32``;
``exit_map: [S, max_model_len] int32``. Depths are 1-based; plane index is ``depth - 1``.
Entries whose slot is negative (padding) are skipped, as are entries whose position or depth lies outside
the tables, so a padded CUDA-Graph bucket never writes out of bounds. None of these synchronise with the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_ops import rotate_head_


@triton.jit
def _write_kv_kernel(
    # pointers
    k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, block_tables_ptr, row_slot_ptr, row_depth_ptr,
    row_pos_ptr,
    # sizes
    num_slots, num_planes, max_blocks, num_kv_heads,
    # strides
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_kn_n, stride_kn_h, stride_kn_d,
    stride_vn_n, stride_vn_h, stride_vn_d,
    stride_bts, stride_btp, stride_btj,
    # meta
    PAGE_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(row_slot_ptr + row)
    depth = tl.load(row_depth_ptr + row)
    pos = tl.load(row_pos_ptr + row)
    ok = (slot >= 0) & (slot < num_slots) & (depth >= 1) & (depth <= num_planes)
    ok = ok & (pos >= 0) & (pos < max_blocks * PAGE_SIZE)
    slot = tl.where(ok, slot, 0)
    depth = tl.where(ok, depth, 1)
    pos = tl.where(ok, pos, 0)
    # Skipped rows were clamped to (slot 0, plane 1, pos 0), so this unmasked load stays in bounds.
    block = tl.load(block_tables_ptr + slot * stride_bts + (depth - 1) * stride_btp
                    + (pos // PAGE_SIZE) * stride_btj).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # Validity folds into the head bound: the interpreter rejects a scalar-and-tensor mask.
    mask = (offs_h[:, None] < tl.where(ok, num_kv_heads, 0)) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_new_ptr + row * stride_kn_n + offs_h[:, None] * stride_kn_h + offs_d[None, :] * stride_kn_d,
                mask=mask)
    v = tl.load(v_new_ptr + row * stride_vn_n + offs_h[:, None] * stride_vn_h + offs_d[None, :] * stride_vn_d,
                mask=mask)
    in_page = pos % PAGE_SIZE
    tl.store(k_cache_ptr + block * stride_kb + in_page * stride_kt + offs_h[:, None] * stride_kh
             + offs_d[None, :] * stride_kd, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vb + in_page * stride_vt + offs_h[:, None] * stride_vh
             + offs_d[None, :] * stride_vd, v, mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    # pointers
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, row_slot_ptr, row_depth_ptr,
    row_pos_ptr,
    # sizes
    num_slots, num_planes, max_blocks,
    # strides
    stride_row, stride_cos,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btp, stride_btj,
    # meta
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)          # 0..H-1 rotate a q head; H..H+Hkv-1 rotate a k head and write k and v
    pos = tl.load(row_pos_ptr + row)
    # fused_ops.rope_'s own code, so qkv (and the k written below) round exactly as it does
    r1, r2 = rotate_head_(qkv_ptr + row * stride_row + head * (2 * HALF), cos_ptr + pos * stride_cos,
                          sin_ptr + pos * stride_cos, HALF, HALF_PAD)
    if head >= NUM_HEADS:
        offs = tl.arange(0, HALF_PAD)
        kv_head = head - NUM_HEADS
        slot = tl.load(row_slot_ptr + row)
        depth = tl.load(row_depth_ptr + row)
        ok = (slot >= 0) & (slot < num_slots) & (depth >= 1) & (depth <= num_planes)
        ok = ok & (pos >= 0) & (pos < max_blocks * PAGE_SIZE)
        # Skipped rows read the table at (slot 0, plane 1, pos 0), in bounds, and write nothing.
        block = tl.load(block_tables_ptr + tl.where(ok, slot, 0) * stride_bts + (tl.where(ok, depth, 1) - 1) * stride_btp
                        + (tl.where(ok, pos, 0) // PAGE_SIZE) * stride_btj).to(tl.int64)
        in_page = tl.where(ok, pos, 0) % PAGE_SIZE
        # Validity folds into the lane bound: the interpreter rejects a scalar-and-tensor mask.
        wmask = offs < tl.where(ok, HALF, 0)
        k_dst = k_cache_ptr + block * stride_kb + in_page * stride_kt + kv_head * stride_kh
        tl.store(k_dst + offs * stride_kd, r1, mask=wmask)
        tl.store(k_dst + (HALF + offs) * stride_kd, r2, mask=wmask)
        v_src = qkv_ptr + row * stride_row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * (2 * HALF)
        v_dst = v_cache_ptr + block * stride_vb + in_page * stride_vt + kv_head * stride_vh
        tl.store(v_dst + offs * stride_vd, tl.load(v_src + offs, mask=wmask), mask=wmask)
        tl.store(v_dst + (HALF + offs) * stride_vd, tl.load(v_src + HALF + offs, mask=wmask), mask=wmask)


@triton.jit
def _native_fill_kernel(
    # pointers
    k_cache_ptr, v_cache_ptr, block_tables_ptr, fill_slot_ptr, fill_pos_ptr, fill_exit_ptr, fill_max_ptr,
    # sizes
    num_slots, num_planes, max_blocks, num_kv_heads,
    # strides
    stride_kl, stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vl, stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btp, stride_btj,
    # meta
    PAGE_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    entry = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(fill_slot_ptr + entry)
    pos = tl.load(fill_pos_ptr + entry)
    exit_depth = tl.load(fill_exit_ptr + entry)
    max_depth = tl.minimum(tl.load(fill_max_ptr + entry), num_planes)
    ok = (slot >= 0) & (slot < num_slots) & (exit_depth >= 1) & (exit_depth < max_depth)
    ok = ok & (pos >= 0) & (pos < max_blocks * PAGE_SIZE)
    slot = tl.where(ok, slot, 0)
    pos = tl.where(ok, pos, 0)
    exit_depth = tl.where(ok, exit_depth, 1)
    max_depth = tl.where(ok, max_depth, 1)      # empty target range for skipped entries

    bt_col = block_tables_ptr + slot * stride_bts + (pos // PAGE_SIZE) * stride_btj
    in_page = pos % PAGE_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # Validity folds into the head bound: the interpreter rejects a scalar-and-tensor mask.
    mask = (offs_h[:, None] < tl.where(ok, num_kv_heads, 0)) & (offs_d[None, :] < HEAD_DIM)
    k_tok = k_cache_ptr + layer * stride_kl + in_page * stride_kt + offs_h[:, None] * stride_kh \
        + offs_d[None, :] * stride_kd
    v_tok = v_cache_ptr + layer * stride_vl + in_page * stride_vt + offs_h[:, None] * stride_vh \
        + offs_d[None, :] * stride_vd
    # Skipped entries were clamped to (slot 0, plane 1, pos 0), so this unmasked load stays in bounds.
    src = tl.load(bt_col + (exit_depth - 1) * stride_btp).to(tl.int64)
    k = tl.load(k_tok + src * stride_kb, mask=mask)
    v = tl.load(v_tok + src * stride_vb, mask=mask)
    for plane in range(exit_depth, max_depth):      # 0-based target planes e .. max_depth-1
        dst = tl.load(bt_col + plane * stride_btp).to(tl.int64)
        tl.store(k_tok + dst * stride_kb, k, mask=mask)
        tl.store(v_tok + dst * stride_vb, v, mask=mask)


@triton.jit
def _publish_exits_kernel(
    exit_map_ptr, slot_ptr, pos_ptr, exit_depth_ptr,
    num_entries, num_slots, max_model_len,
    stride_ems, stride_emp,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < num_entries
    slot = tl.load(slot_ptr + offs, mask=live, other=-1)
    pos = tl.load(pos_ptr + offs, mask=live, other=-1)
    e = tl.load(exit_depth_ptr + offs, mask=live, other=0)
    ok = live & (slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < max_model_len)
    tl.store(exit_map_ptr + tl.where(ok, slot, 0) * stride_ems + tl.where(ok, pos, 0) * stride_emp, e, mask=ok)


def _check(name: str, t, dtype=None, dim=None, n=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {t.shape[0]}")
    if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _same_device(**tensors) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{', '.join(tensors)} must be on one device, got {sorted(map(str, devices))}")


def _validate_write(k_cache, v_cache, k_new, v_new, block_tables, row_slot, row_depth, row_pos):
    _check("k_cache", k_cache, dim=4)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    n = k_new.shape[0]
    want = (n, k_cache.shape[2], k_cache.shape[3])
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        _check(name, t, dtype=k_cache.dtype, dim=3)
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be [N, Hkv, D] = {list(want)}, got {tuple(t.shape)}")
    _check("block_tables", block_tables, torch.int32, 3)
    for name, t in (("row_slot", row_slot), ("row_depth", row_depth), ("row_pos", row_pos)):
        _check(name, t, torch.int32, 1, n)
    _same_device(k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new, block_tables=block_tables,
                 row_slot=row_slot, row_depth=row_depth, row_pos=row_pos)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             block_tables: torch.Tensor, row_slot: torch.Tensor, row_depth: torch.Tensor,
             row_pos: torch.Tensor) -> None:
    """Write each row's new K/V into plane ``row_depth`` at ``row_pos`` of its slot, in place.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (one layer), any float dtype.
        k_new, v_new: ``[N, Hkv, D]``, the cache's dtype.
        block_tables: ``[S, P, max_blocks] int32``.
        row_slot, row_depth, row_pos: ``[N] int32``; rows with ``row_slot < 0`` are skipped.
    """
    _validate_write(k_cache, v_cache, k_new, v_new, block_tables, row_slot, row_depth, row_pos)
    n = k_new.shape[0]
    if n == 0:
        return
    _, page_size, hkv, d = k_cache.shape
    _write_kv_kernel[(n,)](
        k_cache, v_cache, k_new, v_new, block_tables, row_slot, row_depth, row_pos,
        *block_tables.shape, hkv,
        *k_cache.stride(), *v_cache.stride(), *k_new.stride(), *v_new.stride(), *block_tables.stride(),
        PAGE_SIZE=page_size, HEADS_PAD=triton.next_power_of_2(hkv), HEAD_DIM=d,
        HEAD_DIM_PAD=triton.next_power_of_2(d), num_warps=4)


def rope_write_kv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor, row_slot: torch.Tensor,
                   row_depth: torch.Tensor, row_pos: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotary embedding of q and k in place and the new K/V into the cache, in one launch.

    Computes exactly ``fused_ops.rope_(qkv, ...)`` followed by :func:`write_kv` of the rotated k and of v
    (same formula, same rounding, so bitwise the same cache and qkv), saving a launch per layer.

    Args:
        qkv: ``[N, (H + 2 Hkv) * D]`` fused projection rows (q heads, k heads, v heads), unit last stride,
            the cache's dtype; q and k are rotated in place.
        cos, sin: ``[max_len, D // 2]`` fp32/fp64 contiguous rotary tables, indexed by ``row_pos``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (one layer).
        block_tables: ``[S, P, max_blocks] int32``; row_slot, row_depth, row_pos: ``[N] int32``
            (rows with ``row_slot < 0`` or out-of-range depth/position write nothing).
        num_heads: H, the query heads.
    Returns qkv. Raises ValueError on shapes, dtypes or devices that do not fit. Never synchronises.
    """
    _check("k_cache", k_cache, dim=4)
    _check("qkv", qkv, dtype=k_cache.dtype, dim=2)
    n, width = qkv.shape
    _, page_size, hkv, d = k_cache.shape
    if qkv.stride(1) != 1 or width != (num_heads + 2 * hkv) * d:
        raise ValueError(f"qkv must be [N, (H + 2 Hkv) * D] = [N, {(num_heads + 2 * hkv) * d}] with unit last "
                         f"stride, got {tuple(qkv.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d // 2 or not cos.is_contiguous():
        raise ValueError(f"cos/sin must be contiguous [max_len, {d // 2}], got {tuple(cos.shape)}")
    kv_view = qkv[:, num_heads * d:].view(n, 2, hkv, d)
    _validate_write(k_cache, v_cache, kv_view[:, 0], kv_view[:, 1], block_tables, row_slot, row_depth, row_pos)
    if n:
        half = d // 2
        _rope_write_kv_kernel[(n, num_heads + hkv)](
            qkv, cos, sin, k_cache, v_cache, block_tables, row_slot, row_depth, row_pos,
            *block_tables.shape, qkv.stride(0), cos.stride(0),
            *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
            NUM_HEADS=num_heads, NUM_KV_HEADS=hkv, HALF=half, HALF_PAD=triton.next_power_of_2(half),
            PAGE_SIZE=page_size, num_warps=1)
    return qkv


def write_kv_ref(k_cache, v_cache, k_new, v_new, block_tables, row_slot, row_depth, row_pos) -> None:
    """Torch reference of :func:`write_kv` (host loop; tests only)."""
    _validate_write(k_cache, v_cache, k_new, v_new, block_tables, row_slot, row_depth, row_pos)
    page_size = k_cache.shape[1]
    num_planes, max_blocks = block_tables.shape[1], block_tables.shape[2]
    for i in range(k_new.shape[0]):
        slot, depth, pos = int(row_slot[i]), int(row_depth[i]), int(row_pos[i])
        in_range = 0 <= slot < block_tables.shape[0] and 0 <= pos < max_blocks * page_size
        if not in_range or not 1 <= depth <= num_planes:
            continue
        block = int(block_tables[slot, depth - 1, pos // page_size])
        k_cache[block, pos % page_size] = k_new[i]
        v_cache[block, pos % page_size] = v_new[i]


def _validate_fill(k_cache_all, v_cache_all, block_tables, fill_slot, fill_pos, fill_exit_depth,
                   fill_max_depth):
    _check("k_cache_all", k_cache_all, dim=5)
    if v_cache_all.shape != k_cache_all.shape or v_cache_all.dtype != k_cache_all.dtype:
        raise ValueError(f"v_cache_all {tuple(v_cache_all.shape)} {v_cache_all.dtype} must match "
                         f"k_cache_all {tuple(k_cache_all.shape)} {k_cache_all.dtype}")
    _check("block_tables", block_tables, torch.int32, 3)
    m = fill_slot.shape[0] if isinstance(fill_slot, torch.Tensor) else None
    for name, t in (("fill_slot", fill_slot), ("fill_pos", fill_pos), ("fill_exit_depth", fill_exit_depth),
                    ("fill_max_depth", fill_max_depth)):
        _check(name, t, torch.int32, 1, m)
    _same_device(k_cache_all=k_cache_all, v_cache_all=v_cache_all, block_tables=block_tables,
                 fill_slot=fill_slot, fill_pos=fill_pos, fill_exit_depth=fill_exit_depth,
                 fill_max_depth=fill_max_depth)


def native_fill(k_cache_all: torch.Tensor, v_cache_all: torch.Tensor, block_tables: torch.Tensor,
                fill_slot: torch.Tensor, fill_pos: torch.Tensor, fill_exit_depth: torch.Tensor,
                fill_max_depth: torch.Tensor) -> None:
    """Copy each exited token's K/V from plane ``e`` into planes ``e+1..max_depth``, every layer, in place.

    Args:
        k_cache_all, v_cache_all: ``[L, num_blocks, block_size, Hkv, D]``.
        block_tables: ``[S, P, max_blocks] int32``.
        fill_slot, fill_pos, fill_exit_depth, fill_max_depth: ``[M] int32``, one entry per exiting token;
            ``max_depth`` is clamped to ``P``; entries with ``slot < 0`` or ``e >= max_depth`` copy nothing.
    """
    _validate_fill(k_cache_all, v_cache_all, block_tables, fill_slot, fill_pos, fill_exit_depth,
                   fill_max_depth)
    m = fill_slot.shape[0]
    num_layers, _, page_size, hkv, d = k_cache_all.shape
    if m == 0 or num_layers == 0:
        return
    _native_fill_kernel[(m, num_layers)](
        k_cache_all, v_cache_all, block_tables, fill_slot, fill_pos, fill_exit_depth, fill_max_depth,
        *block_tables.shape, hkv,
        *k_cache_all.stride(), *v_cache_all.stride(), *block_tables.stride(),
        PAGE_SIZE=page_size, HEADS_PAD=triton.next_power_of_2(hkv), HEAD_DIM=d,
        HEAD_DIM_PAD=triton.next_power_of_2(d), num_warps=4)


def native_fill_ref(k_cache_all, v_cache_all, block_tables, fill_slot, fill_pos, fill_exit_depth,
                    fill_max_depth) -> None:
    """Torch reference of :func:`native_fill` (host loop; tests only)."""
    _validate_fill(k_cache_all, v_cache_all, block_tables, fill_slot, fill_pos, fill_exit_depth,
                   fill_max_depth)
    page_size = k_cache_all.shape[2]
    num_planes, max_blocks = block_tables.shape[1], block_tables.shape[2]
    for i in range(fill_slot.shape[0]):
        slot, pos, e = int(fill_slot[i]), int(fill_pos[i]), int(fill_exit_depth[i])
        max_depth = min(int(fill_max_depth[i]), num_planes)
        in_range = 0 <= slot < block_tables.shape[0] and 0 <= pos < max_blocks * page_size
        if not in_range or not 1 <= e < max_depth:
            continue
        j, off = pos // page_size, pos % page_size
        src = int(block_tables[slot, e - 1, j])
        for plane in range(e + 1, max_depth + 1):
            dst = int(block_tables[slot, plane - 1, j])
            k_cache_all[:, dst, off] = k_cache_all[:, src, off]
            v_cache_all[:, dst, off] = v_cache_all[:, src, off]


def _validate_publish(exit_map, slot, pos, exit_depth):
    _check("exit_map", exit_map, torch.int32, 2)
    m = slot.shape[0] if isinstance(slot, torch.Tensor) else None
    for name, t in (("slot", slot), ("pos", pos), ("exit_depth", exit_depth)):
        _check(name, t, torch.int32, 1, m)
    _same_device(exit_map=exit_map, slot=slot, pos=pos, exit_depth=exit_depth)


def publish_exits(exit_map: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, exit_depth: torch.Tensor) -> None:
    """Scatter ``exit_map[slot[i], pos[i]] = exit_depth[i]`` in place; entries with ``slot < 0`` are skipped.

    Args:
        exit_map: ``[S, max_model_len] int32``.
        slot, pos, exit_depth: ``[M] int32``. Two live entries for one (slot, pos) race; callers give one.
    """
    _validate_publish(exit_map, slot, pos, exit_depth)
    m = slot.shape[0]
    if m == 0:
        return
    block = 128
    _publish_exits_kernel[(triton.cdiv(m, block),)](
        exit_map, slot, pos, exit_depth, m, exit_map.shape[0], exit_map.shape[1], *exit_map.stride(),
        BLOCK=block, num_warps=4)


def publish_exits_ref(exit_map, slot, pos, exit_depth) -> None:
    """Torch reference of :func:`publish_exits` (host loop; tests only)."""
    _validate_publish(exit_map, slot, pos, exit_depth)
    for s, p, e in zip(slot.tolist(), pos.tolist(), exit_depth.tolist()):
        if 0 <= s < exit_map.shape[0] and 0 <= p < exit_map.shape[1]:
            exit_map[s, p] = e
