"""Small-M projection GEMM for the decode loop (Triton): ``x @ weight.T`` with the weight as the MMA's
wide side, split-K partials for fused consumers, and programmatic dependent launch.

At decode batch sizes (M = max_num_seqs = 1..128 rows) a projection reads its whole weight once and does
little arithmetic with it, so it is bound by weight bandwidth. Three choices make it faster than cuBLAS
on Ouro's projections (kernels/results/gemm_h200_1b4ab42.md, graph-chain timing on an H200):

- **Swap AB.** A program computes the transposed tile ``out.T[BLOCK_N, BLOCK_M] = w[BLOCK_N, :] @
  x[BLOCK_M, :].T``: the weight tile (64-128 rows) is the MMA's M side, which Hopper's warpgroup MMA
  needs to be >= 64, and the batch (16-128 rows, padded to a power of two) is its N side, which may be as
  small as 8. Every weight byte is read once, by one program. (The usual small-batch GEMM trick, e.g.
  TensorRT-LLM's and CUTLASS's "swap AB" small-M kernels.)
- **Split-K without atomics.** Where N alone gives too few programs to fill 132 SMs (o_proj and down:
  32 column tiles), split ``s`` of ``split_k`` owns a fixed contiguous range of K tiles and writes fp32
  partials ``[split_k, M, N]``; the consumer (``fused_ops.add_rms_norm``, or :func:`reduce_partials`)
  adds them in split order 0, 1, ... and rounds once. CUTLASS's "parallel split-K".
- **TMA loads** (``tma``): the tiles come through Hopper's tensor memory accelerator from host-built
  ``TensorDescriptor`` s, fewer instructions per byte than per-thread pointer loads.
- **PDL** (``pdl``): the kernel is launched with CUDA's programmatic stream serialization, waits for the
  previous kernel's results with ``griddepcontrol.wait`` right before its K loop and releases its own
  dependents (``griddepcontrol.launch_dependents``) after it (or right after the wait: ``pdl.TRIGGER``), so
  a launch and the next kernel's start overlap the previous kernel's tail (CUDA C++ Programming Guide,
  "Programmatic Dependent Launch and Synchronization"). Nothing is read or written before the wait except
  the weight, which no kernel of the loop writes. Under a CUDA graph capture the dependency becomes a
  programmatic graph edge. A config's ``pdl`` is honoured where kernels/pdl.py's ``active`` allows it (its
  switch, sm_90+ NVIDIA).

Batch invariance: the configuration is a function of the weight shape ``(N, K)`` only (``config_for``;
M only decides whether it runs at all, see ``FASTER_UP_TO``), so the K split, the K tile order and the
tiles are fixed per weight; M only sets ``BLOCK_M`` (its power of two) and the row mask, and row ``i``
of the result is computed from row ``i`` of ``x`` alone (padding rows load as zero and are never
stored). A batch-invariant engine also runs every decode step on max_num_seqs rows, so within one
engine M never changes. tests/kernels/test_gemm.py checks on CUDA that the first M rows of the M=128
result equal the M-row result for every graph bucket.

Interpreter: the Triton interpreter computes a bf16 ``tl.dot`` wrongly (BRIEF section 4), so on CPU
tensors (``TRITON_INTERPRET=1`` only) ``DOT_FP32`` upcasts both tiles to fp32 with an IEEE dot; TMA and
PDL are CUDA-only and off there.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl

DTYPES = (torch.bfloat16, torch.float16)
MAX_M = 128                     # largest batch measured; more rows go to cuBLAS (config_for returns None)
# The kernels' NEXT constexpr: who brings a later kernel's weight region into L2 (next_weight_region).
NEXT_OWN = tl.constexpr(1)      # every program its share, before its PDL wait
NEXT_EXTRA = tl.constexpr(2)    # GemmConfig.prefetch_programs extra programs, and only they
NEXT_TAIL = tl.constexpr(3)     # every program its share of whole rows, at its end (GemmConfig.prefetch_at_end)


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of :func:`gemm` for one weight shape (never per M: batch invariance).

    ``block_n`` / ``block_k``: weight rows and K elements per tile (powers of two; ``block_n`` >= 64 for
    Hopper's warpgroup MMA); ``split_k``: contiguous K ranges with their own fp32 partials; ``num_stages``
    / ``num_warps``: software pipelining and warps (change no bit); ``tma``: descriptor loads (CUDA);
    ``pdl``: programmatic dependent launch (CUDA); ``prefetch_tiles``: with PDL, how many of a program's
    first K tiles of weight it prefetches into L2 before it waits for the previous kernel (none, or fewer
    where its K range is shorter; changes no bit); ``early_epilogue``: kernels/qkv_rope.py only, load the
    epilogue's descriptors, rotary-table rows and cache pages before the PDL wait rather than after the K loop
    (changes no bit; the other kernels have no such inputs and ignore it); ``early_trigger``: with PDL, release
    the next kernel right after the wait whatever ``pdl.TRIGGER`` says, so its programs start (and run what
    they do before their own wait) during this kernel's K loop (changes no bit); ``prefetch_programs``: where
    the launch brings a later kernel's weight into L2 (``next_weight``, PDL on), that many extra programs beside
    the grid do it and nothing else (rounded up to a multiple of ``split_k``), on SMs the grid leaves idle, instead
    of every program before its wait (0; changes no bit). It needs a ``next_weight``: a launch without one
    refuses it (:func:`next_weight_launch`), as the model does a plan without that projection's region
    (runtime/model.py ``check_prefetch_programs``). ``prefetch_at_end``: where the launch brings a later kernel's
    weight into L2, every program asks for its share at its end, after its stores, rather than before its wait, one
    bulk prefetch a row of the region (:data:`NEXT_TAIL`): the programs that finish first fill the launch's tail,
    and the rest the gap before the next weight stream (a norm or attention kernel between; changes no bit).
    Not with ``prefetch_programs`` (ValueError). Off in every configuration: 0.96-0.97x tok/s in the decode loop
    (H100, B16), and a prefetched region is mostly not in L2 when read (kernels/results/README.md).
    """
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_stages: int = 4
    num_warps: int = 4
    tma: bool = False
    pdl: bool = False
    prefetch_tiles: int = 0
    early_epilogue: bool = True
    early_trigger: bool = False
    prefetch_programs: int = 0
    prefetch_at_end: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {v!r}")
        for name in ("split_k", "num_stages", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GemmConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("prefetch_tiles", "prefetch_programs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"GemmConfig.{name} must be an int >= 0, got {v!r}")
        for name in ("tma", "pdl", "early_epilogue", "early_trigger", "prefetch_at_end"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GemmConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.prefetch_at_end and self.prefetch_programs:
            raise ValueError(f"GemmConfig.prefetch_at_end needs prefetch_programs=0 (its programs prefetch at their "
                             f"end, extra programs at the launch's start), got {self.prefetch_programs}")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"GemmConfig.num_warps must be a power of two, got {self.num_warps!r}")


# Measured on an H200 (kernels/results/gemm_sweep_h200_84accc2.md; graph chains over >= 256 MB of distinct
# weights, M = 16 and 32): the fastest configuration per Ouro-1.4B projection, ``(N, K)`` of the weight. Shapes
# not listed run on cuBLAS, which is what "use whichever is faster per shape" means for unmeasured ones.
CONFIGS: dict[tuple[int, int], GemmConfig] = {
    # prefetch_tiles=1 for every shape: one K tile of weight per program into L2 before the PDL wait, measured
    # in the decode loop (throughput probe, H200: B16 2,963 -> 3,017 tok/s, B32 4,602 -> 4,661; 2 and 4 tiles
    # no faster; results/README.md, profiles 2026-12-02-be3b017).
    (6144, 2048): GemmConfig(block_n=64, block_k=256, split_k=1, num_stages=4, tma=True, pdl=True,    # qkv
                             prefetch_tiles=1),
    (2048, 2048): GemmConfig(block_n=64, block_k=128, split_k=4, num_stages=4, pdl=True,              # o_proj
                             prefetch_tiles=1),
    (11264, 2048): GemmConfig(block_n=64, block_k=128, split_k=1, num_stages=4, tma=True, pdl=True,   # gate_up
                              prefetch_tiles=1),
    (2048, 5632): GemmConfig(block_n=64, block_k=128, split_k=4, num_stages=4, pdl=True,              # down
                             prefetch_tiles=1),
    (49152, 2048): GemmConfig(block_n=64, block_k=128, split_k=1, num_stages=4, tma=True, pdl=True,   # lm_head
                              prefetch_tiles=1),
}

# The largest M (of 1, 16, 32, 64, 128) at which each configuration above beat cuBLAS in the M = 1..128
# table (kernels/results/gemm_h200_1b4ab42.md, H200); at more rows the shape runs on cuBLAS. o_proj and
# down count their partials' sum, which add_rms_norm reads, as free; their margins (1.07x, 1.19x at 128)
# exceed what reading them costs there. Under batch invariance an engine's decode runs every step on
# max_num_seqs rows, so the choice is one per engine and never changes between its steps.
FASTER_UP_TO: dict[tuple[int, int], int] = {
    (6144, 2048): 64, (2048, 2048): 128, (11264, 2048): 32, (2048, 5632): 128, (49152, 2048): 32,
}

# gemm_swiglu per gate_up weight shape [2 I, K]; block_n counts gate rows. Measured (same table): n64 TMA
# 14.9-15.6 us at M = 16-64 against 16.3-18.7 for n32 and 17.0-18.9 for cuBLAS + silu_mul; even at M 128.
# The pointer kernel with gate and up rows in one tile (176 programs at n32, 352 at n16) did not beat it in
# the decode loop (throughput probe, H200, 2026-12-03, median of 2, B16 / B32 tok/s: n64 TMA 3,190 / 4,920,
# n32 3,171 / 4,897, n16 3,087 / 4,693).
# early_trigger: down, next, runs on kernels/wgmma_gemm.py, whose programs copy their first weight tiles into shared
# memory before their PDL wait, so releasing them early lets them fill gate_up's tail (kernels/wgmma_gemm.py CONFIGS).
SWIGLU_CONFIGS: dict[tuple[int, int], GemmConfig] = {
    (11264, 2048): GemmConfig(block_n=64, block_k=128, split_k=1, num_stages=4, tma=True, pdl=True,
                              prefetch_tiles=1, early_trigger=True),
}
SWIGLU_FASTER_UP_TO: dict[tuple[int, int], int] = {(11264, 2048): 64}


def config_for(n: int, k: int, m: int, configs: dict | None = None, faster_up_to: dict | None = None
               ) -> GemmConfig | None:
    """The measured configuration for an ``[n, k]`` weight at ``m`` rows, or None (use cuBLAS): ``configs``
    (default :data:`CONFIGS`) holds it if ``m`` is at most ``faster_up_to[(n, k)]`` (default
    :data:`FASTER_UP_TO`) and :data:`MAX_M`."""
    configs = CONFIGS if configs is None else configs
    faster_up_to = FASTER_UP_TO if faster_up_to is None else faster_up_to
    if m > min(MAX_M, faster_up_to.get((n, k), 0)):
        return None
    return configs.get((n, k))


@triton.jit(do_not_specialize=["M", "nw_rows", "nw_cols", "nw_stride", "nw_lines"])
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, tiles_per_split, stride_xm, stride_wn, stride_om, stride_os,
                 nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines, tmax_ptr, targ_ptr,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                 DOT_FP32: tl.constexpr, PDL: tl.constexpr, GLU: tl.constexpr = False,
                 PREFETCH_K: tl.constexpr = 0, NEXT: tl.constexpr = 0, ARGMAX: tl.constexpr = False,
                 STORE: tl.constexpr = True):
    """Pointer loads. Program (n tile, split): out[split, m, n] = sum over its K tiles of x[m, k] w[n, k].
    GLU: w is [2 N, K] (gate rows, then up rows) and out[m, n] = silu(gate) * up (:func:`gemm_swiglu`); a
    tile holds the program's BLOCK_N gate rows and their BLOCK_N up rows, one 2 BLOCK_N-row product per K tile
    (so BLOCK_N 32 still feeds Hopper's 64-row warpgroup MMA).
    PREFETCH_K: weight elements per row brought into L2 before the PDL wait (0: none). NEXT (:data:`NEXT_OWN`):
    bring this program's ``nw_lines`` 128-byte lines of the region ``nw_*`` (a later kernel's weight,
    :func:`_prefetch_region_l2`) into L2 before the wait; :data:`NEXT_EXTRA`: only the programs past the column
    tiles do, and nothing else (:func:`_extra_prefetch`). ARGMAX (split_k 1): also each row's largest rounded
    value of this program's columns and its first column (:func:`_tile_argmax`); STORE: write the product."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    if NEXT == NEXT_EXTRA:
        if _extra_prefetch(pid_n, split, tl.cdiv(N, BLOCK_N), nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines):
            return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GLU:
        r = tl.arange(0, 2 * BLOCK_N)
        cols = pid_n * BLOCK_N + r % BLOCK_N
        rows = (r // BLOCK_N) * N + cols                                 # gate rows, then the same up rows
        mask_n = cols[:, None] < N
    else:
        rows = offs_n
        mask_n = offs_n[:, None] < N
    w_ptrs, x_ptrs, offs_m, offs_k, mask_m, k0, num_tiles = _split_operands(
        x_ptr, w_ptr, rows, split, M, K, tiles_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_K)
    if PREFETCH_K:
        _prefetch_l2(w_ptr, pid_n * BLOCK_N, k0, N, K, stride_wn, BLOCK_N, PREFETCH_K)
        if GLU:
            _prefetch_l2(w_ptr + N.to(tl.int64) * stride_wn, pid_n * BLOCK_N, k0, N, K, stride_wn, BLOCK_N, PREFETCH_K)
    if NEXT == NEXT_OWN:
        _prefetch_region_l2(nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines, pid_n + split * tl.num_programs(0))
    pdl.wait(PDL)
    acc = _k_loop(w_ptrs, x_ptrs, mask_n, mask_m, offs_k, k0, K, num_tiles, (1 + GLU) * BLOCK_N, BLOCK_M,
                  BLOCK_K, EVEN, DOT_FP32)
    pdl.release(PDL)
    if GLU:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        acc = _swiglu(gate, up, out_ptr.dtype.element_ty)
    if ARGMAX:
        _tile_argmax(acc.to(out_ptr.dtype.element_ty), offs_n, offs_m, N, M, pid_n, tmax_ptr, targ_ptr)
    if STORE:
        out = out_ptr + split.to(tl.int64) * stride_os + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m & (offs_n[:, None] < N))
    if NEXT == NEXT_TAIL:
        _prefetch_rows_l2(nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines, pid_n + split * tl.num_programs(0))


@triton.jit
def _tile_argmax(vals, offs_n, offs_m, N, M, tile, tmax_ptr, targ_ptr):
    """Greedy sampling's first pass over one program's tile of logits ``vals`` [BLOCK_N, BLOCK_M] (rounded to
    the output dtype, so compared as the stored logits would be): for each row m < M, the largest value over
    the tile's columns n < N and the first column holding it, stored at ``[tile, m]`` of the fp32 / int32
    partials (row stride M). NaN counts as larger than any number, as in kernels/step_state.py's
    ``_argmax_row``; :func:`argmax_partials_ref` is the torch reference."""
    v = vals.to(tl.float32)
    v = tl.where(v != v, float("inf"), v)
    v = tl.where(offs_n[:, None] < N, v, float("-inf"))
    best = tl.max(v, axis=0)                                                    # [BLOCK_M]
    # valid columns come first in offs_n, so even a row of -inf only picks one of them
    first = tl.min(tl.where(v == best[None, :], offs_n[:, None], N), axis=0)
    at = tile.to(tl.int64) * M + offs_m
    tl.store(tmax_ptr + at, best, mask=offs_m < M)
    tl.store(targ_ptr + at, first.to(tl.int32), mask=offs_m < M)


@triton.jit
def _split_operands(x_ptr, w_ptr, rows, split, M, K, tiles_per_split, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """The operands of a pointer kernel's program over weight ``rows`` in K split ``split``: (w_ptrs [rows, BK],
    x_ptrs [BK, BM] at the split's first K tile, offs_m, offs_k, mask_m [1, BM], k0 = the split's first K
    element, num_tiles = its K tiles, none for a split past K)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    lo = split * tiles_per_split
    num_tiles = tl.minimum(tiles_per_split, tl.cdiv(K, BLOCK_K) - lo)
    k0 = lo * BLOCK_K
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k0 + offs_k)[:, None]
    return w_ptrs, x_ptrs, offs_m, offs_k, offs_m[None, :] < M, k0, num_tiles


@triton.jit
def _k_loop(w_ptrs, x_ptrs, mask_n, mask_m, offs_k, k0, K, num_tiles, BLOCK_N: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, DOT_FP32: tl.constexpr):
    """The K loop of the pointer kernels: the fp32 accumulator [BLOCK_N, BLOCK_M] of w_ptrs' BLOCK_N rows
    against x, over ``num_tiles`` K tiles from ``k0``."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(0, num_tiles):
        if EVEN:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=mask_m, other=0.0)
        else:
            mask_k = k0 + t * BLOCK_K + offs_k < K
            w = tl.load(w_ptrs, mask=mask_n & mask_k[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=mask_m & mask_k[:, None], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            acc = tl.dot(w.to(tl.float32), x, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _prefetch_l2(w_ptr, row0, k0, N, K, stride_wn, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Ask L2 for weight rows ``row0 .. row0 + ROWS - 1`` and elements ``k0 .. k0 + COLS - 1``, each index
    clamped into ``[N, K]`` (an empty last split, ``k0 >= K``, asks for the row's last element): one
    ``prefetch.global.L2`` per 128-byte line of 2-byte elements (PTX ISA, "prefetch"). Loads nothing into
    registers and touches no result. CUDA only (inline PTX)."""
    LINE: tl.constexpr = 64
    rows = row0 + tl.arange(0, ROWS)
    cols = k0 + tl.arange(0, COLS // LINE) * LINE
    ptrs = w_ptr + tl.where(rows < N, rows, row0)[:, None].to(tl.int64) * stride_wn \
        + tl.minimum(cols, K - 1)[None, :]
    l2_prefetch(ptrs)


@triton.jit
def _prefetch_region_l2(ptr, rows, cols, stride, lines, program, EVICT_LAST: tl.constexpr = False):
    """Ask L2 for program ``program``'s share of a region of 2-byte elements (a later kernel's weight, or its
    first columns): :func:`_region_line_offsets`, 256 lines at a time (a bounded register cost), with
    ``EVICT_LAST`` as the lines to keep (:func:`l2_prefetch`). Loads nothing; CUDA only."""
    CHUNK: tl.constexpr = 256
    for c0 in range(0, lines, CHUNK):
        l2_prefetch(ptr + _region_line_offsets(rows, cols, stride, lines, program, c0, CHUNK), EVICT_LAST)


@triton.jit
def _prefetch_rows_l2(ptr, rows, cols, stride, share, program):
    """Ask L2 for program ``program``'s share of a region of ``rows`` rows of ``cols`` 2-byte elements, ``stride``
    elements apart: rows ``program * share`` .. ``program * share + share - 1`` (those that exist), one
    :func:`l2_prefetch_bulk` of ``2 cols`` bytes a row (:data:`NEXT_TAIL`; the launcher checks the 16-byte
    alignment, :func:`next_weight_region`). Loads nothing; CUDA sm_90 only."""
    CHUNK: tl.constexpr = 128
    first = program.to(tl.int64) * share
    for c0 in range(0, share, CHUNK):
        row = first + c0 + tl.arange(0, CHUNK)
        live = (row < first + share) & (row < rows)
        l2_prefetch_bulk(ptr + tl.where(live, row, 0) * stride, cols * 2, live)


@triton.jit
def _extra_prefetch(program, split, tiles, nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines):
    """Whether this program (column index ``program`` of split ``split``) is one of a launch's extra prefetch
    programs, the columns past the ``tiles`` column tiles (:data:`NEXT_EXTRA`); if so, it has brought its share
    of the region into L2 (it needs no PDL wait: a later kernel's weight, which no kernel writes)."""
    share = _extra_share(program, split, tiles)
    if share >= 0:      # evict last: the carrying kernel's own weight stream passes through L2 meanwhile
        _prefetch_region_l2(nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines, share, True)
    return share >= 0


@triton.jit
def _extra_share(program, split, tiles):
    """Which share of the region program (``program``, ``split``) of a :data:`NEXT_EXTRA` launch takes: the extra
    columns ``tiles ..`` of every split, numbered column-fastest from 0; -1 for a column-tile program."""
    return tl.where(program >= tiles, (program - tiles) + split * (tl.num_programs(0) - tiles), -1)


@triton.jit
def _region_line_offsets(rows, cols, stride, lines, program, c0, CHUNK: tl.constexpr):
    """Element offsets of lines ``c0 .. c0 + CHUNK - 1`` of program ``program``'s share of a region of
    ``rows`` rows of ``cols`` 2-byte elements, ``stride`` elements apart, walked as 128-byte lines row by row:
    program p owns lines p * lines .. p * lines + lines - 1; a lane past its share or the region repeats the
    share's (or the region's) last line, so every offset stays inside the region."""
    LINE: tl.constexpr = 64
    per_row = tl.cdiv(cols, LINE)
    first = program.to(tl.int64) * lines
    last = tl.minimum(first + lines, tl.cast(rows, tl.int64) * per_row) - 1
    line = tl.minimum(first + c0 + tl.arange(0, CHUNK), last)
    return (line // per_row) * stride + (line % per_row) * LINE


@triton.jit
def l2_prefetch(ptrs, EVICT_LAST: tl.constexpr = False):
    """One ``prefetch.global.L2`` per pointer (PTX ISA, "prefetch"): the line comes into L2, no register is
    written and no result depends on it. ``EVICT_LAST`` (``prefetch.global.L2::evict_last``, sm_80+): the line
    is among the last L2 evicts, for a later kernel's weight that another kernel's stream passes over first."""
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def l2_prefetch_bulk(ptrs, nbytes, mask):
    """One ``cp.async.bulk.prefetch.L2.global`` of ``nbytes`` from each pointer whose ``mask`` is set (PTX ISA,
    "cp.async.bulk.prefetch", sm_90): the bytes come into L2, no register or shared memory is written and no
    result depends on it. Each pointer 16-byte aligned and ``nbytes`` a multiple of 16 (the PTX ISA's rule)."""
    tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t"
                              "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}", "=r,l,r,r",
                              [ptrs, nbytes + tl.zeros_like(mask.to(tl.int32)), mask.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one for an index-less ``cuda``), 0 for any other
    device (the grid-size checks of kernels/gemm_norm.py, kernels/mlp_block.py and decode attention's splits)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def l2_prefetch_if(ptrs, mask):
    """:func:`l2_prefetch` of each pointer whose ``mask`` is set (a predicated prefetch: none for the rest)."""
    tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];"
                              "\n\tmov.u32 $0, 0;\n\t}", "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _swiglu(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from fp32 accumulators, rounding where gemm + fused_ops.silu_mul round: the
    projection's output, then silu's."""
    g = gate.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return act * up.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["M", "nw_rows", "nw_cols", "nw_stride", "nw_lines"])
def _gemm_tma_kernel(x_desc, w_desc, out_ptr, w_ptr, M, N, K, tiles_per_split, stride_om, stride_os, stride_wn,
                     nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines, tmax_ptr, targ_ptr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                     GLU: tl.constexpr = False, PREFETCH_K: tl.constexpr = 0, NEXT: tl.constexpr = 0,
                     ARGMAX: tl.constexpr = False, STORE: tl.constexpr = True):
    """TMA loads (out-of-range rows and K read as zero); otherwise :func:`_gemm_kernel` (GLU: the up rows
    start at row N of the descriptor). ``w_ptr`` / ``stride_wn``: the weight again, for PREFETCH_K only."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    if NEXT == NEXT_EXTRA:
        if _extra_prefetch(pid_n, split, tl.cdiv(N, BLOCK_N), nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines):
            return
    lo = split * tiles_per_split
    num_tiles = tl.minimum(tiles_per_split, tl.cdiv(K, BLOCK_K) - lo)
    k = lo * BLOCK_K
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PREFETCH_K:
        _prefetch_l2(w_ptr, pid_n * BLOCK_N, k, N, K, stride_wn, BLOCK_N, PREFETCH_K)
        if GLU:
            _prefetch_l2(w_ptr + N.to(tl.int64) * stride_wn, pid_n * BLOCK_N, k, N, K, stride_wn, BLOCK_N, PREFETCH_K)
    if NEXT == NEXT_OWN:
        _prefetch_region_l2(nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines, pid_n + split * tl.num_programs(0))
    pdl.wait(PDL)
    for _ in range(0, num_tiles):
        x = x_desc.load([0, k])
        acc = tl.dot(w_desc.load([pid_n * BLOCK_N, k]), x.T, acc)
        if GLU:
            acc_up = tl.dot(w_desc.load([N + pid_n * BLOCK_N, k]), x.T, acc_up)
        k += BLOCK_K
    pdl.release(PDL)
    if GLU:
        acc = _swiglu(acc, acc_up, out_ptr.dtype.element_ty)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    if ARGMAX:
        _tile_argmax(acc.to(out_ptr.dtype.element_ty), offs_n, offs_m, N, M, pid_n, tmax_ptr, targ_ptr)
    if STORE:
        out = out_ptr + split.to(tl.int64) * stride_os + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))
    if NEXT == NEXT_TAIL:
        _prefetch_rows_l2(nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines, pid_n + split * tl.num_programs(0))


@triton.jit(do_not_specialize=["numel"])
def _reduce_kernel(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _validate(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> None:
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig, got {type(config).__name__}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float16, got {t.dtype}")
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} must be 2-D with unit stride along K, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"x and weight must share dtype and device, got {x.dtype}/{x.device} and "
                         f"{weight.dtype}/{weight.device}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} but weight has K={weight.shape[1]} (weight must be [N, K])")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"x must have 1..{MAX_M} rows, got {x.shape[0]}")
    if (config.tma or config.pdl) and not x.is_cuda:
        raise ValueError(f"tma and pdl need CUDA tensors, got {x.device} with {config}")


def gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, next_weight: torch.Tensor | None = None
         ) -> torch.Tensor:
    """``x @ weight.T`` with fp32 accumulation; never synchronises with the host.

    Args:
        x: ``[M, K]`` bf16/fp16, 1 <= M <= 128, unit stride along K. weight: ``[N, K]`` same dtype and device,
        unit stride along K. config: :class:`GemmConfig` (e.g. ``config_for(N, K, M)``). next_weight: a later
        kernel's weight, or a view of its first columns (``[R, C]``, 2-byte elements, unit last stride, x's
        device), which the programs, between them, bring into L2 before their PDL wait
        (:func:`next_weight_region`); only where PDL is active, and no result depends on it.

    Returns:
        ``split_k == 1``: ``[M, N]`` in x's dtype (one rounding). ``split_k > 1``: fp32 partials
        ``[split_k, M, N]`` whose sum in split order is the product (``reduce_partials``, or a fused
        consumer such as ``fused_ops.add_rms_norm``).

    Raises:
        TypeError / ValueError naming the bad argument (dtype, shape, stride, device, M out of range, a
        ``config.prefetch_programs`` > 0 without ``next_weight``).
    """
    _validate(x, weight, config)
    return _launch(x, weight, config, weight.shape[0], glu=False, next_weight=next_weight)


def gemm_swiglu(x: torch.Tensor, gate_up: torch.Tensor, config: GemmConfig, next_weight: torch.Tensor | None = None
                ) -> torch.Tensor:
    """SwiGLU's gate/up projection and activation in one launch: ``silu(x @ gate.T) * (x @ up.T)``.

    Args:
        x: as for :func:`gemm`. gate_up: ``[2 I, K]``, the gate rows then the up rows (the model's fused
        ``gate_up`` weight). config: a :class:`GemmConfig` with ``split_k == 1`` (the activation needs the
        whole sum); ``block_n`` counts the gate rows of a tile (its up rows come with them). next_weight: as
        for :func:`gemm`.

    Returns:
        ``[M, I]`` in x's dtype, bitwise what :func:`gemm` followed by ``fused_ops.silu_mul`` gives when the
        accumulation matches: the projection is rounded to x's dtype, silu's output too, as there.

    Raises:
        ValueError: ``split_k != 1`` or an odd number of weight rows; else as :func:`gemm`.
    """
    _validate(x, gate_up, config)
    check_swiglu_config(config)
    if gate_up.shape[0] % 2:
        raise ValueError(f"gate_up must have an even number of rows (gate then up), got {gate_up.shape[0]}")
    return _launch(x, gate_up, config, gate_up.shape[0] // 2, glu=True, next_weight=next_weight)


@dataclass(frozen=True)
class TileArgmax:
    """Greedy sampling's first pass, done by :func:`gemm_argmax`'s programs: for each of the product's
    column tiles ``t`` (``block_n`` columns each) and row ``m``, ``tile_max[t, m]`` (fp32) is the row's largest
    value over the tile, rounded to the product's dtype first (NaN counted as +inf), and ``tile_index[t, m]``
    (int32) the first column holding it. The row's greedy token is ``tile_index`` at the first tile with the
    largest ``tile_max``: torch.argmax of the logits (:func:`argmax_from_tiles_ref`;
    kernels/step_state.py's ``apply_rows`` reads it in its kernel)."""
    tile_max: torch.Tensor      # [T, M] fp32
    tile_index: torch.Tensor    # [T, M] int32

    def __post_init__(self):
        if (self.tile_max.dim() != 2 or self.tile_max.shape != self.tile_index.shape
                or self.tile_max.dtype != torch.float32 or self.tile_index.dtype != torch.int32
                or self.tile_max.stride() != self.tile_index.stride() or self.tile_max.stride(1) != 1):
            raise ValueError(f"TileArgmax needs fp32 / int32 [T, M] tensors of one shape and strides, unit row "
                             f"stride, got "
                             f"{self.tile_max.dtype} {tuple(self.tile_max.shape)} / {self.tile_index.dtype} "
                             f"{tuple(self.tile_index.shape)}")

    @property
    def rows(self) -> int:
        return self.tile_max.shape[1]

    def __getitem__(self, rows: slice) -> "TileArgmax":
        """The partials of a slice of the rows (views; the per-row [T] columns keep their stride M)."""
        return TileArgmax(self.tile_max[:, rows], self.tile_index[:, rows]) if rows != slice(None) else self


def gemm_argmax(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, logits: bool = False
                ) -> tuple[TileArgmax, torch.Tensor | None]:
    """lm_head with greedy sampling's first pass in its epilogue: each program keeps, per row, the largest
    logit of its column tile and where it is (:class:`TileArgmax`), so the [M, N] logits need not be written
    or read back to sample (BRIEF section 3: the decode step's argmax read them once more).

    Args: as :func:`gemm`, with ``config.split_k == 1`` (a tile's maximum needs the whole sum). logits: also
    write the ``[M, N]`` product (x's dtype) as :func:`gemm` does.

    Returns:
        (TileArgmax with ``ceil(N / block_n)`` tiles of M rows, the logits or None). The tile values are the
        logits rounded as :func:`gemm` stores them, so the sampled token is bitwise ``gemm(...).argmax(-1)``.

    Raises:
        ValueError: ``split_k != 1`` or ``prefetch_programs`` > 0 (no next weight to prefetch); else as
        :func:`gemm`.
    """
    _validate(x, weight, config)
    if config.split_k != 1:
        raise ValueError(f"gemm_argmax needs split_k == 1 (a tile's maximum needs the whole sum), got {config}")
    if config.prefetch_programs:
        raise ValueError(f"gemm_argmax takes no next_weight, so prefetch_programs={config.prefetch_programs} "
                         f"would launch no extra program: it must be 0")
    tiles = triton.cdiv(weight.shape[0], config.block_n)
    part = TileArgmax(torch.empty((tiles, x.shape[0]), device=x.device, dtype=torch.float32),
                      torch.empty((tiles, x.shape[0]), device=x.device, dtype=torch.int32))
    out = _launch(x, weight, config, weight.shape[0], glu=False, argmax=part, store=logits)
    return part, out


def argmax_partials_ref(logits: torch.Tensor, block_n: int) -> TileArgmax:
    """Torch reference of :class:`TileArgmax` from logits [M, N] bf16 / fp16 / fp32 (fp32 holds each exactly;
    fp64 logits would be rounded to fp32 and could tie where they differ)."""
    m, n = logits.shape
    v = logits.to(torch.promote_types(logits.dtype, torch.float32))
    v = torch.where(v.isnan(), float("inf"), v)
    maxes, firsts = [], []
    for lo in range(0, n, block_n):
        tile = v[:, lo:lo + block_n]
        best = tile.max(dim=1).values
        maxes.append(best.float())
        firsts.append((tile == best[:, None]).int().argmax(dim=1).int() + lo)
    return TileArgmax(torch.stack(maxes).contiguous(), torch.stack(firsts).contiguous())


def argmax_from_tiles_ref(part: TileArgmax) -> torch.Tensor:
    """The greedy token [M] int64 of each row from its partials: the first tile with the largest maximum."""
    best = part.tile_max.max(dim=0).values
    first_tile = (part.tile_max == best[None, :]).int().argmax(dim=0)
    return part.tile_index.gather(0, first_tile[None, :])[0].long()


def check_swiglu_config(config: GemmConfig) -> None:
    """ValueError unless ``config`` can run :func:`gemm_swiglu` (split_k 1: the activation needs the whole sum)."""
    if config.split_k != 1:
        raise ValueError(f"gemm_swiglu needs split_k == 1 (the activation needs the whole sum), got {config}")


def num_stages_that_fit(c: GemmConfig, block_m: int, device: torch.device, weight_tiles: int = 1,
                        elem_bytes: int = 2) -> int:
    """``c.num_stages``, lowered until one stage's tiles times the stages fit the device's shared memory.

    One pipeline stage holds ``weight_tiles`` weight tiles ``[block_n, block_k]`` (2 with the GLU's up rows)
    and the x tile ``[block_m, block_k]``, ``elem_bytes`` each; a configuration measured at M = 16-32 may not
    fit at M = 128 (qkv's block_k 256: 96 KiB a stage). Stages only pipeline the loads, so this changes no
    bit of the result. On a CPU (the interpreter) the configured count is returned.
    """
    if device.type != "cuda":
        return c.num_stages
    per_stage = (weight_tiles * c.block_n + block_m) * c.block_k * elem_bytes
    return max(1, min(c.num_stages, (_max_shared_bytes(device) - _SHARED_RESERVE) // per_stage))


_SHARED_RESERVE = 1024          # bytes kept for barriers and the epilogue's scratch beside the stage buffers
_SHARED_BYTES: dict[int, int] = {}


def _max_shared_bytes(device: torch.device) -> int:
    """Shared memory one program may use on ``device`` (the opt-in maximum Triton checks a launch against)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED_BYTES:
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        _SHARED_BYTES[index] = int(props["max_shared_mem"])
    return _SHARED_BYTES[index]


def _launch(x: torch.Tensor, weight: torch.Tensor, c: GemmConfig, n: int, glu: bool,
            next_weight: torch.Tensor | None = None, argmax: "TileArgmax | None" = None, store: bool = True
            ) -> torch.Tensor | None:
    """Run one of the kernels over ``n`` output columns; [M, n] (split_k 1) or fp32 partials [S, M, n], or
    None without ``store``. ``argmax``: partials the kernel also fills (split_k 1; :func:`gemm_argmax`)."""
    m, k = x.shape
    block_m = max(16, triton.next_power_of_2(m))
    tiles_per_split = triton.cdiv(triton.cdiv(k, c.block_k), c.split_k)
    if not store:
        out = x[None]                       # no allocation: a pointer of x's dtype the kernel never writes
    elif c.split_k == 1:
        out = torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    else:
        out = torch.empty((c.split_k, m, n), device=x.device, dtype=torch.float32)
    tiles = (argmax.tile_max, argmax.tile_index) if argmax is not None else (out, out)
    stages = num_stages_that_fit(c, block_m, x.device, 2 if glu else 1, x.element_size())
    use_pdl = c.pdl and pdl.active(x)
    launch = pdl.launch_options(use_pdl, num_warps=c.num_warps, num_stages=stages)
    prefetch_k = prefetch_elements(c, k, use_pdl, x.element_size())
    grid, region, next_mode = next_weight_launch(next_weight, x, triton.cdiv(n, c.block_n), c.split_k,
                                                 c.prefetch_programs, use_pdl, c.prefetch_at_end)
    if c.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        x_desc = TensorDescriptor.from_tensor(x, [block_m, c.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
        _gemm_tma_kernel[grid](x_desc, w_desc, out, weight, m, n, k, tiles_per_split, out.stride(1), out.stride(0),
                               weight.stride(0), *region, *tiles, BLOCK_N=c.block_n, BLOCK_M=block_m,
                               BLOCK_K=c.block_k, PDL=pdl.mode(use_pdl, c.early_trigger), GLU=glu,
                               PREFETCH_K=prefetch_k, NEXT=next_mode, ARGMAX=argmax is not None, STORE=store,
                               **launch)
    else:
        even = n % c.block_n == 0 and k % c.block_k == 0
        _gemm_kernel[grid](x, weight, out, m, n, k, tiles_per_split, x.stride(0), weight.stride(0), out.stride(1),
                           out.stride(0), *region, *tiles, BLOCK_N=c.block_n, BLOCK_M=block_m, BLOCK_K=c.block_k,
                           EVEN=even, DOT_FP32=not x.is_cuda, PDL=pdl.mode(use_pdl, c.early_trigger), GLU=glu,
                           PREFETCH_K=prefetch_k, NEXT=next_mode, ARGMAX=argmax is not None, STORE=store, **launch)
    if not store:
        return None
    return out[0] if c.split_k == 1 else out


def prefetch_elements(c: GemmConfig, k: int, use_pdl: bool, elem_bytes: int = 2) -> int:
    """Weight elements per row a program prefetches before its PDL wait (the kernels' ``PREFETCH_K``):
    ``c.prefetch_tiles`` K tiles, at most the K range of one split, in whole 128-byte lines; 0 without PDL
    (nothing to overlap), on the CPU (inline PTX) or for other than 2-byte elements (64 per line), and a
    power of two (a Triton range)."""
    if not (use_pdl and c.prefetch_tiles) or elem_bytes != 2:
        return 0
    per_split = triton.cdiv(triton.cdiv(k, c.block_k), c.split_k) * c.block_k
    cols = min(c.prefetch_tiles * c.block_k, per_split, k)
    return 0 if cols < 64 else 1 << (cols.bit_length() - 1)


def next_weight_launch(next_weight: torch.Tensor | None, x: torch.Tensor, columns: int, split_k: int,
                       prefetch_programs: int, use_pdl: bool, at_end: bool = False
                       ) -> tuple[tuple[int, int], tuple, int]:
    """The grid, region arguments and ``NEXT`` mode of a launch of ``columns`` x ``split_k`` programs that may
    bring ``next_weight`` into L2 (:func:`next_weight_region`): without a region to prefetch, that grid and 0;
    with ``prefetch_programs`` 0, every program takes a share, before its wait (:data:`NEXT_OWN`) or with
    ``at_end`` (``GemmConfig.prefetch_at_end``) whole rows at its end (:data:`NEXT_TAIL`); else
    ``ceil(prefetch_programs / split_k)`` extra columns of programs take all of it (:data:`NEXT_EXTRA`).

    Raises ValueError for ``prefetch_programs`` > 0 without ``next_weight``: those programs do nothing but the
    prefetch, so they would never be launched and a configuration timed with them would measure nothing."""
    if prefetch_programs and next_weight is None:
        raise ValueError(f"prefetch_programs={prefetch_programs} needs a next_weight region for its extra programs "
                         f"to bring into L2, got none: they would never be launched (pass next_weight, or set "
                         f"prefetch_programs=0)")
    extra = triton.cdiv(prefetch_programs, split_k)
    at_end = at_end and not extra
    region, lines = next_weight_region(next_weight, x, (extra or columns) * split_k, use_pdl, at_end)
    if not lines:
        return (columns, split_k), region, 0
    if not extra:
        return (columns, split_k), region, int((NEXT_TAIL if at_end else NEXT_OWN).value)
    return (columns + extra, split_k), region, int(NEXT_EXTRA.value)


def next_weight_region(next_weight: torch.Tensor | None, x: torch.Tensor, programs: int, use_pdl: bool,
                       by_rows: bool = False) -> tuple[tuple, int]:
    """The kernels' region arguments ``(nw_ptr, nw_rows, nw_cols, nw_stride, nw_lines)`` for a launch of
    ``programs`` programs, and ``nw_lines``: each program's share, ``ceil(lines / programs)`` of the region's
    128-byte lines, or with ``by_rows`` (:data:`NEXT_TAIL`) ``ceil(rows / programs)`` of its rows. ``nw_lines`` 0
    (nothing prefetched; x stands in for the pointer) without a region, without PDL (nothing to overlap; this
    covers the CPU), or for an empty one. Raises TypeError / ValueError naming a region that is not 2-D, 2-byte,
    unit last stride, on x's device, or with ``by_rows`` one whose rows do not start on 16 bytes or are not a
    multiple of 16 bytes long (a bulk prefetch's rule, :func:`l2_prefetch_bulk`)."""
    if next_weight is not None:
        if next_weight.element_size() != 2 or not next_weight.dtype.is_floating_point:
            raise TypeError(f"next_weight must hold 2-byte floats, got {next_weight.dtype}")
        if next_weight.dim() != 2 or next_weight.stride(1) != 1 or next_weight.device != x.device:
            raise ValueError(f"next_weight must be 2-D with unit last stride on {x.device}, got shape "
                             f"{tuple(next_weight.shape)} strides {next_weight.stride()} on {next_weight.device}")
        if by_rows and (next_weight.data_ptr() % 16 or next_weight.stride(0) % 8 or next_weight.shape[1] % 8):
            raise ValueError(f"a prefetch at the end needs rows starting on 16 bytes, 16-byte multiples long: got "
                             f"shape {tuple(next_weight.shape)} strides {next_weight.stride()} at "
                             f"{next_weight.data_ptr() % 16} bytes past 16")
    if next_weight is None or not use_pdl or next_weight.numel() == 0:
        return (x, 0, 0, 0, 0), 0
    rows, cols = next_weight.shape
    share = triton.cdiv(rows, programs) if by_rows else triton.cdiv(rows * triton.cdiv(cols, 64), programs)
    return (next_weight, rows, cols, next_weight.stride(0), share), share


_REDUCE_BLOCK = 1024


def reduce_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum fp32 partials ``[S, M, N]`` (contiguous) in order s = 0, 1, ... and round once: ``[M, N]`` dtype."""
    if partials.dtype != torch.float32 or partials.dim() != 3 or not partials.is_contiguous():
        raise ValueError(f"partials must be contiguous fp32 [S, M, N], got {partials.dtype} "
                         f"{tuple(partials.shape)}")
    s, m, n = partials.shape
    out = torch.empty((m, n), device=partials.device, dtype=dtype)
    numel = m * n
    _reduce_kernel[(triton.cdiv(numel, _REDUCE_BLOCK),)](partials, out, numel, SPLIT_K=s, BLOCK=_REDUCE_BLOCK)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """:func:`gemm` reduced to ``[M, N]`` in x's dtype (a reduce launch when ``split_k > 1``)."""
    out = gemm(x, weight, config)
    return out if config.split_k == 1 else reduce_partials(out, x.dtype)


def gemm_ref(x: torch.Tensor, weight: torch.Tensor, split_k: int = 1, block_k: int = 128) -> torch.Tensor:
    """Torch reference: fp32 products; with ``split_k`` the same K ranges as :func:`gemm` (fp32 partials)."""
    k = x.shape[1]
    per = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    parts = [x[:, lo:lo + per].float() @ weight[:, lo:lo + per].float().T for lo in range(0, per * split_k, per)]
    if split_k == 1:
        return parts[0].to(x.dtype)
    return torch.stack(parts)
