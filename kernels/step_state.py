"""The resident decode state around one loop, in two launches (Triton): gather each row's loop input before
the loop, apply its results to the slots after it.

A decode step (runtime/runner.py, ``Runner.decode_core``) reads each row's state from its request slot
before the recurrent-core loop and writes it back after, for N rows of slots ``sl`` (padding rows: the
scratch slot S). In torch that is about thirty tiny kernels per step (gathers, ``where``, ``index_copy_``,
casts), each a launch gap in the step's graph; here it is one kernel on each side, one program per row,
with programmatic dependent launch on sm_90+ (kernels/pdl.py). The torch functions ``*_ref`` beside them
are the runner's original code and the definition: the kernels move the same values (no arithmetic but
comparisons and an integer add), so they agree exactly.

- :func:`gather_rows`: ``sl`` (slot, or S for padding), the loop input ``x`` (the embedding of the slot's
  last token at depth 1, else the slot's hidden state), the survival before this loop (1 at depth 1) and
  the delayed-gate flag carried in (false at depth 1).
- :func:`apply_rows`: the greedy token (the argmax of the row's logits, which torch's reduction took about
  16 us a step for at B16 on an H200, or of lm_head's per-tile maxima, ``gemm.TileArgmax``), the exit flag (masked to real rows), the slots' hidden state,
  survival and flag, and for exiting rows the output token (appended, counted) and the last token; the
  slot of each exiting row (-1 for the rest), for the alias exit map or the native fill.

Several padding rows all write the scratch slot; which of them wins is unspecified, as with
``index_copy_``, and nothing reads the scratch slot's values but padding rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .gemm import TileArgmax, argmax_from_tiles_ref


@triton.jit
def _gather_rows_kernel(row_slot_ptr, row_depth_ptr, last_token_ptr, embed_ptr, hidden_ptr, survival_ptr,
                        triggered_ptr, sl_ptr, x_ptr, s_prev_ptr, t_prev_ptr,
                        hidden_size, scratch, stride_e, stride_h, stride_x,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    pdl.wait(PDL)
    slot = tl.load(row_slot_ptr + row)
    first = tl.load(row_depth_ptr + row) == 1
    sl = tl.where(slot >= 0, slot, scratch).to(tl.int64)
    if first:
        src = embed_ptr + tl.load(last_token_ptr + sl) * stride_e
    else:
        src = hidden_ptr + sl * stride_h
    x = tl.load(src + offs, mask=mask)
    survival = tl.load(survival_ptr + sl)
    triggered = tl.load(triggered_ptr + sl)
    pdl.release(PDL)
    tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    tl.store(sl_ptr + row, sl)
    tl.store(s_prev_ptr + row, tl.where(first, 1.0, survival).to(s_prev_ptr.dtype.element_ty))
    tl.store(t_prev_ptr + row, triggered & ~first)


@triton.jit
def _argmax_row(row_ptr, count, stride, BLOCK_V: tl.constexpr, ACC: tl.constexpr):
    """Index of the largest of ``count`` values ``stride`` elements apart from ``row_ptr``, the first one on ties
    (torch.argmax's rule); NaN counts as larger than any number. Compared in ``ACC`` (fp32, which holds
    bf16/fp16/fp32 exactly; fp64 for fp64 logits). Chunks in order, strictly-greater updates: the first index
    wins."""
    offs = tl.arange(0, BLOCK_V)
    best = tl.full((), float("-inf"), ACC)
    best_i = tl.full((), 0, tl.int64)
    for start in range(0, count, BLOCK_V):
        idx = start + offs
        v = tl.load(row_ptr + idx * stride, mask=idx < count, other=float("-inf")).to(ACC)
        v = tl.where(v != v, float("inf"), v)
        m = tl.max(v, axis=0)
        i = tl.min(tl.where(v == m, idx, count), axis=0).to(tl.int64)
        take = m > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    return best_i


@triton.jit
def _apply_rows_kernel(exit_ptr, logits_ptr, tile_index_ptr, x_ptr, s_ptr, trig_ptr, sl_ptr, row_slot_ptr,
                       hidden_ptr, survival_ptr, triggered_ptr, out_tokens_ptr, n_out_ptr, last_token_ptr,
                       exit_out_ptr, exit_slot_ptr, token_ptr,
                       hidden_size, vocab, stride_l, stride_x, stride_h, stride_ot,
                       BLOCK: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr, PDL: tl.constexpr,
                       TILES: tl.constexpr = False):
    """TILES: ``logits_ptr`` / ``tile_index_ptr`` are a gemm.TileArgmax's [vocab tiles, N] partials, stride_l
    apart per tile; the row's token is the index stored at its first tile of the largest maximum."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    pdl.wait(PDL)
    if TILES:
        tile = _argmax_row(logits_ptr + row, vocab, stride_l, BLOCK_V, ACC)
        token = tl.load(tile_index_ptr + tile * stride_l + row).to(tl.int64)
    else:
        token = _argmax_row(logits_ptr + row.to(tl.int64) * stride_l, vocab, 1, BLOCK_V, ACC)
    sl = tl.load(sl_ptr + row)
    slot = tl.load(row_slot_ptr + row)
    exit_now = tl.load(exit_ptr + row) & (slot >= 0)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask)
    s = tl.load(s_ptr + row)
    trig = tl.load(trig_ptr + row)
    n = tl.load(n_out_ptr + sl)
    pdl.release(PDL)
    tl.store(hidden_ptr + sl * stride_h + offs, x, mask=mask)
    tl.store(survival_ptr + sl, s)
    tl.store(triggered_ptr + sl, trig)
    if exit_now:
        tl.store(out_tokens_ptr + sl * stride_ot + n, token)
        tl.store(last_token_ptr + sl, token)
    tl.store(n_out_ptr + sl, n + exit_now.to(n.dtype))
    tl.store(exit_out_ptr + row, exit_now)
    tl.store(exit_slot_ptr + row, tl.where(exit_now, slot, -1))
    tl.store(token_ptr + row, token)


def _check_rows(**tensors) -> int:
    n = None
    for name, t in tensors.items():
        if t.dim() != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [N] tensor, got shape {tuple(t.shape)}")
        if n is not None and t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} rows, expected {n}")
        n = t.shape[0]
    return n


def _check_slots(hidden: torch.Tensor, **state) -> None:
    """The slot state: hidden [S + 1, hidden] with unit last stride, the named per-slot vectors contiguous
    [S + 1] of the dtype given beside each (None: any)."""
    if hidden.dim() != 2 or hidden.stride(1) != 1:
        raise ValueError(f"hidden must be [S + 1, hidden] with unit last stride, got {tuple(hidden.shape)}")
    for name, (t, dtype) in state.items():
        if t.shape[0] != hidden.shape[0] or (t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1) or \
                (t.dim() == 2 and t.stride(1) != 1):
            raise ValueError(f"{name} must be contiguous with {hidden.shape[0]} slots, got shape {tuple(t.shape)}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def gather_rows(row_slot: torch.Tensor, row_depth: torch.Tensor, last_token: torch.Tensor, embed: torch.Tensor,
                hidden: torch.Tensor, survival: torch.Tensor, triggered: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's loop input and carried exit state, read from its slot; never synchronises with the host.

    Args:
        row_slot, row_depth: ``[N] int32``, the step's descriptor rows (slot < 0: padding).
        last_token: ``[S + 1] int64``; embed: ``[vocab, hidden]``; hidden: ``[S + 1, hidden]`` embed's dtype;
        survival: ``[S + 1]`` float; triggered: ``[S + 1] bool`` (row S: the scratch slot).

    Returns:
        (sl ``[N] int64``, x ``[N, hidden]``, s_prev ``[N]`` survival's dtype, t_prev ``[N] bool``), exactly
        :func:`gather_rows_ref`'s. Raises ValueError naming the argument for rows of different lengths, another
        hidden size or dtype, a slot vector of another length, dtype or stride.
    """
    n = _check_rows(row_slot=row_slot, row_depth=row_depth)
    if embed.shape[1] != hidden.shape[1] or embed.stride(1) != 1 or embed.dtype != hidden.dtype:
        raise ValueError(f"embed {tuple(embed.shape)} {embed.dtype} and hidden {tuple(hidden.shape)} {hidden.dtype} "
                         f"must share dtype and a unit-stride hidden size")
    _check_slots(hidden, last_token=(last_token, torch.int64), survival=(survival, None),
                 triggered=(triggered, torch.bool))
    dev = row_slot.device
    sl = torch.empty(n, dtype=torch.int64, device=dev)
    x = torch.empty((n, hidden.shape[1]), dtype=hidden.dtype, device=dev)
    s_prev = torch.empty(n, dtype=survival.dtype, device=dev)
    t_prev = torch.empty(n, dtype=torch.bool, device=dev)
    if n:
        use_pdl = pdl.active(row_slot)
        _gather_rows_kernel[(n,)](row_slot, row_depth, last_token, embed, hidden, survival, triggered, sl, x, s_prev,
                                  t_prev, hidden.shape[1], hidden.shape[0] - 1, embed.stride(0), hidden.stride(0),
                                  x.stride(0), BLOCK=triton.next_power_of_2(hidden.shape[1]), PDL=pdl.mode(use_pdl),
                                  **pdl.launch_options(use_pdl, num_warps=4))
    return sl, x, s_prev, t_prev


def apply_rows(exit_now: torch.Tensor, logits: "torch.Tensor | TileArgmax", x: torch.Tensor, s: torch.Tensor,
               trig: torch.Tensor, sl: torch.Tensor, row_slot: torch.Tensor, hidden: torch.Tensor,
               survival: torch.Tensor, triggered: torch.Tensor, out_tokens: torch.Tensor, n_out: torch.Tensor,
               last_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample each row greedily and write the loop's results into the rows' slots; never synchronises with
    the host.

    Args:
        exit_now ``[N] bool`` (the policy's decision), logits ``[N, vocab]`` (unit last stride; the greedy
        token is their argmax, the first index on ties as torch.argmax; NaN counts as the largest value,
        which differs from torch only where a row holds +inf before its first NaN) or lm_head's
        ``gemm.TileArgmax`` of N rows (the same token from per-tile maxima, without the logits), x ``[N,
        hidden]`` (the loop output), s ``[N]`` float and trig ``[N] bool`` (exit state after the loop), sl ``[N]
        int64`` and row_slot ``[N] int32`` (from :func:`gather_rows` and the descriptor); the slot state,
        updated in place: hidden ``[S + 1, hidden]``, survival ``[S + 1]``, triggered ``[S + 1] bool``,
        out_tokens ``[S + 1, max_model_len] int64``, n_out and last_token ``[S + 1] int64``.

    Returns:
        (exit ``[N] bool``: exit_now on real rows, exit_slot ``[N] int32``: the slot of an exiting row, else
        -1, token ``[N] int64``), exactly :func:`apply_rows_ref`'s, with the same in-place updates. Raises
        ValueError naming the argument for a wrong shape, stride or dtype (``s`` must be survival's dtype).
    """
    n = _check_rows(exit_now=exit_now, s=s, trig=trig, sl=sl, row_slot=row_slot)
    tiles = isinstance(logits, TileArgmax)
    if tiles:
        if logits.rows != n:
            raise ValueError(f"the TileArgmax has {logits.rows} rows, expected {n}")
        values, index, count = logits.tile_max, logits.tile_index, logits.tile_max.shape[0]
    else:
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] < 1 or logits.stride(1) != 1:
            raise ValueError(f"logits must be [{n}, vocab >= 1] with unit last stride, got {tuple(logits.shape)}")
        values, index, count = logits, logits, logits.shape[1]
    _check_slots(hidden, survival=(survival, s.dtype), triggered=(triggered, torch.bool),
                 out_tokens=(out_tokens, torch.int64), n_out=(n_out, torch.int64), last_token=(last_token, torch.int64))
    if sl.dtype != torch.int64 or exit_now.dtype != torch.bool or trig.dtype != torch.bool:
        raise ValueError(f"sl must be int64 and exit_now, trig bool, got {sl.dtype}, {exit_now.dtype}, {trig.dtype}")
    if x.shape != (n, hidden.shape[1]) or x.stride(1) != 1 or x.dtype != hidden.dtype:
        raise ValueError(f"x must be [{n}, {hidden.shape[1]}] {hidden.dtype} with unit last stride, got "
                         f"{tuple(x.shape)} {x.dtype}")
    exit_out = torch.empty_like(exit_now)
    exit_slot = torch.empty(n, dtype=torch.int32, device=row_slot.device)
    token = torch.empty(n, dtype=torch.int64, device=row_slot.device)
    if n:
        use_pdl = pdl.active(row_slot)
        block_v = min(_BLOCK_V, triton.next_power_of_2(count))
        _apply_rows_kernel[(n,)](exit_now, values, index, x, s, trig, sl, row_slot, hidden, survival, triggered,
                                 out_tokens, n_out, last_token, exit_out, exit_slot, token, hidden.shape[1], count,
                                 values.stride(0), x.stride(0), hidden.stride(0), out_tokens.stride(0),
                                 BLOCK=triton.next_power_of_2(hidden.shape[1]), BLOCK_V=block_v,
                                 ACC=tl.float64 if values.dtype == torch.float64 else tl.float32, PDL=pdl.mode(use_pdl),
                                 TILES=tiles, **pdl.launch_options(use_pdl, num_warps=_APPLY_WARPS))
    return exit_out, exit_slot, token


# Logits per argmax chunk and warps of the apply program: one program per row walks its row's logits chunk by
# chunk, each chunk's load waiting a full memory latency, so few large chunks: 3 for Ouro's 49,152-token
# vocabulary (2,048-element chunks, 24 of them, took 19.8 us per step on the H200).
_BLOCK_V = 16384
_APPLY_WARPS = 16


# ------------------------------------------------------------------------------ torch references
def gather_rows_ref(row_slot, row_depth, last_token, embed, hidden, survival, triggered):
    """:func:`gather_rows` in torch (the runner's own path where the Triton kernels do not run)."""
    valid = row_slot >= 0
    sl = torch.where(valid, row_slot, hidden.shape[0] - 1).long()
    first = row_depth == 1
    x = torch.where(first[:, None], embed[last_token[sl]], hidden[sl])
    s_prev = torch.where(first, torch.ones_like(survival[sl]), survival[sl])
    return sl, x, s_prev, triggered[sl] & ~first


def apply_rows_ref(exit_now, logits, x, s, trig, sl, row_slot, hidden, survival, triggered, out_tokens, n_out,
                   last_token):
    """:func:`apply_rows` in torch (the runner's own path where the Triton kernels do not run)."""
    token = argmax_from_tiles_ref(logits) if isinstance(logits, TileArgmax) else logits.argmax(-1)
    exit_now = exit_now & (row_slot >= 0)
    hidden.index_copy_(0, sl, x)
    survival.index_copy_(0, sl, s)
    triggered.index_copy_(0, sl, trig)
    n = n_out[sl]
    out_tokens[sl, n] = torch.where(exit_now, token, out_tokens[sl, n])
    last_token.index_copy_(0, sl, torch.where(exit_now, token, last_token[sl]))
    n_out.index_copy_(0, sl, n + exit_now.long())
    return exit_now, torch.where(exit_now, row_slot, -1).to(torch.int32), token
