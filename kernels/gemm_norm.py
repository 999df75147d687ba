"""A split-K projection whose own programs then run the sandwich-norm step on its rows (Triton): o_proj or down
and the ``fused_ops.add_rms_norm`` after it in one launch, one kernel boundary fewer per use.

Why: the decode loop's distance from its bandwidth floor is a fixed cost per kernel, about 2.7 us for each of
the 181 kernels of a decode step on the H200 (kernels/results/throughput_budget_5e7afa5.md); the norm step
after o_proj and after down is two of the seven kernels of a layer, and it moves almost no data.

How: the programs compute and store their fp32 split-K partials exactly as ``gemm.gemm`` does (same tiles,
same K order, so the same bits), then count themselves on an arrival counter. The norm step of a row needs
every partial of that row, so it can start only once every program has arrived:

- ``spin`` (CUDA): the last M programs to arrive each take one row (the last arrival row 0, ...), wait on the
  counter until it reaches the grid's size, and run the row's norm step (``fused_ops.norm_pair_store``, the
  same code as ``add_rms_norm``'s kernel; its fp32 sums run in this kernel's 4-warp layout, so results agree
  with the separate kernel's to rounding, not bitwise). Every program is resident at once (the launcher refuses
  a grid larger than the GPU's SM count), so a waiting program never keeps one that has not arrived off an
  SM. A second counter counts the rows done; the last one sets both counters back to zero, so the next launch
  (a later layer, or a graph replay) finds them zero. The partials are read past L1 (``.cg``): other SMs
  wrote them in this launch.
- the Triton interpreter runs programs one after another, so a program that waits for later ones would
  wait for ever: there the last program to arrive runs every row's norm step itself.

Memory order: each program's partial stores, a CTA barrier, then a release-acquire atomic add at GPU scope
(the pattern of CUDA's threadFenceReduction sample); the waiting loads are acquire atomics, so the partials
read after them are the final ones (PTX ISA, "Memory Consistency Model").

``counters`` is a zeroed int32 tensor of two elements that every launch leaves zero (:func:`new_counters`); the
kernels of one stream use it one after another (a PDL kernel touches it only after its ``griddepcontrol.wait``,
when the kernel before it has completed), so one pair per device serves a whole loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemm as gm
from . import pdl
from .fused_ops import check_gate, check_vectors, load_gate, norm_pair_store, sum_partials


def new_counters(device) -> torch.Tensor:
    """The arrival and done counters of :func:`gemm_add_rms_norm`: int32 [2], zero (allocate outside a graph
    capture; every launch leaves them zero)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


@triton.jit(do_not_specialize=["M"])
def _gemm_norm_kernel(x_ptr, w_ptr, part_ptr, res_ptr, w1_ptr, w2_ptr, x_out_ptr, h_out_ptr, gw_ptr, gb_ptr,
                      hazard_ptr, count_ptr, M, N, K, tiles_per_split, stride_xm, stride_wn, stride_pm, stride_ps,
                      stride_res, stride_xo, stride_ho, eps,
                      BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                      SPLIT: tl.constexpr, EVEN: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
                      SPIN: tl.constexpr, GATE: tl.constexpr, PREFETCH_K: tl.constexpr = 0):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n[:, None] < N
    w_ptrs, x_ptrs, offs_m, offs_k, mask_m, k0, num_tiles = gm._split_operands(
        x_ptr, w_ptr, offs_n, split, M, K, tiles_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_K)
    if PREFETCH_K:
        gm._prefetch_l2(w_ptr, pid_n * BLOCK_N, k0, N, K, stride_wn, BLOCK_N, PREFETCH_K)
    pdl.wait(PDL)
    acc = gm._k_loop(w_ptrs, x_ptrs, mask_n, mask_m, offs_k, k0, K, num_tiles, BLOCK_N, BLOCK_M, BLOCK_K, EVEN,
                     DOT_FP32)
    pdl.release(PDL)
    part = part_ptr + split.to(tl.int64) * stride_ps + offs_m[None, :].to(tl.int64) * stride_pm + offs_n[:, None]
    tl.store(part, acc, mask=mask_m & mask_n)

    # Every program's partials are stored: count this one in (release: the stores above come first).
    tl.debug_barrier()
    total = tl.num_programs(0) * tl.num_programs(1)
    rank = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < N
    if SPIN:
        if rank >= total - M:
            row = total - 1 - rank
            # what the row's norm step reads besides the partials, loaded while the other programs finish
            x, w1, w2, gw, gb = _row_inputs(row, res_ptr, w1_ptr, w2_ptr, gw_ptr, gb_ptr, offs_h, mask_h, stride_res,
                                            GATE)
            while tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < total:
                pass
            tl.debug_barrier()
            _norm_row(row, x, w1, w2, gw, gb, part_ptr, x_out_ptr, h_out_ptr, hazard_ptr, offs_h, mask_h, N, stride_pm,
                      stride_ps, stride_xo, stride_ho, eps, SPLIT, GATE)
            tl.debug_barrier()
            if tl.atomic_add(count_ptr + 1, 1, sem="acq_rel", scope="gpu") == M - 1:   # the last row done
                tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(count_ptr + 1, 0, sem="relaxed", scope="gpu")
    else:
        if rank == total - 1:
            for row in range(0, M):
                x, w1, w2, gw, gb = _row_inputs(row, res_ptr, w1_ptr, w2_ptr, gw_ptr, gb_ptr, offs_h, mask_h,
                                                stride_res, GATE)
                _norm_row(row, x, w1, w2, gw, gb, part_ptr, x_out_ptr, h_out_ptr, hazard_ptr, offs_h, mask_h, N,
                          stride_pm, stride_ps, stride_xo, stride_ho, eps, SPLIT, GATE)
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _row_inputs(row, res_ptr, w1_ptr, w2_ptr, gw_ptr, gb_ptr, offs, mask, stride_res, GATE: tl.constexpr):
    """Row ``row``'s residual and the norm and gate weights in fp32: everything its norm step reads but the
    partials (earlier kernels' outputs and parameters, so a waiting program loads them before it spins on the
    arrival counter)."""
    x = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gw, gb = load_gate(gw_ptr, gb_ptr, offs, mask, GATE)
    return x, w1, w2, gw, gb


@triton.jit
def _norm_row(row, x, w1, w2, gw, gb, part_ptr, x_out_ptr, h_out_ptr, hazard_ptr, offs, mask, hidden, stride_pm,
              stride_ps, stride_xo, stride_ho, eps, SPLIT: tl.constexpr, GATE: tl.constexpr):
    """Row ``row``'s norm step from the finished partials and its :func:`_row_inputs` (``fused_ops.add_rms_norm``
    for one row). The projection is rounded to the output dtype before the norm, as a stored projection is: sum_partials
    rounds the sum of two or more partials, and a single fp32 partial (kernels/mlp_block.py at split 1) is rounded
    here (a no-op for a rounded sum)."""
    y = sum_partials(part_ptr + row * stride_pm, offs, mask, stride_ps, SPLIT, x_out_ptr.dtype.element_ty, ".cg")
    y = y.to(x_out_ptr.dtype.element_ty)
    norm_pair_store(x, y, w1, w2, gw, gb, x_out_ptr + row * stride_xo, h_out_ptr + row * stride_ho, hazard_ptr + row,
                    offs, mask, hidden, eps, GATE)


def fits(device, config: gm.GemmConfig, n: int) -> bool:
    """Whether :func:`gemm_add_rms_norm` may run an ``n``-column launch on ``device`` with waiting programs: a grid
    of at most one program per SM on a CUDA device, so every program is resident at once, given the whole GPU (no
    other stream or MPS client holding SMs); anything goes on the CPU (the interpreter does not wait)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    programs = triton.cdiv(n, config.block_n) * config.split_k
    return programs <= gm.sm_count(device)


def gemm_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, config: gm.GemmConfig, residual: torch.Tensor,
                      w1: torch.Tensor, w2: torch.Tensor, eps: float, counters: torch.Tensor,
                      gate: tuple[torch.Tensor, torch.Tensor] | None = None, *, spin: bool | None = None):
    """``fused_ops.add_rms_norm(residual, gemm(x, weight, config), w1, w2, eps)`` in one launch (module docstring).

    Args:
        x: ``[M, K]`` bf16/fp16 (M <= 128); weight: ``[N, K]``, N = hidden; config: a pointer-load (``tma`` off)
        :class:`gemm.GemmConfig` with ``split_k > 1``; residual: ``[M, N]`` x's dtype, unit last stride; w1, w2:
        ``[N]`` norm weights (parameters: read after the PDL wait here); counters: :func:`new_counters` on x's
        device; gate: the exit gate's (weight ``[1, N]``, bias ``[1]``), as ``fused_ops.add_rms_norm_gate``;
        spin: the CUDA protocol (the last M programs wait and take a row each; default on CUDA only). Tests run it on
        the interpreter at M = 1, where the one waiting program is the last to arrive.

    Returns:
        (x_new, h), or (x_new, h, hazard [M] fp32) with ``gate``.

    Raises:
        ValueError: a TMA or split_k 1 config, more rows than the grid has programs, a grid larger than the
        GPU's SM count (:func:`fits`), a tensor of the wrong shape, stride or device, or ``spin`` on the
        interpreter with M > 1; else as ``gemm.gemm``.
    """
    if config.tma or config.split_k < 2:
        raise ValueError(f"gemm_add_rms_norm needs a pointer-load config with split_k > 1, got {config}")
    gm._validate(x, weight, config)
    m, k = x.shape
    n = weight.shape[0]
    programs = triton.cdiv(n, config.block_n) * config.split_k
    if m > programs:
        raise ValueError(f"{m} rows but {programs} programs: each of the last M programs takes one row")
    if not fits(x.device, config, n):
        raise ValueError(f"{programs} programs exceed the GPU's SM count: waiting programs could keep others off")
    if residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual must be [{m}, {n}] {x.dtype} with unit last stride on {x.device}, got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    check_vectors(x.device, n, w1=w1, w2=w2)
    if counters.dtype != torch.int32 or counters.numel() != 2 or counters.device != x.device:
        raise ValueError(f"counters must be new_counters({x.device}), got {counters.dtype} {tuple(counters.shape)} "
                         f"on {counters.device}")
    gw, gb = check_gate(*gate, n, x.device) if gate is not None else (w1, w1)
    spin = x.is_cuda if spin is None else spin
    if spin and not x.is_cuda and m > 1:
        raise ValueError("spin on the interpreter needs M = 1: its programs run one after another, so a program "
                         "that waits for a later one waits for ever")
    block_m = max(16, triton.next_power_of_2(m))
    tiles_per_split = triton.cdiv(triton.cdiv(k, config.block_k), config.split_k)
    part = torch.empty((config.split_k, m, n), device=x.device, dtype=torch.float32)
    x_new, h = torch.empty_like(residual), torch.empty_like(residual)
    hazard = torch.empty(m, device=x.device, dtype=torch.float32) if gate is not None else x_new
    use_pdl = config.pdl and pdl.active(x)
    stages = gm.num_stages_that_fit(config, block_m, x.device, 1, x.element_size())
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    _gemm_norm_kernel[grid](x, weight, part, residual, w1, w2, x_new, h, gw, gb, hazard, counters, m, n, k,
                            tiles_per_split, x.stride(0), weight.stride(0), part.stride(1), part.stride(0),
                            residual.stride(0), x_new.stride(0), h.stride(0), eps,
                            BLOCK_N=config.block_n, BLOCK_M=block_m, BLOCK_K=config.block_k,
                            BLOCK_H=triton.next_power_of_2(n), SPLIT=config.split_k,
                            EVEN=n % config.block_n == 0 and k % config.block_k == 0, DOT_FP32=not x.is_cuda,
                            PDL=pdl.mode(use_pdl, config.early_trigger), SPIN=spin, GATE=gate is not None,
                            PREFETCH_K=gm.prefetch_elements(config, k, use_pdl, x.element_size()),
                            **pdl.launch_options(use_pdl, num_warps=config.num_warps, num_stages=stages))
    return (x_new, h) if gate is None else (x_new, h, hazard)
