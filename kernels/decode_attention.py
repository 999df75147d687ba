"""Depth-aware paged decode attention (Triton), with a plain torch reference beside it.

One query per (row, head) attends causally to keys ``0..row_pos`` of its request, each key read from the
KV plane that the LAST_EXITED rule names (BRIEF section 1, DESIGN.md "Decode-attention backend contract"):

- ``native``: key ``p`` is read from plane ``d`` (the exited tokens were copied there by ``native_fill``);
- ``alias``: key ``p`` is read from plane ``min(d, e_p)`` with ``e_p = exit_map[slot, p]``;
- ``alias`` + ``prefix_tiles``: key tiles of ``tile_size`` positions that end at or before the row's
  first-alias position are read from plane ``d`` directly, the boundary tile and later ones per key.

All three reduce the same key tiles in the same order with the same code (``_online_softmax_step``); the
constexpr ``LAYOUT_ALIAS`` / ``PREFIX`` flags change only how a tile's physical blocks are looked up, never
the tile order, the split of the key range or the arithmetic, so on identical logical KV the three outputs
are bitwise identical. ``native`` runs one loop with direct lookups (plane ``d``'s block table, nothing
loaded first); ``alias`` one routed loop (exit map, then the block table of plane ``min(d, e_p)`` per key);
``alias`` + ``prefix_tiles`` splits the key loop of a split in two: the tiles whose lookups are wholly
direct run the native loop body unchanged, the remaining tiles the routed one. A tile's path is a scalar
fact of the row (its first-alias position), so there is no per-key select and no divergence.

Kernel shape (flash-decoding, Dao et al. 2023, "Flash-Decoding for long-context inference"): one program
per (query head, row, split); grouped-query heads of one kv head are adjacent programs, so their shared
K/V tiles come from L2 (Ouro and the tiny test model are plain MHA). The key range of a row is cut into at
most ``MAX_SPLITS`` contiguous splits whose length depends only on the row's context length and module
constants (never on the batch, the layout or the device), so a row's result does not depend on what it is
batched with. Within a split each of the ``BLOCK_N`` key lanes keeps its own online softmax (Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax") in fp32, so the loop body has no cross-lane
reduction except the dot product over D; the lanes merge once at the end, and the split writes
``(m, l, acc)`` for a second kernel that merges splits in a fixed order. When the cache can hold no more
than one split's keys the first kernel normalises and writes the output itself. The loops are software-
pipelined by hand: the next tile's K/V loads and the page lookups two tiles ahead are issued before the
current tile is reduced, and the routed loop reads the exit map three tiles ahead, so no lookup waits on a
load issued in the same iteration.

Measured on an H200 (kernels/results/decode_attention_h200_dd8c0a3.md, Ouro shape, bf16, B 1-128, context
128-4096, first alias at 60% of the context): native reads K/V at 55-100% of the device-to-device copy
ceiling for B >= 32 (73-100% at context >= 1024), 0.94-1.18x the time of dense cuDNN SDPA over contiguous
K/V for B >= 16. Plain alias takes 1.04-1.08x native's time for B >= 16; alias+prefix 1.02-1.06x at context
128-256 but 1.09-1.15x at 1024-4096. Against ce805f8's kernel timed in the same process
(kernels/results/decode_attention_h200_ce805f8.md), the bf16 widening by a shift (``_widen``), the routed
loop's fresh start and the register cap took 16-19% off every layout's time at B32, context 128-256 (one
wave instead of two; the engine's bench points) and 5-6% off native's at context 1024, but added 0-5% to
alias+prefix's there (the kernels/results/decode_attention_h200.md table of an earlier kernel had
alias+prefix at 0.98-1.03x native). Reading the exit map a tile ahead is worth 2.5-6.5%. Per tile (ptxas,
sm_90), the routed loop has about 8% more instructions than the direct one (an exit-map load, the plane and
the block-table address per key).

Scores use ``exp2`` with ``scale * log2(e)`` folded into the query (the FlashAttention-2 formulation).
The dot products are fp32 elementwise products reduced with ``tl.sum``: decode has one query per head, so
there is no matrix product to feed tensor cores, and the Triton interpreter computes bf16 ``tl.dot`` wrongly
(BRIEF section 4).

On sm_90+ NVIDIA GPUs both kernels launch with programmatic dependent launch (kernels/pdl.py) and release the
next kernel before their stores (or right after their wait, per ``pdl.TRIGGER``). The merge kernel waits for
the previous kernel before its first load. The split kernel waits only after its dependent-load chain has
started: it reads the row's metadata, looks up its first pages and loads its first K/V tile, without the key
at the row's position, then waits, loads q and, where that first tile holds the key at the position (a split
of one tile), loads the tile again whole. So the kernel before it (the step's KV write) may write q and the
key at each row's position and nothing else this kernel reads; the results are the same values either way.
Two schedule knobs more, off until measured: ``early_trigger`` releases the next kernel right after the wait
(its weight prefetch then runs under this kernel), ``prefetch_kv`` asks L2 for a split's next K/V tiles before
the wait (its history streams in under the qkv kernel where that one releases early). The layout
flags never touch that, so native, alias and alias+prefix keep the same schedule around the loop.

The kernels know nothing about exit policies or the scheduler; they read the metadata tensors as given.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import pdl
from .gemm import l2_prefetch_if, sm_count

LAYOUTS = ("native", "alias")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # of q and the caches (no float64: the CPU reference's)

# A split covers at least MIN_SPLIT_TOKENS keys and a row has at most MAX_SPLITS splits; both are
# constants so the split of a row's key range is a pure function of its context length.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16
# Keys per inner-loop iteration (the compute tile). Independent of ``tile_size``, which only sets the
# granularity of the prefix switch; must be a power of two.
DEFAULT_BLOCK_N = 32
MAX_PREFETCH_KV = 32            # tiles decode_attention(prefetch_kv=...) may ask of L2 (unrolled, 256 keys a step)

_LOG2E = 1.4426950408889634


@triton.jit
def _direct_pages(bt_plane, tile, split_end, stride_btj, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Native addressing: physical block of each key of ``tile`` in the plane ``bt_plane`` points at.

    int64 ``[BLOCK_N]``; 0 for keys at or past ``split_end``. No exit-map access, and the address of the
    lookup depends on nothing loaded but the row's metadata.
    """
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    block = tl.load(bt_plane + (offs_n // PAGE_SIZE) * stride_btj, mask=offs_n < split_end, other=0)
    return block.to(tl.int64)


@triton.jit
def _exit_tile(exit_row, tile, split_end, direct_end, num_planes, stride_emp, BLOCK_N: tl.constexpr,
               MASK_DIRECT: tl.constexpr):
    """``e_p`` of each key of ``tile``; ``num_planes`` (read from plane ``d``) for keys not looked up:
    keys at or past ``split_end`` and, with ``MASK_DIRECT``, keys before ``direct_end`` (the exit map is
    never read there). Without ``MASK_DIRECT`` the caller guarantees the tile starts at or past it."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < split_end
    if MASK_DIRECT:
        mask = mask & (offs_n >= direct_end)
    return tl.load(exit_row + offs_n * stride_emp, mask=mask, other=num_planes)


@triton.jit
def _routed_pages(bt_row, exit_depth, tile, split_end, depth, stride_btp, stride_btj, BLOCK_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr):
    """Alias addressing: block of each key of ``tile`` in plane ``min(depth, e_p)`` (``exit_depth``).

    ``plane - 1`` is an unsigned minimum (one instruction per key): an out-of-range ``e_p <= 0`` wraps to a
    large value and reads plane ``depth``, so no index leaves the row's block tables.
    """
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    plane_m1 = tl.minimum((exit_depth - 1).to(tl.uint32, bitcast=True), (depth - 1).to(tl.uint32, bitcast=True))
    block = tl.load(bt_row + plane_m1.to(tl.int32, bitcast=True) * stride_btp
                    + (offs_n // PAGE_SIZE) * stride_btj, mask=offs_n < split_end, other=0)
    return block.to(tl.int64)


@triton.jit
def _tile_pages(bt_row, bt_plane, exit_row, tile, split_end, depth, direct_end, direct_tiles, num_planes,
                stride_btp, stride_btj, stride_emp, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                LAYOUT_ALIAS: tl.constexpr, PREFIX: tl.constexpr):
    """Blocks of ``tile`` by whichever path the tile takes (a scalar branch; used outside the loops)."""
    if LAYOUT_ALIAS:
        if PREFIX:
            if tile < direct_tiles:
                block = _direct_pages(bt_plane, tile, split_end, stride_btj, BLOCK_N, PAGE_SIZE)
            else:
                exit_depth = _exit_tile(exit_row, tile, split_end, direct_end, num_planes, stride_emp,
                                        BLOCK_N, PREFIX)
                block = _routed_pages(bt_row, exit_depth, tile, split_end, depth, stride_btp, stride_btj,
                                      BLOCK_N, PAGE_SIZE)
        else:
            exit_depth = _exit_tile(exit_row, tile, split_end, direct_end, num_planes, stride_emp, BLOCK_N,
                                    PREFIX)
            block = _routed_pages(bt_row, exit_depth, tile, split_end, depth, stride_btp, stride_btj,
                                  BLOCK_N, PAGE_SIZE)
    else:
        block = _direct_pages(bt_plane, tile, split_end, stride_btj, BLOCK_N, PAGE_SIZE)
    return block


@triton.jit
def _load_kv(k_head, v_head, block, tile, split_end, offs_t, mask_d, stride_kb, stride_kt, stride_vb,
             stride_vt, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, CACHE: tl.constexpr):
    """K and V of ``tile``'s keys before ``split_end`` (zeros past it); ``CACHE`` the loads' cache modifier."""
    offs_n = tile * BLOCK_N + offs_t
    mask_kv = (offs_n[:, None] < split_end) & mask_d[None, :]
    in_page = (offs_n % PAGE_SIZE)[:, None]
    k = tl.load(k_head + block[:, None] * stride_kb + in_page * stride_kt, mask=mask_kv, other=0.0,
                cache_modifier=CACHE)
    v = tl.load(v_head + block[:, None] * stride_vb + in_page * stride_vt, mask=mask_kv, other=0.0,
                cache_modifier=CACHE)
    return k, v


@triton.jit
def _span_pages(bt_row, bt_plane, exit_row, offs_n, mask, depth, direct_end, num_planes, stride_btp, stride_btj,
                stride_emp, PAGE_SIZE: tl.constexpr, LAYOUT_ALIAS: tl.constexpr):
    """Blocks of keys ``offs_n`` (any span, ``mask`` the keys to look up, 0 for the rest) by the path the loops
    take for them: plane ``depth`` before ``direct_end`` (native: every key), else plane ``min(depth, e_p)``.
    One exit-map gather and one block-table gather for the whole span, so a prefetch of many tiles costs two
    dependent round trips, not two a tile."""
    if LAYOUT_ALIAS:
        e = tl.load(exit_row + offs_n * stride_emp, mask=mask & (offs_n >= direct_end), other=num_planes)
        plane_m1 = tl.minimum((e - 1).to(tl.uint32, bitcast=True), (depth - 1).to(tl.uint32, bitcast=True))
        block = tl.load(bt_row + plane_m1.to(tl.int32, bitcast=True) * stride_btp + (offs_n // PAGE_SIZE) * stride_btj,
                        mask=mask, other=0)
    else:
        block = tl.load(bt_plane + (offs_n // PAGE_SIZE) * stride_btj, mask=mask, other=0)
    return block.to(tl.int64)


@triton.jit
def _kv_line_offsets(block, offs_n, stride_b, stride_t, stride_d, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Element offsets, from a kv head's base, of every 128-byte line (``LINE_ELEMS`` elements) of the rows of
    keys ``offs_n`` (their pages ``block``): int64 ``[len(offs_n), max(1, HEAD_DIM_PAD // LINE_ELEMS)]``, each
    line's first element clamped to the row's last (``HEAD_DIM`` < ``HEAD_DIM_PAD``: no line past the row)."""
    LINES: tl.constexpr = max(1, HEAD_DIM_PAD // LINE_ELEMS)
    in_page = (offs_n % PAGE_SIZE).to(tl.int64)
    lines = tl.minimum(tl.arange(0, LINES) * LINE_ELEMS, HEAD_DIM - 1).to(tl.int64)
    return (block * stride_b + in_page * stride_t)[:, None] + lines[None, :] * stride_d


@triton.jit
def _widen(x):
    """``x`` in fp32, the same values as ``x.to(tl.float32)``. A bf16 value is the upper half of its fp32
    value, so bf16 tiles widen by an integer shift: Triton 3.6 then keeps a K/V tile carried across loop
    iterations as packed 32-bit words (the cast made LLVM carry one tile as 32 scalar 16-bit values, one
    register each), which is what lets every layout fit the 128-register cap without spilling (uncapped,
    ptxas still gives alias and alias+prefix more than 128)."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (bits << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _online_softmax_step(q, k_cur, v_cur, tile, split_end, offs_t, m_i, l_i, acc, BLOCK_N: tl.constexpr):
    """One tile of the per-lane online softmax. Every loop of every layout calls exactly this code, in
    the same tile order, which is what makes native, alias and alias+prefix bitwise equal."""
    s = tl.sum(q[None, :] * k_cur, axis=1)                               # (N,), log2 units
    s = tl.where(tile * BLOCK_N + offs_t < split_end, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                # a lane with no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v_cur
    return m_new, l_i, acc


# Sizes that vary with the batch are not specialised on (== 1, % 16), so a new batch shape never recompiles,
# except once where its grid crosses launch_config's register-cap threshold (a second compiled variant;
# the engine meets it in its eager warm-up before graph capture).
@triton.jit(do_not_specialize=["num_slots", "num_planes", "max_ctx", "tile_size"])
def _decode_attention_split_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, row_slot_ptr, row_depth_ptr, row_pos_ptr,
    exit_map_ptr, row_first_alias_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    # sizes
    num_slots, num_planes, max_ctx, qk_scale_log2, tile_size,
    # strides
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btp, stride_btj,
    stride_ems, stride_emp,
    stride_on, stride_oh, stride_od,
    stride_pn, stride_ph, stride_ps,
    # meta
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr, MAX_SPLITS_PER_ROW: tl.constexpr,
    LAYOUT_ALIAS: tl.constexpr, PREFIX: tl.constexpr, MASK_ROUTED: tl.constexpr, EXIT_AHEAD: tl.constexpr,
    DIRECT_OUT: tl.constexpr, PDL: tl.constexpr = False, PIPE_STAGES: tl.constexpr = 0, EARLY_KV: tl.constexpr = True,
    PREFETCH_KV: tl.constexpr = 0, LINE_ELEMS: tl.constexpr = 64, PREFETCH_CHUNK: tl.constexpr = 256,
):
    head = tl.program_id(0)          # fastest grid axis: the query heads of one kv head run side by side
    row = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP

    # EARLY_KV: before the PDL wait, the row's metadata, its page lookups and its first K/V tile. None of it is
    # written by the kernel launched right before this one (the step's qkv projection or KV write), which writes q
    # and the key at ``pos`` only; every kernel before that one has completed when this kernel's programs start
    # (kernels/pdl.py). So the dependent-load chain metadata -> block table -> K/V overlaps that kernel's tail,
    # and only q and the key at ``pos`` are loaded after the wait.
    if not EARLY_KV:
        pdl.wait(PDL)
    slot = tl.load(row_slot_ptr + row)
    depth = tl.load(row_depth_ptr + row)
    pos = tl.load(row_pos_ptr + row)
    # Padding rows (slot < 0) see no keys; every index below is clamped so nothing is read out of bounds.
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    depth = tl.minimum(tl.maximum(depth, 1), num_planes)
    n_ctx = tl.where(valid, tl.minimum(tl.maximum(pos + 1, 0), max_ctx), 0)

    # The row's split: a pure function of n_ctx and the constants.
    n_tiles = (n_ctx + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = tl.maximum((n_tiles + MAX_SPLITS_PER_ROW - 1) // MAX_SPLITS_PER_ROW, MIN_SPLIT_TILES)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, n_tiles)
    # Keys at or past split_end (the next split's) are masked out of every load.
    split_end = tl.minimum(tile_hi * BLOCK_N, n_ctx)

    # Keys before direct_end are read from plane `depth` without consulting the exit map; the compute
    # tiles [0, direct_tiles) lie wholly before it and take the native addressing path.
    if LAYOUT_ALIAS:
        if PREFIX:
            first_alias = tl.maximum(tl.load(row_first_alias_ptr + row), 0)
            direct_end = (first_alias // tile_size) * tile_size
        else:
            direct_end = 0
    else:
        direct_end = n_ctx
    direct_tiles = direct_end // BLOCK_N
    # Page lookups run two tiles ahead of the reduction, so the loop over tiles [tile_lo, routed_from)
    # looks up direct tiles only (native code), the loop over [routed_from, tile_hi) routed ones only.
    if LAYOUT_ALIAS:
        routed_from = tl.minimum(tl.maximum(direct_tiles - 2, tile_lo), tile_hi)
    else:
        routed_from = tile_hi

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_t = tl.arange(0, BLOCK_N)
    mask_d = offs_d < HEAD_DIM
    # The keys the first load may read: with EARLY_KV those this step has not written, all before ``pos`` (every
    # key when ``pos`` is past the cache).
    if EARLY_KV:
        early_end = tl.maximum(tl.minimum(split_end, pos), 0)
    else:
        early_end = split_end

    bt_row = block_tables_ptr + slot * stride_bts
    bt_plane = bt_row + (depth - 1) * stride_btp                              # plane d's block table
    exit_row = exit_map_ptr + slot * stride_ems
    k_head = k_cache_ptr + kv_head * stride_kh + offs_d[None, :] * stride_kd
    v_head = v_cache_ptr + kv_head * stride_vh + offs_d[None, :] * stride_vd

    # Software pipeline, by hand so it does not depend on the compiler's: K/V of the next tile are in
    # flight while this one is reduced, and the block-table lookups run two tiles ahead. In the routed
    # loop the exit map is read one tile further ahead still (EXIT_AHEAD), so no lookup waits on a load
    # issued in the same iteration.
    block = _tile_pages(bt_row, bt_plane, exit_row, tile_lo, split_end, depth, direct_end, direct_tiles,
                        num_planes, stride_btp, stride_btj, stride_emp, BLOCK_N, PAGE_SIZE, LAYOUT_ALIAS,
                        PREFIX)
    k, v = _load_kv(k_head, v_head, block, tile_lo, early_end, offs_t, mask_d, stride_kb, stride_kt,
                    stride_vb, stride_vt, BLOCK_N, PAGE_SIZE, "")
    block = _tile_pages(bt_row, bt_plane, exit_row, tile_lo + 1, split_end, depth, direct_end, direct_tiles,
                        num_planes, stride_btp, stride_btj, stride_emp, BLOCK_N, PAGE_SIZE, LAYOUT_ALIAS,
                        PREFIX)
    if LAYOUT_ALIAS and not PREFIX:
        if EXIT_AHEAD:      # e_p of the first tile the routed loop looks up (alias+prefix: after its direct loop)
            exit_next = _exit_tile(exit_row, routed_from + 2, split_end, direct_end, num_planes, stride_emp,
                                   BLOCK_N, PREFIX)
    if PREFETCH_KV:     # the next tiles' K/V lines into L2 while the previous kernel runs (CUDA, EARLY_KV only)
        pf_end = tl.minimum(split_end, (tile_lo + 1 + PREFETCH_KV) * BLOCK_N)
        for c in tl.static_range(0, PREFETCH_KV * BLOCK_N, PREFETCH_CHUNK):
            offs_p = (tile_lo + 1) * BLOCK_N + c + tl.arange(0, PREFETCH_CHUNK)
            mask_p = offs_p < pf_end
            pages = _span_pages(bt_row, bt_plane, exit_row, offs_p, mask_p, depth, direct_end, num_planes,
                                stride_btp, stride_btj, stride_emp, PAGE_SIZE, LAYOUT_ALIAS)
            l2_prefetch_if(k_cache_ptr + kv_head * stride_kh
                            + _kv_line_offsets(pages, offs_p, stride_kb, stride_kt, stride_kd, PAGE_SIZE, HEAD_DIM,
                                               HEAD_DIM_PAD, LINE_ELEMS), mask_p[:, None])
            l2_prefetch_if(v_cache_ptr + kv_head * stride_vh
                            + _kv_line_offsets(pages, offs_p, stride_vb, stride_vt, stride_vd, PAGE_SIZE, HEAD_DIM,
                                               HEAD_DIM_PAD, LINE_ELEMS), mask_p[:, None])

    if EARLY_KV:
        pdl.wait(PDL)                      # q and the key at pos are the previous kernel's output
    q = tl.load(q_ptr + row * stride_qn + head * stride_qh + offs_d * stride_qd, mask=mask_d, other=0.0)
    q = q.to(tl.float32) * qk_scale_log2                                     # (D,)
    if (early_end < split_end) & (early_end >= tile_lo * BLOCK_N) & (early_end < (tile_lo + 1) * BLOCK_N):
        # The first tile holds the key at pos (a split of one tile): load it whole now, past L1 (.cg), where a line
        # loaded before the wait could hold the key beside it (heads of fewer than 32 bytes).
        k, v = _load_kv(k_head, v_head, _tile_pages(bt_row, bt_plane, exit_row, tile_lo, split_end, depth, direct_end,
                                                    direct_tiles, num_planes, stride_btp, stride_btj, stride_emp,
                                                    BLOCK_N, PAGE_SIZE, LAYOUT_ALIAS, PREFIX),
                        tile_lo, split_end, offs_t, mask_d, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N,
                        PAGE_SIZE, ".cg")

    # Online softmax kept per key lane (Milakov & Gimelshein 2018, applied to each of the BLOCK_N lanes
    # separately): the loop has no cross-lane reduction but the dot product over D; lanes merge once below.
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    if LAYOUT_ALIAS:
        if PREFIX:
            # Direct prefix: the native loop, tile for tile.
            for tile in range(tile_lo, routed_from):
                k_cur = _widen(k)
                v_cur = _widen(v)
                k, v = _load_kv(k_head, v_head, block, tile + 1, split_end, offs_t, mask_d, stride_kb,
                                stride_kt, stride_vb, stride_vt, BLOCK_N, PAGE_SIZE, "")
                block = _direct_pages(bt_plane, tile + 2, split_end, stride_btj, BLOCK_N, PAGE_SIZE)
                m_i, l_i, acc = _online_softmax_step(q, k_cur, v_cur, tile, split_end, offs_t, m_i, l_i, acc,
                                                     BLOCK_N)
            # The routed loop's first K/V pages, looked up afresh (an L1 hit) instead of taken from the loop
            # above: same values, but carrying them across made Triton 3.6 move the routed loop's lookups to
            # another register layout, with a shared-memory exchange and two barriers per tile. Its first
            # K/V tile is loaded afresh too (an L1/L2 hit; the direct loop's last prefetch goes unused), and
            # its first exit-map tile read only here: carried across the direct loop, the tile and the exit
            # map cost alias+prefix 20-40 registers more than either loop needs (ptxas, sm_90).
            block = _tile_pages(bt_row, bt_plane, exit_row, routed_from, split_end, depth, direct_end,
                                direct_tiles, num_planes, stride_btp, stride_btj, stride_emp, BLOCK_N, PAGE_SIZE,
                                LAYOUT_ALIAS, PREFIX)
            k, v = _load_kv(k_head, v_head, block, routed_from, split_end, offs_t, mask_d, stride_kb, stride_kt,
                            stride_vb, stride_vt, BLOCK_N, PAGE_SIZE, "")
            block = _tile_pages(bt_row, bt_plane, exit_row, routed_from + 1, split_end, depth, direct_end,
                                direct_tiles, num_planes, stride_btp, stride_btj, stride_emp, BLOCK_N, PAGE_SIZE,
                                LAYOUT_ALIAS, PREFIX)
            if EXIT_AHEAD:
                exit_next = _exit_tile(exit_row, routed_from + 2, split_end, direct_end, num_planes, stride_emp,
                                       BLOCK_N, PREFIX)
        # Routed tiles: key p from plane min(d, e_p). Of the tiles looked up here only the first, tile
        # direct_tiles, can hold keys before direct_end (when that is not a multiple of BLOCK_N); with
        # EXIT_AHEAD its exit map was read above, masked, so the loop needs no such mask (MASK_ROUTED).
        for tile in range(routed_from, tile_hi):
            k_cur = _widen(k)
            v_cur = _widen(v)
            k, v = _load_kv(k_head, v_head, block, tile + 1, split_end, offs_t, mask_d, stride_kb,
                            stride_kt, stride_vb, stride_vt, BLOCK_N, PAGE_SIZE, "")
            if EXIT_AHEAD:
                block = _routed_pages(bt_row, exit_next, tile + 2, split_end, depth, stride_btp, stride_btj,
                                      BLOCK_N, PAGE_SIZE)
                exit_next = _exit_tile(exit_row, tile + 3, split_end, direct_end, num_planes, stride_emp,
                                       BLOCK_N, MASK_ROUTED)
            else:
                exit_depth = _exit_tile(exit_row, tile + 2, split_end, direct_end, num_planes, stride_emp,
                                        BLOCK_N, MASK_ROUTED)
                block = _routed_pages(bt_row, exit_depth, tile + 2, split_end, depth, stride_btp, stride_btj,
                                      BLOCK_N, PAGE_SIZE)
            m_i, l_i, acc = _online_softmax_step(q, k_cur, v_cur, tile, split_end, offs_t, m_i, l_i, acc,
                                                 BLOCK_N)
    elif PIPE_STAGES > 0:
        # The plain loop, software-pipelined by the compiler (cp.async into PIPE_STAGES shared buffers);
        # the hand-pipelined prologue's loads above are unused here.
        for tile in tl.range(tile_lo, tile_hi, num_stages=PIPE_STAGES):
            block = _direct_pages(bt_plane, tile, split_end, stride_btj, BLOCK_N, PAGE_SIZE)
            k, v = _load_kv(k_head, v_head, block, tile, split_end, offs_t, mask_d, stride_kb,
                            stride_kt, stride_vb, stride_vt, BLOCK_N, PAGE_SIZE, "")
            m_i, l_i, acc = _online_softmax_step(q, _widen(k), _widen(v), tile, split_end,
                                                 offs_t, m_i, l_i, acc, BLOCK_N)
    else:
        for tile in range(tile_lo, tile_hi):
            k_cur = _widen(k)
            v_cur = _widen(v)
            k, v = _load_kv(k_head, v_head, block, tile + 1, split_end, offs_t, mask_d, stride_kb,
                            stride_kt, stride_vb, stride_vt, BLOCK_N, PAGE_SIZE, "")
            block = _direct_pages(bt_plane, tile + 2, split_end, stride_btj, BLOCK_N, PAGE_SIZE)
            m_i, l_i, acc = _online_softmax_step(q, k_cur, v_cur, tile, split_end, offs_t, m_i, l_i, acc,
                                                 BLOCK_N)

    pdl.release(PDL)
    m = tl.max(m_i, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)                            # an empty split
    w = tl.exp2(m_i - m_safe)
    l = tl.sum(w * l_i, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0)                                     # (D,)
    if DIRECT_OUT:
        o = o / tl.where(l > 0, l, 1.0)
        tl.store(out_ptr + row * stride_on + head * stride_oh + offs_d * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=mask_d)
    else:
        # Empty splits store (m=-inf, l=0, acc=0), which the merge weighs by exactly zero.
        part = row * stride_pn + head * stride_ph + split * stride_ps
        tl.store(part_m_ptr + part, m)
        tl.store(part_l_ptr + part, l)
        tl.store(part_acc_ptr + part * HEAD_DIM_PAD + offs_d, o)


@triton.jit
def _decode_attention_merge_kernel(
    # pointers
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    # strides
    stride_pn, stride_ph, stride_ps,
    stride_on, stride_oh, stride_od,
    # meta
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_s = offs_s < NUM_SPLITS
    part = row * stride_pn + head * stride_ph + offs_s * stride_ps
    pdl.wait(PDL)
    m_s = tl.load(part_m_ptr + part, mask=mask_s, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=mask_s, other=0.0)
    acc_s = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                    mask=mask_s[:, None], other=0.0)
    pdl.release(PDL)
    m = tl.max(m_s, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)     # a row without keys: all weights are zero
    w = tl.exp2(m_s - m)
    l = tl.sum(w * l_s, axis=0)
    acc = tl.sum(w[:, None] * acc_s, axis=0)
    out = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + row * stride_on + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _check_int32(name: str, t: torch.Tensor, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    if dim == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _validate(q, k_cache, v_cache, block_tables, row_slot, row_depth, row_pos, exit_map, row_first_alias,
              layout, tile_size):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size <= 0:
        raise ValueError(f"tile_size must be a positive int, got {tile_size!r}")
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    n, h, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"head_dim of q ({d}) and of the cache ({k_cache.shape[3]}) differ")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    _check_int32("block_tables", block_tables, 3)
    _check_int32("exit_map", exit_map, 2)
    for name, t in (("row_slot", row_slot), ("row_depth", row_depth), ("row_pos", row_pos),
                    ("row_first_alias", row_first_alias)):
        _check_int32(name, t, 1)
        if t.shape[0] != n:
            raise ValueError(f"{name} must have N={n} entries, got {t.shape[0]}")
    if exit_map.shape[0] != block_tables.shape[0]:
        raise ValueError(f"exit_map has {exit_map.shape[0]} slots but block_tables has {block_tables.shape[0]}")
    tensors = (q, k_cache, v_cache, block_tables, row_slot, row_depth, row_pos, exit_map, row_first_alias)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


UNCAPPED_PROGRAMS_PER_SM = 3    # split programs of 4 warps resident per SM uncapped (alias: 151-161 regs)
REGISTER_CAP = 128              # registers per thread under the cap: 4 programs of 4 warps per SM


def launch_config(head_dim: int, block_n: int = DEFAULT_BLOCK_N, programs: int = 0, sm_count: int = 0) -> dict:
    """Launch meta-parameters for the split kernel: a pure function of the tile shape and the grid size.

    Identical for every layout so native, alias and alias+prefix compile the same arithmetic. One warp
    per 1024 tile elements (4 for Ouro's 32 x 128); one stage, since the loop pipelines itself (2 stages
    measured the same). On the H200 (kernels/results/decode_attention_h200.md) this default is the best
    swept setting for short contexts (B16/ctx256); for contexts >= 1024, block_n=16 with one warp was
    6-10% faster and brought alias+prefix from 6-10% to about 3% over native (measured on the previous
    kernel, results/decode_attention_h200_991a154.md).

    Register cap: ``maxnreg=REGISTER_CAP`` when the grid (``programs``, split programs of the launch) is
    more than ``UNCAPPED_PROGRAMS_PER_SM * sm_count``, i.e. when the uncapped alias kernels would need a
    second wave; else none. Since bf16 K/V tiles widen by a shift (``_widen``) and alias+prefix reloads the
    routed loop's first tile, every layout fits 128 registers without spilling (ptxas, Triton 3.6, sm_90;
    uncapped, alias and alias+prefix take 151-161). On the H200 (kernels/results/
    decode_attention_h200_ce805f8.md) the cap brought alias+prefix at B32, context 128-256 (512 programs,
    two waves uncapped) from 1.22-1.23x native to 1.03-1.04x, and plain alias at B16-B64, context 1024
    from 1.09-1.11x to 1.02-1.05x; at B16, context 128-256 (256 programs, one wave either way) it cost
    alias+prefix 3-5% and alias up to 1.3%; native moved under 2% either way. The rule depends on the
    launch shape only, never on the layout, so the native-vs-alias comparison stays about the layouts;
    the cap changes no bit.
    ``sm_count`` 0 (a CPU tensor, the interpreter) means no cap. The threshold counts every program of the
    grid (padding rows and splits past a row's context included) and assumes the default 4 warps.
    """
    tile = block_n * triton.next_power_of_2(head_dim)
    cfg = {"num_warps": max(1, min(8, tile // 1024)), "num_stages": 1}
    if sm_count and programs > UNCAPPED_PROGRAMS_PER_SM * sm_count:
        cfg["maxnreg"] = REGISTER_CAP
    return cfg


def check_knobs(*, block_n: int = DEFAULT_BLOCK_N, min_split_tokens: int = MIN_SPLIT_TOKENS,
                max_splits: int = MAX_SPLITS, num_warps: int | None = None, num_stages: int | None = None,
                maxnreg: int | None = None, exit_ahead: bool = True, pipe_stages: int = 0,
                early_kv: bool = True, early_trigger: bool = False, prefetch_kv: int = 0) -> None:
    """ValueError naming the first of :func:`decode_attention`'s tuning knobs that is out of range."""
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)
    if not is_int(block_n) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")
    if not (is_int(min_split_tokens) and is_int(max_splits)) or min_split_tokens < block_n or max_splits < 1:
        raise ValueError(f"need min_split_tokens >= block_n and max_splits >= 1, got "
                         f"{min_split_tokens!r}, {max_splits!r}")
    if num_warps is not None and (not is_int(num_warps) or num_warps < 1 or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be None or a power of two, got {num_warps!r}")
    if num_stages is not None and (not is_int(num_stages) or num_stages < 1):
        raise ValueError(f"num_stages must be None or an int >= 1, got {num_stages!r}")
    if maxnreg is not None and (not is_int(maxnreg) or maxnreg < 0):
        raise ValueError(f"maxnreg must be None or an int >= 0 (0: no cap), got {maxnreg!r}")
    for name, flag in (("exit_ahead", exit_ahead), ("early_kv", early_kv), ("early_trigger", early_trigger)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be true or false, got {flag!r}")
    for name, count in (("pipe_stages", pipe_stages), ("prefetch_kv", prefetch_kv)):
        if not is_int(count) or count < 0:
            raise ValueError(f"{name} must be an int >= 0, got {count!r}")
    if prefetch_kv > MAX_PREFETCH_KV:
        raise ValueError(f"prefetch_kv must be at most {MAX_PREFETCH_KV} tiles, got {prefetch_kv!r}")
    if prefetch_kv and not early_kv:
        raise ValueError("prefetch_kv needs early_kv (it asks L2 for tiles before the PDL wait), got early_kv=False")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, row_slot: torch.Tensor, row_depth: torch.Tensor,
                     row_pos: torch.Tensor, exit_map: torch.Tensor, row_first_alias: torch.Tensor,
                     layout: str = "native", prefix_tiles: bool = False, tile_size: int = 32,
                     scale: float | None = None, *, block_n: int = DEFAULT_BLOCK_N,
                     min_split_tokens: int = MIN_SPLIT_TOKENS, max_splits: int = MAX_SPLITS,
                     num_warps: int | None = None, num_stages: int | None = None,
                     maxnreg: int | None = None, exit_ahead: bool = True,
                     pipe_stages: int = 0, early_kv: bool = True, early_trigger: bool = False,
                     prefetch_kv: int = 0) -> torch.Tensor:
    """Causal decode attention over a paged, depth-planed KV cache (DESIGN.md contract).

    Args:
        q: ``[N, H, D]`` float32/bfloat16/float16; one row per (request slot, query depth) pair.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, q's dtype; one layer's views.
        block_tables: ``[S, P, max_blocks] int32``; ``block_tables[s, d-1, j]`` holds positions
            ``j*block_size .. (j+1)*block_size-1`` of plane ``d`` of slot ``s``.
        row_slot: ``[N] int32``; ``< 0`` marks a padding row (output zero, nothing read).
        row_depth: ``[N] int32``; the query depth ``d``, 1-based.
        row_pos: ``[N] int32``; the query position; keys ``0..row_pos`` inclusive.
        exit_map: ``[S, max_model_len] int32``; ``e_p``, read only by the ``alias`` layout.
        row_first_alias: ``[N] int32``; smallest ``p`` with ``e_p < d`` (else ``row_pos + 1``), read
            only by ``alias`` with ``prefix_tiles``.
        layout: ``"native"`` or ``"alias"``; ``prefix_tiles`` is ignored for ``native``.
        tile_size: granularity (positions) of the prefix switch.
        scale: softmax scale, default ``1/sqrt(D)``.
        block_n, min_split_tokens, max_splits, num_warps, num_stages, maxnreg: tuning knobs (benchmarks
            only; ``maxnreg`` caps registers per thread, default ``launch_config``'s rule, ``0`` for no
            cap); bitwise equality between layouts holds for equal knobs, and ``num_stages`` and
            ``maxnreg`` change no result at all.
        exit_ahead: alias layout only: read the exit map one tile ahead of the block-table lookup that
            uses it (default) instead of in the same iteration. Changes no value, only the schedule.
        pipe_stages: native layout only (ignored for ``alias``): ``0`` (default) runs the hand-pipelined
            loop, one K/V tile loaded ahead; ``n >= 1`` the plain loop, software-pipelined by Triton over
            ``n`` stages. Changes no value, only the schedule.
        early_kv: under PDL, start the dependent loads (metadata, page lookups, the first K/V tile without
            the key at ``row_pos``) before waiting for the previous kernel (default; module docstring) instead
            of after. Without PDL on a GPU there is no wait to start before, so it is off there; the interpreter
            runs its code (tests). Changes no value, only the schedule.
        early_trigger: under PDL, release the next kernel right after the wait whatever ``pdl.TRIGGER`` says
            (``pdl.mode``), so its programs start, and run what they do before their own wait (o_proj's weight
            prefetch), while this one runs. Changes no value, only the schedule.
        prefetch_kv: under PDL with ``early_kv``, also ask L2 for the K/V lines of up to this many tiles after a
            split's first before the wait (``prefetch.global.L2``, CUDA), so they stream in while the previous
            kernel runs (its release decides how long: qkv_rope's ``GemmConfig.early_trigger``). Changes no value.

    Raises:
        ValueError: a tensor's shape, dtype, device or contiguity breaks the contract above, an unknown
            layout, or a knob out of range (``block_n``, ``min_split_tokens``, ``max_splits``, ``maxnreg``,
            ``pipe_stages``, ``exit_ahead``, ``early_kv``, ``early_trigger``, ``prefetch_kv``).

    Returns:
        ``[N, H, D]`` in q's dtype; softmax and accumulation in float32. Head ``h`` uses kv head
        ``h // (H // Hkv)``. Keys beyond ``min(max_blocks * block_size, max_model_len)`` are never read.

    Never synchronises with the host. Under PDL (sm_90+) it reads the metadata, the block tables, the exit map
    and every key before ``row_pos`` before it waits for the kernel launched right before it, which may write
    ``q`` and the keys at ``row_pos`` only (the step's KV write does; module docstring); so all rows of one slot
    must share one ``row_pos`` (the engine runs one row per request), and what it reads before the wait must
    have been written before a full boundary earlier in the stream (kernels/pdl.py).
    """
    _validate(q, k_cache, v_cache, block_tables, row_slot, row_depth, row_pos, exit_map, row_first_alias,
              layout, tile_size)
    check_knobs(block_n=block_n, min_split_tokens=min_split_tokens, max_splits=max_splits, num_warps=num_warps,
                num_stages=num_stages, maxnreg=maxnreg, exit_ahead=exit_ahead, pipe_stages=pipe_stages,
                early_kv=early_kv, early_trigger=early_trigger, prefetch_kv=prefetch_kv)
    n, h, d = q.shape
    num_blocks, page_size, hkv, _ = k_cache.shape
    group = h // hkv
    num_planes, max_blocks = block_tables.shape[1], block_tables.shape[2]
    max_ctx = min(max_blocks * page_size, exit_map.shape[1])
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    head_dim_pad = triton.next_power_of_2(d)

    min_split_tiles = triton.cdiv(min_split_tokens, block_n)
    num_splits = max(1, min(max_splits, triton.cdiv(triton.cdiv(max_ctx, block_n), min_split_tiles)))
    out = torch.empty_like(q)
    if n == 0:
        return out
    if num_splits > 1:
        part_m = torch.empty((n, h, num_splits), device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((n, h, num_splits, head_dim_pad), device=q.device, dtype=torch.float32)
    else:
        part_m = part_l = part_acc = out     # unused by the DIRECT_OUT variant
    cfg = launch_config(d, block_n, programs=h * n * num_splits, sm_count=sm_count(q.device))
    if num_warps is not None:
        cfg["num_warps"] = num_warps
    if num_stages is not None:
        cfg["num_stages"] = num_stages
    if maxnreg is not None:
        cfg["maxnreg"] = maxnreg or None

    alias = layout == "alias"
    prefix = alias and bool(prefix_tiles)
    use_pdl = pdl.active(q)
    cfg = pdl.launch_options(use_pdl, **cfg)
    prefetch = prefetch_kv if use_pdl and early_kv else 0       # keys of the next tiles asked of L2 before the wait
    _decode_attention_split_kernel[(h, n, num_splits)](
        q, k_cache, v_cache, block_tables, row_slot, row_depth, row_pos,
        exit_map, row_first_alias, out, part_m, part_l, part_acc,
        block_tables.shape[0], num_planes, max_ctx, scale * _LOG2E, tile_size,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *exit_map.stride(),
        *out.stride(), h * num_splits, num_splits, 1,
        PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=block_n,
        MIN_SPLIT_TILES=min_split_tiles, MAX_SPLITS_PER_ROW=max_splits,
        LAYOUT_ALIAS=alias, PREFIX=prefix, MASK_ROUTED=prefix and not exit_ahead and tile_size % block_n != 0,
        EXIT_AHEAD=bool(exit_ahead), DIRECT_OUT=num_splits == 1, PDL=pdl.mode(use_pdl, early_trigger),
        PIPE_STAGES=pipe_stages, EARLY_KV=early_kv and (use_pdl or not q.is_cuda),
        PREFETCH_KV=prefetch, LINE_ELEMS=128 // q.element_size(),
        PREFETCH_CHUNK=min(256, triton.next_power_of_2(max(1, prefetch) * block_n)), **cfg)
    if num_splits > 1:
        _decode_attention_merge_kernel[(n, h)](
            part_m, part_l, part_acc, out,
            h * num_splits, num_splits, 1, *out.stride(),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad, PDL=pdl.mode(use_pdl, early_trigger),
            **pdl.launch_options(use_pdl, num_warps=4))
    return out


def key_planes_ref(block_tables: torch.Tensor, slot: int, depth: int, n_ctx: int, exit_map: torch.Tensor,
                   first_alias: int, layout: str, prefix_tiles: bool, tile_size: int) -> torch.Tensor:
    """The 1-based plane each key ``0..n_ctx-1`` of one row is read from (LAST_EXITED, BRIEF section 1)."""
    planes = torch.full((n_ctx,), depth, dtype=torch.long)
    if layout == "alias":
        e = exit_map[slot, :n_ctx].long().cpu()
        per_key = torch.arange(n_ctx) >= ((max(first_alias, 0) // tile_size) * tile_size if prefix_tiles else 0)
        # An out-of-range e_p <= 0 reads plane d (as the kernel's unsigned clamp does); valid maps never hold one.
        planes = torch.where(per_key & (e >= 1), torch.minimum(planes, e), planes)
    return planes


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, row_slot: torch.Tensor, row_depth: torch.Tensor,
                         row_pos: torch.Tensor, exit_map: torch.Tensor, row_first_alias: torch.Tensor,
                         layout: str = "native", prefix_tiles: bool = False, tile_size: int = 32,
                         scale: float | None = None) -> torch.Tensor:
    """Plain torch reference of :func:`decode_attention` (same signature and semantics).

    Gathers each row's keys into dense ``[n_ctx, Hkv, D]`` tensors and runs an fp32 softmax. Slow (a
    Python loop over rows, host syncs); for tests only. Padding rows (``row_slot < 0``) give zeros.
    """
    _validate(q, k_cache, v_cache, block_tables, row_slot, row_depth, row_pos, exit_map, row_first_alias,
              layout, tile_size)
    n, h, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = h // hkv
    num_planes = block_tables.shape[1]
    max_ctx = min(block_tables.shape[2] * page_size, exit_map.shape[1])
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.zeros((n, h, d), dtype=torch.float32, device=q.device)
    bt = block_tables.long()
    for i in range(n):
        slot = int(row_slot[i])
        if not 0 <= slot < block_tables.shape[0]:
            continue
        depth = min(max(int(row_depth[i]), 1), num_planes)
        n_ctx = min(max(int(row_pos[i]) + 1, 0), max_ctx)
        if n_ctx == 0:
            continue
        planes = key_planes_ref(block_tables, slot, depth, n_ctx, exit_map, int(row_first_alias[i]),
                                layout, prefix_tiles, tile_size).to(q.device)
        positions = torch.arange(n_ctx, device=q.device)
        blocks = bt[slot, planes - 1, positions // page_size]
        k = k_cache[blocks, positions % page_size].float()               # (T, Hkv, D)
        v = v_cache[blocks, positions % page_size].float()
        k = k.repeat_interleave(group, dim=1)                              # (T, H, D)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) * scale       # (H, T)
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", probs, v)
    return out.to(q.dtype)
