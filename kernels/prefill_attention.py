"""Causal prefill attention: one prompt (SDPA wrapper) and packed prompts (Triton, varlen).

Prefill sees the whole prompt in every loop, so its K/V never need decode's paged, depth-planed lookup:
the caller attends over the dense K/V it just computed and writes them into the cache separately
(``kv_write.write_kv``).

- :func:`prefill_attention` runs one prompt ``[T, H, D]`` through
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` (FlashAttention / cuDNN /
  memory-efficient kernels on CUDA, a fused kernel on CPU).
- :func:`packed_prefill_attention` runs every prompt admitted in one step in ONE launch: the prompts lie
  back to back in ``[N, H, D]`` tensors (``N`` may be a padded bucket), and a small int32 table of query
  tiles (:func:`prefill_tiles`) says which rows belong to which prompt. Each row attends causally within
  its own prompt; rows past the last tile come out as zeros, written by the same launch. The launch reads
  the table only on the device, so the call can be captured once in a CUDA graph (grid fixed by
  :func:`max_prefill_tiles` and the bucket size) and replayed with new prompts.

Packed kernel (FlashAttention-2, Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism
and Work Partitioning"): one program per (query tile, head), ``BLOCK_M`` query rows against ``BLOCK_N``
keys per step, ``tl.dot`` for ``QK^T`` and ``PV`` (tensor cores), online softmax (Milakov & Gimelshein
2018) in fp32 with ``exp2``. Key blocks that lie wholly below the tile's first row run unmasked; only
the last blocks, which meet the causal diagonal, are masked. ``scale * log2(e)`` is applied to the fp32
scores inside the ``s * c - m`` expression (one fused multiply-add), which costs the same as folding it
into q and avoids rounding a scaled q back to bf16 before the dot.

Batch invariance: a tile's work is fixed by its rows relative to the prompt start (tiles start at
``k * block_m``, key blocks at the prompt start, in one order), and every program runs the same code on
it, so a prompt's output is bitwise identical whether it runs alone or packed at any offset with any
neighbours (tests/kernels/test_prefill.py holds this). Grouped-query heads: head ``h`` uses kv head
``h // (H // Hkv)``.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Launch defaults for the H200 (Hopper, bf16, D=128); kernels/bench/prefill_attention.py --tune times
# alternatives. BLOCK_M 128 with 8 warps gives two warpgroups of 64 rows each for wgmma.
DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 64
DEFAULT_NUM_WARPS = 8
DEFAULT_NUM_STAGES = 3
BACKENDS = ("auto", "triton", "torch")

_LOG2E = 1.4426950408889634


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [T, heads, D], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on T and D")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """Causal self-attention of one prompt: query ``t`` sees keys ``0..t``.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, Hkv, D]``; one float dtype, one device.
        scale: softmax scale, default ``1/sqrt(D)``.

    Returns:
        ``[T, H, D]`` in q's dtype (SDPA's internal accumulation, fp32 on every backend).
    """
    _validate(q, k, v)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=scale)    # (H, T, D)
    return out.transpose(0, 1).contiguous()


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """Explicit fp32 softmax reference of :func:`prefill_attention` (tests only)."""
    _validate(q, k, v)
    t, h, d = q.shape
    group = h // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale         # (H, T, T)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf).to(q.dtype)


# ---------------------------------------------------------------------------------------------------------
# Packed (varlen) prefill: the tile table, the Triton kernel, the torch fallback and the reference.


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    return int(value)


def _check_seq_lens(seq_lens) -> np.ndarray:
    if isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, (Sequence, np.ndarray)):
        raise TypeError(f"seq_lens must be a sequence of ints, got {type(seq_lens).__name__}")
    for n in seq_lens:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"seq_lens must hold ints, got {n!r} ({type(n).__name__})")
        if n <= 0:
            raise ValueError(f"seq_lens must be positive, got {n}")
    return np.asarray(seq_lens, dtype=np.int64).reshape(-1)


def max_prefill_tiles(total_tokens: int, num_seqs: int, block_m: int) -> int:
    """Upper bound on the tiles of any packing of ``num_seqs`` prompts into ``total_tokens`` rows.

    Each prompt of ``L`` rows has ``ceil(L / block_m) <= L / block_m + 1`` tiles, so the sum is at most
    ``ceil(total_tokens / block_m) + num_seqs``: a CUDA graph keyed by the padded token count can fix its
    grid at this many tiles. Raises ValueError for a negative count or a bad ``block_m``.
    """
    block_m = _check_block("block_m", block_m)
    for name, value in (("total_tokens", total_tokens), ("num_seqs", num_seqs)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return -(-int(total_tokens) // block_m) + int(num_seqs)


def prefill_tiles(seq_lens, *, block_m: int, num_tiles: int | None = None) -> np.ndarray:
    """Query tiles of prompts packed back to back: ``int32 [3, num_tiles]`` rows (seq_start, q_start, q_end).

    Prompt ``i`` occupies packed rows ``offset_i .. offset_i + seq_lens[i] - 1`` (``offset_i`` the sum of
    the lengths before it). Its tiles start at ``offset_i + j * block_m`` and hold at most ``block_m`` rows,
    so how a prompt is cut depends only on its own length. Tiles follow prompt order; unused trailing tiles
    are ``(0, 0, 0)``, which the kernel skips.

    Args:
        seq_lens: positive ints, one per prompt (may be empty).
        block_m: rows per tile, a power of two >= 16; pass the same value to the kernel.
        num_tiles: columns of the table (e.g. :func:`max_prefill_tiles` for a CUDA-graph bucket); None
            gives exactly as many as needed.

    Raises:
        TypeError / ValueError: bad ``seq_lens`` or ``block_m``; ``num_tiles`` smaller than needed.
    """
    lens = _check_seq_lens(seq_lens)
    block_m = _check_block("block_m", block_m)
    per_seq = -(-lens // block_m)                                          # tiles of each prompt
    needed = int(per_seq.sum())
    if num_tiles is None:
        num_tiles = needed
    elif isinstance(num_tiles, bool) or not isinstance(num_tiles, (int, np.integer)):
        raise TypeError(f"num_tiles must be an int or None, got {type(num_tiles).__name__}")
    elif num_tiles < needed:
        raise ValueError(f"num_tiles={num_tiles} is too small: {len(lens)} prompts of {int(lens.sum())} "
                         f"tokens need {needed} tiles of block_m={block_m}")
    offsets = np.cumsum(lens) - lens
    seq = np.repeat(np.arange(len(lens)), per_seq)                         # prompt of each tile
    first_tile = np.cumsum(per_seq) - per_seq
    q_start = offsets[seq] + (np.arange(needed) - first_tile[seq]) * block_m
    tiles = np.zeros((3, int(num_tiles)), dtype=np.int32)
    tiles[0, :needed] = offsets[seq]
    tiles[1, :needed] = q_start
    tiles[2, :needed] = np.minimum(q_start + block_m, (offsets + lens)[seq])
    return tiles


@triton.jit
def _load_2d(ptrs, rows_ok, cols_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A 2-D tile; masked lanes read 0. Masks are chosen at compile time, so key blocks below the
    diagonal and power-of-two head dims issue plain loads."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _attend_block(q, k_seq, v_seq, key0, offs_m, offs_n, offs_d, n_keys, m_i, l_i, acc, qk_scale_log2,
                  stride_kn, stride_kd, stride_vn, stride_vd,
                  CAUSAL: tl.constexpr, MASK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """One ``BLOCK_N``-key step of the online softmax for ``BLOCK_M`` query rows. Rows and keys are
    relative to the prompt start; ``CAUSAL`` masks keys past each row (and past ``n_keys`` in the load)."""
    keys = key0 + offs_n
    kv_ok = keys < n_keys
    d_ok = offs_d < HEAD_DIM
    k = _load_2d(k_seq + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd, kv_ok, d_ok, CAUSAL, MASK_D)
    v = _load_2d(v_seq + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd, kv_ok, d_ok, CAUSAL, MASK_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)               # (M, N) fp32, unscaled
    if CAUSAL:
        s = tl.where(keys[None, :] <= offs_m[:, None], s, float("-inf"))
    # Every row has a finite score in its first block (key 0 is below every row), so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    p = tl.exp2(s * qk_scale_log2 - m_new[:, None])                         # log2 units
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _zero_tail(out_ptr, tiles_ptr, chunk, head, num_tiles, num_rows, stride_on, stride_oh, stride_od,
               stride_tt, stride_ti, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
               SCAN: tl.constexpr):
    """Zeros of rows ``chunk * BLOCK_M ..`` of ``head`` that lie at or past the largest tile end
    (the table's ``q_end`` row is read ``SCAN`` entries at a time).

    The table (a few hundred int32, from L2) is scanned on the device, so the padding of a bucket is
    known without the host; writing only those rows spares a memset of the whole output."""
    ends = tiles_ptr + 2 * stride_tt
    covered = tl.zeros([SCAN], tl.int32)
    for first in range(0, num_tiles, SCAN):
        offs = first + tl.arange(0, SCAN)
        covered = tl.maximum(covered, tl.load(ends + offs * stride_ti, mask=offs < num_tiles, other=0))
    covered_end = tl.minimum(tl.max(covered, 0), num_rows)
    rows = chunk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = ((rows >= covered_end) & (rows < num_rows))[:, None] & (offs_d < HEAD_DIM)[None, :]
    ptrs = out_ptr + head * stride_oh + rows.to(tl.int64)[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(ptrs, tl.zeros([BLOCK_M, HEAD_DIM_PAD], out_ptr.dtype.element_ty), mask=mask)


# The table's width and the bucket size change per graph: not specialised on, so no recompiles.
@triton.jit(do_not_specialize=["num_tiles", "num_rows", "stride_tt", "stride_ti"])
def _packed_prefill_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, out_ptr, tiles_ptr,
    # sizes
    num_tiles, num_rows, qk_scale_log2,
    # strides
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    stride_tt, stride_ti,
    # meta
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(1)
    if tl.program_id(0) >= num_tiles:       # the programs after the table's write the padding rows' zeros
        _zero_tail(out_ptr, tiles_ptr, tl.program_id(0) - num_tiles, head, num_tiles, num_rows,
                   stride_on, stride_oh, stride_od, stride_tt, stride_ti, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, 256)
        return
    # A prompt's later tiles see more keys; running the table back to front starts the long ones first.
    tile = num_tiles - 1 - tl.program_id(0)
    seq_start = tl.load(tiles_ptr + tile * stride_ti)
    q_start = tl.load(tiles_ptr + stride_tt + tile * stride_ti)
    q_end = tl.load(tiles_ptr + 2 * stride_tt + tile * stride_ti)
    # Clamped so that a malformed table cannot read or write outside the tensors.
    seq_start = tl.minimum(tl.maximum(seq_start, 0), num_rows)
    q_start = tl.minimum(tl.maximum(q_start, seq_start), num_rows)
    q_end = tl.minimum(tl.minimum(q_end, q_start + BLOCK_M), num_rows)
    if q_end <= q_start:
        return

    # From here on rows and keys count from the prompt start: the arithmetic of a tile does not depend
    # on where its prompt was packed.
    first_row = q_start - seq_start
    n_keys = q_end - seq_start                                              # the tile's last row + 1
    kv_head = head // GROUP
    base = seq_start.to(tl.int64)
    q_seq = q_ptr + base * stride_qn + head * stride_qh
    k_seq = k_ptr + base * stride_kn + kv_head * stride_kh
    v_seq = v_ptr + base * stride_vn + kv_head * stride_vh
    o_seq = out_ptr + base * stride_on + head * stride_oh
    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    rows_ok = offs_m < n_keys
    d_ok = offs_d < HEAD_DIM
    q = _load_2d(q_seq + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, rows_ok, d_ok, True, MASK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Key blocks wholly at or below the tile's first row need no mask; the rest meet the diagonal.
    full_end = (first_row + 1) // BLOCK_N * BLOCK_N
    for key0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_seq, v_seq, key0, offs_m, offs_n, offs_d, n_keys, m_i, l_i, acc,
                                      qk_scale_log2, stride_kn, stride_kd, stride_vn, stride_vd,
                                      False, MASK_D, HEAD_DIM, DOT_PRECISION)
    for key0 in range(full_end, n_keys, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_seq, v_seq, key0, offs_m, offs_n, offs_d, n_keys, m_i, l_i, acc,
                                      qk_scale_log2, stride_kn, stride_kd, stride_vn, stride_vd,
                                      True, MASK_D, HEAD_DIM, DOT_PRECISION)
    out = acc / l_i[:, None]
    out_ptrs = o_seq + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & d_ok[None, :])


def _validate_packed(q, k, v, tiles, block_m, block_n, scale) -> float:
    """Checks shapes, dtypes and devices (never the table's values: that would read the device)."""
    _validate(q, k, v)
    if q.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q dtype must be float64, float32, bfloat16 or float16, got {q.dtype}")
    if not isinstance(tiles, torch.Tensor):
        raise TypeError(f"tiles must be a torch.Tensor, got {type(tiles).__name__}")
    if tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[0] != 3:
        raise ValueError(f"tiles must be int32 [3, num_tiles], got {tiles.dtype} {tuple(tiles.shape)}")
    devices = {t.device for t in (q, k, v, tiles)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v and tiles must be on one device, got {sorted(map(str, devices))}")
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return float(scale)


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    return out


def _packed_prefill_torch(q, k, v, tiles, block_m: int, scale: float) -> torch.Tensor:
    """Tile by tile in torch, fp32 softmax (fp64 for fp64); reads the table on the host (syncs). Same
    clamps as the kernel."""
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for seq_start, q_start, q_end in tiles.cpu().t().tolist():
        seq_start = min(max(seq_start, 0), n)
        q_start = min(max(q_start, seq_start), n)
        q_end = min(q_end, q_start + block_m, n)
        if q_end <= q_start:
            continue
        kf = k[seq_start:q_end].to(acc).repeat_interleave(group, dim=1)
        vf = v[seq_start:q_end].to(acc).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].to(acc), kf) * scale
        rows = torch.arange(q_start, q_end, device=q.device)[:, None]
        keys = torch.arange(seq_start, q_end, device=q.device)[None, :]
        scores = scores.masked_fill(keys > rows, float("-inf"))
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf).to(q.dtype)
    return out


def packed_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: torch.Tensor, *,
                             block_m: int, scale: float | None = None, backend: str = "auto",
                             block_n: int = DEFAULT_BLOCK_N, num_warps: int = DEFAULT_NUM_WARPS,
                             num_stages: int = DEFAULT_NUM_STAGES, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of prompts packed back to back, each attending only within itself.

    Args:
        q: ``[N, H, D]``; k, v: ``[N, Hkv, D]``; one of float32/bfloat16/float16 (float64 with the torch
            backend), one device. ``N`` may be
            a padded bucket; H a multiple of Hkv (head ``h`` uses kv head ``h // (H // Hkv)``).
        tiles: ``int32 [3, num_tiles]`` on q's device, as :func:`prefill_tiles` makes with this
            ``block_m``: query row ``t`` of the tile ``(seq_start, q_start, q_end)`` sees keys
            ``seq_start..t``. Entries are clamped into ``[0, N]`` and tiles to ``block_m`` rows.
        block_m: rows per tile, a power of two >= 16 (``DEFAULT_BLOCK_M`` suits the H200).
        scale: softmax scale, positive; default ``1/sqrt(D)``.
        backend: ``"triton"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``: float32 only, the
            interpreter's bf16 ``tl.dot`` is wrong), ``"torch"`` (tile by tile, reads ``tiles`` on the host)
            or ``"auto"`` (triton on CUDA, torch elsewhere).
        block_n, num_warps, num_stages: kernel tuning knobs (benchmarks); a prompt's output is bitwise
            the same alone or packed for equal knobs.
        out: optional ``[N, H, D]`` buffer of q's dtype and device to write into (e.g. a graph's static
            output); by default a new tensor.

    Returns:
        ``out``: ``[N, H, D]`` in q's dtype, softmax and accumulation in float32. Rows at or past the
        largest ``q_end`` of the table (a padded bucket's tail) are 0; the triton backend leaves rows
        before it that no tile covers unwritten (a :func:`prefill_tiles` table leaves none), the torch
        backend zeroes them.

    The triton backend is one launch and never synchronises with the host (it reads the table on the
    device, zeros included), so the call can be captured in a CUDA graph and replayed with new tiles and
    data. Raises TypeError / ValueError for bad shapes, dtypes, devices, block sizes, scale or backend.
    """
    scale = _validate_packed(q, k, v, tiles, block_m, block_n, scale)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    out = _check_out(out, q)
    if backend == "torch":
        return out.copy_(_packed_prefill_torch(q, k, v, tiles, block_m, scale))
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' on {q.device} tensors needs TRITON_INTERPRET=1")
    if q.dtype == torch.float64:
        raise ValueError("backend='triton' takes float32/bfloat16/float16; float64 (the CPU reference "
                         "engine's dtype) needs backend='torch'")
    n, h, d = q.shape
    num_tiles = tiles.shape[1]
    head_dim_pad = max(16, triton.next_power_of_2(d))                       # tl.dot needs K >= 16
    if n == 0:
        return out
    # After the table's programs, one per block_m rows writes the zeros of the rows past the last tile.
    _packed_prefill_kernel[(num_tiles + triton.cdiv(n, block_m), h)](
        q, k, v, out, tiles,
        num_tiles, n, scale * _LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *tiles.stride(),
        GROUP=h // k.shape[1], HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad, MASK_D=head_dim_pad != d,
        BLOCK_M=block_m, BLOCK_N=_check_block("block_n", block_n),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    return out


def packed_prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens,
                                 scale: float | None = None) -> torch.Tensor:
    """:func:`prefill_attention_ref` of each prompt of ``seq_lens``, packed; rows after the last are 0
    (tests only). Shapes as in :func:`packed_prefill_attention`; raises ValueError if the prompts need
    more than ``N`` rows."""
    _validate(q, k, v)
    lens = _check_seq_lens(seq_lens)
    if lens.sum() > q.shape[0]:
        raise ValueError(f"seq_lens sum to {int(lens.sum())} rows but q has {q.shape[0]}")
    out = torch.zeros_like(q)
    start = 0
    for n in lens.tolist():
        out[start:start + n] = prefill_attention_ref(q[start:start + n], k[start:start + n],
                                                     v[start:start + n], scale)
        start += n
    return out
