"""The qkv projection with RoPE and the KV write in its epilogue (Triton): one launch where the decode
loop runs three (projection, ``kv_write.rope_write_kv_``) today.

A program owns ``block_n`` weight rows of one head (q head ``h`` for ``h < H``, k head ``h - H`` or v head
``h - H - Hkv``) against all M rows (the swap-AB tile of kernels/gemm.py, the same K loop ``gemm._k_loop``):
with ``block_n = head_dim`` the whole head, with ``head_dim / parts`` a ``1/parts`` share of its rotary pairs,
dims ``d`` and ``d + head_dim / 2`` together, so the rotation stays inside the program and a head spreads over
``parts`` programs. After the loop it rounds the projection to the model dtype, as
:func:`gemm.gemm` would store it, and then does what ``rope_write_kv_`` does to that head, with the same
formula and the same roundings (rotate-half RoPE, RoFormer arXiv 2104.09864, in the tables' dtype):

- q and k heads are rotated by each row's position; every head is stored into ``qkv`` (so the prefill
  attention, which reads k and v from ``qkv``, and the decode attention, which reads the cache, both work);
- k and v heads are also written into the paged KV cache at (row_slot, row_depth, row_pos), with the
  skipping rules of kernels/kv_write.py (negative slot, out-of-range depth or position: nothing written).

So ``qkv_rope_write_kv(x, w, ...)`` is bitwise ``rope_write_kv_(gemm(x, w, cfg), ...)`` when the two
accumulate alike (same tiles, same K order), which tests/kernels/test_qkv_rope.py checks.
Batch invariance as in kernels/gemm.py: the tiles are fixed per weight shape; each row is its own column.
Pointer loads only (no TMA variant yet). Measured on an H200 against gemm + rope_write_kv_ and cuBLAS +
rope_write_kv_ at M 1-128: kernels/results/gemm_h200_6f19577.md (hence ``FASTER_UP_TO`` 64).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemm as gm
from . import pdl
from .kv_write import _validate_write

# Per qkv weight shape [(H + 2 Hkv) * D, K]: block_n must divide D (a program holds whole rotary pairs).
# block_n = D = 128 (48 programs for Ouro's qkv) measured (kernels/results/gemm_h200_1b4ab42.md, H200)
# 10.7-11.6 us at M = 1-32 against 12.0-12.2 for gemm + rope_write_kv_ and 12.6-13.1 for cuBLAS +
# rope_write_kv_, slower from M = 64; block_n = 64 (96 programs, two per head) raised the throughput probe
# from 3,125 to 3,181 tok/s at B16/C32 and from 4,806 to 4,912 at B32/C64 (H200, 2026-12-03, median of 2).
# At block_n 64 (kernels/results/gemm_h200_6f19577.md) it beats gemm + rope_write_kv_ up to M = 64 (10.60 vs
# 13.12 us; 14.91 vs 13.92 for cuBLAS + rope_write_kv_ at 128), hence FASTER_UP_TO 64: B64/C128 6,791 -> 7,026
# tok/s in the probe (same day, two alternating pairs).
CONFIGS: dict[tuple[int, int], gm.GemmConfig] = {
    (6144, 2048): gm.GemmConfig(block_n=64, block_k=128, split_k=1, num_stages=4, pdl=True, prefetch_tiles=1),
}
FASTER_UP_TO: dict[tuple[int, int], int] = {(6144, 2048): 64}


@triton.jit(do_not_specialize=["M", "nw_rows", "nw_cols", "nw_stride", "nw_lines"])
def _qkv_rope_write_kernel(
    x_ptr, w_ptr, qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, row_slot_ptr,
    row_depth_ptr, row_pos_ptr,
    M, K, num_slots, num_planes, max_blocks,
    stride_xm, stride_wn, stride_qm, stride_cos,
    stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btp, stride_btj,
    nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PREFETCH_K: tl.constexpr = 0, PARTS: tl.constexpr = 1, NEXT: tl.constexpr = 0,
    EARLY_EPILOGUE: tl.constexpr = True,
):
    if NEXT == gm.NEXT_EXTRA:           # an extra program: its share of a later kernel's weight into L2, nothing else
        if gm._extra_prefetch(tl.program_id(0), 0, (NUM_HEADS + 2 * NUM_KV_HEADS) * PARTS, nw_ptr, nw_rows, nw_cols,
                              nw_stride, nw_lines):
            return
    head = tl.program_id(0) // PARTS
    part = tl.program_id(0) % PARTS
    HALF: tl.constexpr = HEAD_DIM // 2
    Q: tl.constexpr = HALF // PARTS                               # rotary pairs per program
    # The program's weight rows: dims part*Q .. part*Q + Q - 1 of the head and their rotary partners HALF on.
    r = tl.arange(0, 2 * Q)
    offs_n = head * HEAD_DIM + (r // Q) * HALF + part * Q + r % Q
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]
    live = offs_m < M
    mask_n = offs_n[:, None] >= 0
    if PREFETCH_K:          # the program's weight rows: no kernel writes them (gemm.GemmConfig.prefetch_tiles)
        n_rows = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        gm._prefetch_l2(w_ptr, head * HEAD_DIM + part * Q, 0, n_rows, K, stride_wn, Q, PREFETCH_K)
        gm._prefetch_l2(w_ptr, head * HEAD_DIM + HALF + part * Q, 0, n_rows, K, stride_wn, Q, PREFETCH_K)
    if NEXT == gm.NEXT_OWN:  # a later kernel's weight (gemm.next_weight_region)
        gm._prefetch_region_l2(nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines, tl.program_id(0))
    # EARLY_EPILOGUE: the epilogue's inputs before the PDL wait, the rows' descriptors, their rotary-table rows and
    # their cache pages (the host's, constants and the host's block tables: no kernel of the step writes them,
    # kernels/pdl.py), so the dependent loads descriptor -> table run under the K loop, not after it.
    offs_d = part * Q + tl.arange(0, Q)
    rotate = head < NUM_HEADS + NUM_KV_HEADS                       # q or k head
    cached = head >= NUM_HEADS                                     # k or v head
    if EARLY_EPILOGUE:
        c, s, ok, block, in_page = _epilogue_inputs(
            cos_ptr, sin_ptr, block_tables_ptr, row_slot_ptr, row_depth_ptr, row_pos_ptr, head, offs_m, offs_d, live,
            num_slots, num_planes, max_blocks, stride_cos, stride_bts, stride_btp, stride_btj, NUM_HEADS,
            NUM_KV_HEADS, BLOCK_M, PAGE_SIZE)
    pdl.wait(PDL)
    acc = gm._k_loop(w_ptrs, x_ptrs, mask_n, live[None, :], offs_k, 0, K, tl.cdiv(K, BLOCK_K), 2 * Q, BLOCK_M,
                     BLOCK_K, EVEN, DOT_FP32)
    pdl.release(PDL)
    if not EARLY_EPILOGUE:
        c, s, ok, block, in_page = _epilogue_inputs(
            cos_ptr, sin_ptr, block_tables_ptr, row_slot_ptr, row_depth_ptr, row_pos_ptr, head, offs_m, offs_d, live,
            num_slots, num_planes, max_blocks, stride_cos, stride_bts, stride_btp, stride_btj, NUM_HEADS,
            NUM_KV_HEADS, BLOCK_M, PAGE_SIZE)
    dtype = qkv_ptr.dtype.element_ty
    halves = tl.permute(tl.reshape(acc.to(dtype), (2, Q, BLOCK_M)), (1, 2, 0))
    x1, x2 = tl.split(halves)                                     # [Q, BLOCK_M]: dims d and d + HALF
    if rotate:                                                    # q or k: rotate (fused_ops.rotate_head_)
        f1, f2 = x1.to(c.dtype), x2.to(c.dtype)
        x1, x2 = (f1 * c - f2 * s).to(dtype), (f2 * c + f1 * s).to(dtype)
    dst = qkv_ptr + offs_m[None, :].to(tl.int64) * stride_qm + head * HEAD_DIM + offs_d[:, None]
    tl.store(dst, x1, mask=live[None, :])
    tl.store(dst + HALF, x2, mask=live[None, :])
    if cached:                                                    # k or v: into the cache too
        if head < NUM_HEADS + NUM_KV_HEADS:
            kv = k_cache_ptr + block[None, :] * stride_kb + in_page[None, :] * stride_kt \
                + (head - NUM_HEADS) * stride_kh + offs_d[:, None] * stride_kd
            step = HALF * stride_kd
        else:
            kv = v_cache_ptr + block[None, :] * stride_vb + in_page[None, :] * stride_vt \
                + (head - NUM_HEADS - NUM_KV_HEADS) * stride_vh + offs_d[:, None] * stride_vd
            step = HALF * stride_vd
        tl.store(kv, x1, mask=ok[None, :])
        tl.store(kv + step, x2, mask=ok[None, :])
    if NEXT == gm.NEXT_TAIL:  # a later kernel's weight, whole rows, at the program's end (GemmConfig.prefetch_at_end)
        gm._prefetch_rows_l2(nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines, tl.program_id(0))


@triton.jit
def _epilogue_inputs(cos_ptr, sin_ptr, block_tables_ptr, row_slot_ptr, row_depth_ptr, row_pos_ptr, head, offs_m,
                     offs_d, live, num_slots, num_planes, max_blocks, stride_cos, stride_bts, stride_btp, stride_btj,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
                     PAGE_SIZE: tl.constexpr):
    """What the epilogue reads besides the product: the rotary tables at each row's position (cos, sin
    [Q, BLOCK_M], zero for a v head) and where each row's k or v goes in the cache (write mask ``ok``, block
    and in-page offset [BLOCK_M]; ``ok`` all false for a q head), with the skipping rules of kernels/kv_write.py."""
    pos = tl.load(row_pos_ptr + offs_m, mask=live, other=0)
    # per row lane (a row mask & a scalar test trips the Triton 3.9 interpreter's load)
    head_rows = tl.full([BLOCK_M], 0, tl.int32) + head
    live_rotate = live & (head_rows < NUM_HEADS + NUM_KV_HEADS)
    live_cached = live & (head_rows >= NUM_HEADS)
    table = pos[None, :].to(tl.int64) * stride_cos + offs_d[:, None]
    c = tl.load(cos_ptr + table, mask=live_rotate[None, :], other=0.0)
    s = tl.load(sin_ptr + table, mask=live_rotate[None, :], other=0.0)
    slot = tl.load(row_slot_ptr + offs_m, mask=live_cached, other=-1)
    depth = tl.load(row_depth_ptr + offs_m, mask=live_cached, other=1)
    ok = live_cached & (slot >= 0) & (slot < num_slots) & (depth >= 1) & (depth <= num_planes)
    ok = ok & (pos >= 0) & (pos < max_blocks * PAGE_SIZE)
    # skipped rows look up (slot 0, plane 1, pos 0), in bounds, and write nothing
    slot, depth, pos = tl.where(ok, slot, 0), tl.where(ok, depth, 1), tl.where(ok, pos, 0)
    block = tl.load(block_tables_ptr + slot * stride_bts + (depth - 1) * stride_btp + (pos // PAGE_SIZE) * stride_btj,
                    mask=ok, other=0).to(tl.int64)
    return c, s, ok, block, pos % PAGE_SIZE


def check_config(config: gm.GemmConfig, head_dim: int) -> None:
    """ValueError unless ``config`` can run :func:`qkv_rope_write_kv` on heads of ``head_dim``: block_n dividing
    head_dim (a program holds whole rotary pairs), split_k 1 (RoPE needs the whole sum) and no tma."""
    if head_dim % config.block_n or config.split_k != 1 or config.tma:
        raise ValueError(f"qkv_rope_write_kv needs block_n dividing head_dim ({head_dim}), split_k 1 and no tma, "
                         f"got {config}")


def qkv_rope_write_kv(x: torch.Tensor, w_qkv: torch.Tensor, config: gm.GemmConfig, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      row_slot: torch.Tensor, row_depth: torch.Tensor, row_pos: torch.Tensor,
                      num_heads: int, next_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``rope_write_kv_(x @ w_qkv.T, ...)`` in one launch; never synchronises with the host.

    Args:
        x: ``[M, K]`` bf16/fp16 (1 <= M <= 128), unit stride along K. w_qkv: ``[(H + 2 Hkv) * D, K]`` (q, k,
            v heads; the model's fused ``qkv`` weight), x's dtype. config: a :class:`gemm.GemmConfig` with
            ``block_n`` dividing D (``D / block_n`` programs per head), ``split_k == 1`` and no ``tma``.
        cos, sin, k_cache, v_cache, block_tables, row_slot, row_depth, row_pos, num_heads: as for
            ``kv_write.rope_write_kv_`` (one layer's cache ``[num_blocks, block_size, Hkv, D]``; int32 rows).
        next_weight: a later kernel's weight (or its first columns) for the programs to bring into L2 before
            their PDL wait, as for :func:`gemm.gemm`.

    Returns:
        qkv ``[M, (H + 2 Hkv) * D]`` in x's dtype, q and k rotated. Raises ValueError/TypeError naming the
        bad argument (the checks of :func:`gemm.gemm` and ``rope_write_kv_``, and the config's).
    """
    gm._validate(x, w_qkv, config)
    _, page_size, hkv, d = k_cache.shape
    check_config(config, d)
    m, k = x.shape
    if w_qkv.shape[0] != (num_heads + 2 * hkv) * d:
        raise ValueError(f"w_qkv must have (H + 2 Hkv) * D = {(num_heads + 2 * hkv) * d} rows, got {w_qkv.shape[0]}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d // 2 or not cos.is_contiguous():
        raise ValueError(f"cos/sin must be contiguous [max_len, {d // 2}], got {tuple(cos.shape)}")
    qkv = torch.empty((m, w_qkv.shape[0]), device=x.device, dtype=x.dtype)
    kv_view = qkv[:, num_heads * d:].view(m, 2, hkv, d)
    _validate_write(k_cache, v_cache, kv_view[:, 0], kv_view[:, 1], block_tables, row_slot, row_depth, row_pos)
    c = config
    block_m = max(16, triton.next_power_of_2(m))
    use_pdl = c.pdl and pdl.active(x)
    launch = pdl.launch_options(use_pdl, num_warps=c.num_warps,
                                num_stages=gm.num_stages_that_fit(c, block_m, x.device, elem_bytes=x.element_size()))
    parts = d // c.block_n
    programs = (num_heads + 2 * hkv) * parts
    grid, region, next_mode = gm.next_weight_launch(next_weight, x, programs, 1, c.prefetch_programs, use_pdl,
                                                    c.prefetch_at_end)
    _qkv_rope_write_kernel[grid[:1]](
        x, w_qkv, qkv, cos, sin, k_cache, v_cache, block_tables, row_slot, row_depth, row_pos,
        m, k, *block_tables.shape, x.stride(0), w_qkv.stride(0), qkv.stride(0), cos.stride(0),
        *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *region,
        NUM_HEADS=num_heads, NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_M=block_m,
        BLOCK_K=c.block_k, EVEN=k % c.block_k == 0, DOT_FP32=not x.is_cuda, PDL=pdl.mode(use_pdl, c.early_trigger),
        PAGE_SIZE=page_size,
        PREFETCH_K=gm.prefetch_elements(c, k, use_pdl, x.element_size()), PARTS=parts, NEXT=next_mode,
        EARLY_EPILOGUE=c.early_epilogue, **launch)
    return qkv
