"""The second half of a decode layer as one persistent launch (Triton): o_proj, its sandwich-norm step, gate_up with
SwiGLU, down and its norm step, separated by grid barriers instead of kernel boundaries. An experiment: measured
slower than the five launches the fused loop runs (below), so runtime/model.py does not use it.

Why try: the decode loop sits a fixed cost per kernel above its bytes' floor (about 2.7 us a kernel on the H200,
kernels/results/throughput_budget_5e7afa5.md), and this half of a layer is five kernels. In a stand-in of plain
weight streams a *split-phase* grid barrier (arrive, issue the next stage's first loads, then wait) hid a stage
boundary to 0.2-0.9 us against 2.2-4.4 us for a PDL kernel chain (kernels/results/sync_cost_split_h100_0e68d2e.md).

The launch has G programs (CUDA: ``programs_per_sm`` per SM, all resident for the whole launch) and five stages:

- ``O``: o_proj ``a @ w_o.T`` in split-K units (column tile t, split s), program p takes units p, p + G, ...;
  fp32 partials ``[O_SPLIT, M, hidden]`` (``gemm.gemm``'s parallel split-K, the same tiles in the same K order).
- ``N1``: program m takes row m (m, m + G, ...): x1 = x + RMSNorm(sum of partials; ln_in2), h1 = RMSNorm(x1;
  ln_post) (``gemm_norm._norm_row``, the code of ``fused_ops.add_rms_norm``).
- ``U``: gate_up and SwiGLU in column units of ``u_bn`` gate columns with their up rows; program p takes the
  contiguous units ``p U / G .. (p + 1) U / G`` (at most one more than any other program) as one loop over
  (unit, K tile), so its load pipeline does not drain between units.
- ``D``: down, as ``O`` over the activation; fp32 partials ``[D_SPLIT, M, hidden]``.
- ``N2``: as ``N1``: x2 = x1 + RMSNorm(sum; ln_post2), h2 = RMSNorm(x2; ln_next), and with ``gate`` the exit gate's
  hazard on h2 (``fused_ops.add_rms_norm_gate``).

Between O and N1, N1 and U, U and D, D and N2 every program arrives on an arrival counter (a release atomic add at
GPU scope after a CTA barrier: its stores come first) and waits until the counter shows every program of the launch
(an acquire spin). Between its arrival after O and its wait before U, and between its arrival after U and its wait
before D, a program asks L2 for the first ``pre_*`` K elements of its next unit's weight rows (``gemm._prefetch_l2``;
a weight is a parameter, which no stage writes); O's own comes before the PDL wait. A program without a row skips
the waits before N1 and N2 (it reads nothing those stages wrote until the next barrier). Loads of what another
program stored in this launch read past L1 (``.cg``). The four int64 counters only grow, by G a barrier, so a launch
of G programs finds each at a multiple of G as long as every launch on that counters tensor had G programs: the
launcher refuses a counters tensor last used with another grid (nothing to reset; no overflow in practice, 2^63).
The dependents are released (PDL, always the late trigger) after the barrier before D, when every program has
arrived somewhere and so is resident: a dependent's programs cannot take an SM a program of this launch still needs.
The launcher refuses a configuration whose ``programs_per_sm`` programs do not fit on one SM together.

Each unit's product runs its K tiles in order, one fixed order per weight shape and configuration, never per M,
so a row's result depends on that row alone (batch invariance as in kernels/gemm.py). ``staged``: the same code as
five launches, one stage each, without barriers, waits or prefetches: the Triton interpreter runs programs one after
another (a program waiting for a later one would wait for ever), so the interpreter tests run it staged, and a GPU
test holds the one launch bitwise equal to the staged one, and its first M rows to those of a 64-row batch.

Measured (kernels/bench/mlp_block.py, kernels/results/mlp_block_h100_*.md, H100): every configuration tried is
slower than the five-kernel PDL chain; each stage alone is slower than its tuned kernel, and the barriers win back
less than that. The L2 prefetch across a barrier changes nothing measurable; an earlier form that held each
stage's first 16-64 KB of weight in registers across the wait (the stand-in's method) was 0.43-0.79x (the
register tile must pass through shared memory to feed the MMA).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import gemm as gm
from . import pdl
from .fused_ops import check_gate, check_vectors
from .gemm_norm import _norm_row, _row_inputs

ALL = tl.constexpr(-1)          # the STAGE constexpr: every stage in one launch, barriers between them
O, N1, U, D, N2 = (tl.constexpr(i) for i in range(5))     # one stage a launch (``staged``)
BARRIERS = 4                    # arrival counters a launch uses: before N1, U, D and N2


@dataclass(frozen=True)
class MlpBlockConfig:
    """Tiles of :func:`mlp_block` for one layer shape (never per M: batch invariance).

    ``o_bn`` / ``d_bn``: weight rows per o_proj / down unit; ``o_split`` / ``d_split``: their K splits (fp32
    partials); ``u_bn``: gate columns per gate_up unit (the tile holds their up rows too: ``2 u_bn`` rows);
    ``block_k``: K elements per pipelined tile (``u_block_k``: gate_up's, default ``block_k``); ``pre_o`` / ``pre_u`` /
    ``pre_d``: K elements of each row of a program's first unit of the stage asked of L2 before it waits (0: none;
    at most the unit's K range); ``num_warps`` / ``num_stages``: as Triton's (change no bit); ``programs_per_sm``: the grid is this many programs
    an SM (each must fit beside the others: the launcher checks the compiled kernel's registers and shared memory).
    Every unit runs whole on one program, so the grid changes which program computes it, never a bit of it."""
    o_bn: int = 64
    o_split: int = 4
    u_bn: int = 32
    d_bn: int = 64
    d_split: int = 4
    block_k: int = 128
    pre_o: int = 256
    pre_u: int = 256
    pre_d: int = 256
    num_warps: int = 4
    num_stages: int = 4
    u_block_k: int | None = 256
    programs_per_sm: int = 1

    @property
    def block_k_u(self) -> int:
        return self.block_k if self.u_block_k is None else self.u_block_k

    def __post_init__(self):
        for name in ("o_bn", "u_bn", "d_bn", "block_k", "block_k_u"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        for name in ("o_split", "d_split", "num_warps", "num_stages", "programs_per_sm"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("pre_o", "pre_u", "pre_d"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0 or (v and (v < 64 or v & (v - 1))):
                raise ValueError(f"{name} must be 0 or a power of two >= 64 (128-byte lines), got {v!r}")


# The shapes measured (kernels/results/mlp_block_*; the fastest configuration there, still slower than the five
# kernels): (hidden, intermediate) -> config, and the most rows.
CONFIGS: dict[tuple[int, int], MlpBlockConfig] = {(2048, 5632): MlpBlockConfig()}
MAX_M = 64


@triton.jit
def arrive(cnt_ptr, G):
    """This program arrives on the grid barrier ``cnt_ptr`` (a CTA barrier, then a release atomic add at GPU scope:
    the program's earlier stores come first) and returns the count :func:`wait_arrived` must see: every one of the
    ``G`` programs of this use. The counter only grows, by G a use."""
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    return (old // G + 1) * G


@triton.jit
def wait_arrived(cnt_ptr, target):
    """Spin until the counter reaches ``target`` (acquire: stores the others made before they arrived are visible
    after it). Every program counted must be resident, or this waits for ever."""
    while tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _unit(w_ptr, rows, x_ptr, M, k0, k1, stride_w, stride_x, R: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """fp32 [R, BLOCK_M] = w[rows, k0:k1] @ x[:M, k0:k1].T, K tiles in order (pipelined). x rows past M load as
    zero; x is read past L1 (another program may have stored it in this launch)."""
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m[None, :] < M
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_x + (k0 + offs_k)[:, None]
    acc = tl.zeros((R, BLOCK_M), dtype=tl.float32)
    for _ in range(k0, k1, BLOCK_K):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=mask_m, other=0.0, cache_modifier=".cg")
        acc = _dot(w, x, acc, DOT_FP32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _dot(w, x, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:        # the interpreter's bf16 dot is wrong (BRIEF section 4)
        return tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, x, acc)


@triton.jit
def _split_rows(u, TN, BN: tl.constexpr, K, SPLIT: tl.constexpr):
    """Unit ``u`` of a split-K stage with ``TN`` column tiles: (its weight rows, split, k0, k1)."""
    t = u % TN
    s = u // TN
    span = K // SPLIT
    return t * BN + tl.arange(0, BN), s, s * span, s * span + span


@triton.jit
def _split_stage(w_ptr, x_ptr, part_ptr, M, K, stride_w, stride_x, stride_pm, stride_ps, N, G,
                 BN: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_FP32: tl.constexpr):
    """O or D: this program's units p, p + G, ..., each storing its fp32 partial [M, BN] at ``part[split, :, rows]``."""
    TN = N // BN
    offs_m = tl.arange(0, BLOCK_M)
    for u in range(tl.program_id(0), TN * SPLIT, G):
        rows, s, k0, k1 = _split_rows(u, TN, BN, K, SPLIT)
        acc = _unit(w_ptr, rows, x_ptr, M, k0, k1, stride_w, stride_x, BN, BLOCK_M, BLOCK_K, DOT_FP32)
        part = part_ptr + s.to(tl.int64) * stride_ps + offs_m[None, :].to(tl.int64) * stride_pm + rows[:, None]
        tl.store(part, acc, mask=offs_m[None, :] < M)


@triton.jit
def _split_prefetch(w_ptr, K, stride_w, N, BN: tl.constexpr, SPLIT: tl.constexpr, PRE: tl.constexpr):
    """Ask L2 for the first ``PRE`` K elements of this program's first unit of a split-K stage (none: PRE 0, or a
    program without a unit). Loads nothing (``gemm._prefetch_l2``); CUDA only."""
    TN = N // BN
    if PRE > 0:
        u = tl.program_id(0)
        if u < TN * SPLIT:
            gm._prefetch_l2(w_ptr, (u % TN) * BN, (u // TN) * (K // SPLIT), N, K, stride_w, BN, PRE)


@triton.jit
def _glu_range(I, G, BN: tl.constexpr):
    """This program's gate_up units [lo, hi) of I / BN: contiguous, at most one apart in count."""
    units = I // BN
    p = tl.program_id(0)
    return (p * units) // G, ((p + 1) * units) // G


@triton.jit
def _glu_prefetch(w_ptr, K, I, stride_w, G, BN: tl.constexpr, PRE: tl.constexpr):
    """Ask L2 for the first ``PRE`` K elements of this program's first gate_up unit, gate and up rows (none: PRE 0
    or no unit). Loads nothing; CUDA only."""
    lo, hi = _glu_range(I, G, BN)
    if PRE > 0:
        if lo < hi:
            gm._prefetch_l2(w_ptr, lo * BN, 0, 2 * I, K, stride_w, BN, PRE)
            gm._prefetch_l2(w_ptr, I + lo * BN, 0, 2 * I, K, stride_w, BN, PRE)


@triton.jit
def _glu_stage(w_ptr, x_ptr, act_ptr, M, K, I, stride_w, stride_x, stride_a, G, BN: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """U: this program's gate_up units as one loop over (unit, K tile), so the load pipeline runs on from one unit
    into the next (the flattened loop of Triton's persistent-matmul tutorial); at a unit's last K tile it stores
    silu(gate) * up [M, BN] (``gemm._swiglu``, rounded as gemm_swiglu rounds) at ``act[:, u BN ..]``. A tile holds
    the unit's BN gate rows and their BN up rows (``gemm._gemm_kernel``'s GLU layout)."""
    lo, hi = _glu_range(I, G, BN)
    KT = K // BLOCK_K
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m[None, :] < M
    offs_k = tl.arange(0, BLOCK_K)
    r = tl.arange(0, 2 * BN)
    unit_rows = ((r // BN) * I + r % BN).to(tl.int64)                  # gate rows, then the same up rows
    x_row = x_ptr + offs_m[None, :].to(tl.int64) * stride_x
    acc = tl.zeros((2 * BN, BLOCK_M), dtype=tl.float32)
    for it in range(lo * KT, hi * KT):
        u = it // KT
        k = (it % KT) * BLOCK_K
        w = tl.load(w_ptr + (unit_rows + u * BN)[:, None] * stride_w + (k + offs_k)[None, :])
        x = tl.load(x_row + (k + offs_k)[:, None], mask=mask_m, other=0.0, cache_modifier=".cg")
        acc = _dot(w, x, acc, DOT_FP32)
        if it % KT == KT - 1:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BN, BLOCK_M)), (1, 2, 0)))
            out = gm._swiglu(gate, up, act_ptr.dtype.element_ty)
            cols = u * BN + tl.arange(0, BN)
            tl.store(act_ptr + offs_m[None, :].to(tl.int64) * stride_a + cols[:, None],
                     out.to(act_ptr.dtype.element_ty), mask=mask_m)
            acc = tl.zeros((2 * BN, BLOCK_M), dtype=tl.float32)


@triton.jit
def _norm_stage(part_ptr, res_ptr, w1_ptr, w2_ptr, x_out_ptr, h_out_ptr, gw_ptr, gb_ptr, hazard_ptr, M, HID, G,
                stride_pm, stride_ps, stride_res, stride_xo, stride_ho, eps, cnt_ptr, target,
                BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, GATE: tl.constexpr, WAIT: tl.constexpr):
    """N1 or N2: rows p, p + G, ... (``gemm_norm._norm_row``: fused_ops.add_rms_norm of one row); with ``WAIT``, a
    program with a row waits for the barrier once its first row's other inputs are loaded."""
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < HID
    p = tl.program_id(0)
    if p < M:
        x, w1, w2, gw, gb = _row_inputs(p, res_ptr, w1_ptr, w2_ptr, gw_ptr, gb_ptr, offs_h, mask_h, stride_res, GATE)
        if WAIT:
            wait_arrived(cnt_ptr, target)
        _norm_row(p, x, w1, w2, gw, gb, part_ptr, x_out_ptr, h_out_ptr, hazard_ptr, offs_h, mask_h, HID, stride_pm,
                  stride_ps, stride_xo, stride_ho, eps, SPLIT, GATE)
    for row in range(p + G, M, G):
        x, w1, w2, gw, gb = _row_inputs(row, res_ptr, w1_ptr, w2_ptr, gw_ptr, gb_ptr, offs_h, mask_h, stride_res, GATE)
        _norm_row(row, x, w1, w2, gw, gb, part_ptr, x_out_ptr, h_out_ptr, hazard_ptr, offs_h, mask_h, HID, stride_pm,
                  stride_ps, stride_xo, stride_ho, eps, SPLIT, GATE)


@triton.jit(do_not_specialize=["M"])
def _mlp_block_kernel(a_ptr, x_ptr, wo_ptr, wgu_ptr, wd_ptr, ln_in2_ptr, ln_post_ptr, ln_post2_ptr, ln_next_ptr,
                      gw_ptr, gb_ptr, part_o_ptr, x1_ptr, h1_ptr, act_ptr, part_d_ptr, x2_ptr, h2_ptr, hazard_ptr,
                      cnt_ptr, M, G, eps, stride_a, stride_x, stride_h, stride_act, stride_pm, stride_ps,
                      HID: tl.constexpr, I: tl.constexpr, O_BN: tl.constexpr, O_SPLIT: tl.constexpr,
                      U_BN: tl.constexpr, D_BN: tl.constexpr, D_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_KU: tl.constexpr, BLOCK_H: tl.constexpr, PRE_O: tl.constexpr, PRE_U: tl.constexpr,
                      PRE_D: tl.constexpr, STAGE: tl.constexpr, GATE: tl.constexpr, PDL: tl.constexpr,
                      DOT_FP32: tl.constexpr):
    """Strides: a, x (residual, also x1 / x2: one layout), h (h1 / h2), act, and the partials (row, split) of
    both split-K stages (one layout, [SPLIT, M, HID] fp32 each). STAGE: :data:`ALL`, or the one stage to run."""
    BAR: tl.constexpr = STAGE == ALL
    CUDA: tl.constexpr = not DOT_FP32       # the L2 prefetches are inline PTX
    target = 0
    if STAGE == O or BAR:
        if CUDA:
            _split_prefetch(wo_ptr, HID, HID, HID, O_BN, O_SPLIT, PRE_O)
        pdl.wait(PDL)
        _split_stage(wo_ptr, a_ptr, part_o_ptr, M, HID, HID, stride_a, stride_pm, stride_ps, HID, G, O_BN, O_SPLIT,
                     BLOCK_M, BLOCK_K, DOT_FP32)
    if BAR:
        target = arrive(cnt_ptr, G)
        if CUDA:
            _glu_prefetch(wgu_ptr, HID, I, HID, G, U_BN, PRE_U)
    if STAGE == N1 or BAR:
        _norm_stage(part_o_ptr, x_ptr, ln_in2_ptr, ln_post_ptr, x1_ptr, h1_ptr, gw_ptr, gb_ptr, hazard_ptr, M, HID,
                    G, stride_pm, stride_ps, stride_x, stride_x, stride_h, eps, cnt_ptr, target, BLOCK_H, O_SPLIT,
                    False, BAR)
    if BAR:
        wait_arrived(cnt_ptr + 1, arrive(cnt_ptr + 1, G))
    if STAGE == U or BAR:
        _glu_stage(wgu_ptr, h1_ptr, act_ptr, M, HID, I, HID, stride_h, stride_act, G, U_BN, BLOCK_M, BLOCK_KU,
                   DOT_FP32)
    if BAR:
        target = arrive(cnt_ptr + 2, G)
        if CUDA:
            _split_prefetch(wd_ptr, I, I, HID, D_BN, D_SPLIT, PRE_D)
        wait_arrived(cnt_ptr + 2, target)
        pdl.release(PDL)            # every program has arrived, so every one is resident
    if STAGE == D or BAR:
        _split_stage(wd_ptr, act_ptr, part_d_ptr, M, I, I, stride_act, stride_pm, stride_ps, HID, G, D_BN, D_SPLIT,
                     BLOCK_M, BLOCK_K, DOT_FP32)
    if BAR:
        target = arrive(cnt_ptr + 3, G)
    if STAGE == N2 or BAR:
        _norm_stage(part_d_ptr, x1_ptr, ln_post2_ptr, ln_next_ptr, x2_ptr, h2_ptr, gw_ptr, gb_ptr, hazard_ptr, M,
                    HID, G, stride_pm, stride_ps, stride_x, stride_x, stride_h, eps, cnt_ptr + 3, target, BLOCK_H,
                    D_SPLIT, GATE, BAR)


def new_counters(device) -> torch.Tensor:
    """The arrival counters of :func:`mlp_block`: int64 [4], zero (allocate outside a graph capture; a launch leaves
    each at a multiple of its grid size, which is all the next one needs)."""
    return torch.zeros(BARRIERS, dtype=torch.int64, device=device)


def programs_for(device, programs_per_sm: int = 1) -> int:
    """The grid of :func:`mlp_block` on ``device``: ``programs_per_sm`` programs per SM on CUDA (each stays resident
    for the whole launch, given the whole GPU: no other stream or MPS client holding SMs); 8 on the CPU (the
    interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    return programs_per_sm * gm.sm_count(device)


def _stages_that_fit(c: MlpBlockConfig, block_m: int, a: torch.Tensor) -> int:
    """``c.num_stages``, lowered until the largest stage's pipeline (weight tile and x tile per stage) fits one
    program's shared memory (``gemm.num_stages_that_fit``, per stage; stages change no bit)."""
    tiles = (gm.GemmConfig(block_n=c.o_bn, block_k=c.block_k, num_stages=c.num_stages),
             gm.GemmConfig(block_n=2 * c.u_bn, block_k=c.block_k_u, num_stages=c.num_stages),
             gm.GemmConfig(block_n=c.d_bn, block_k=c.block_k, num_stages=c.num_stages))
    return min(gm.num_stages_that_fit(t, block_m, a.device, 1, a.element_size()) for t in tiles)


_RESIDENT: dict = {}


def _check_resident(kernel, args, grid: int, meta: dict, options: dict, per_sm: int, device) -> None:
    """ValueError unless ``per_sm`` programs of the compiled kernel fit on one SM at once (registers, shared
    memory, threads): a barrier whose programs are not all resident waits for ever. Compiles without launching."""
    key = (per_sm, device.index, tuple(sorted(meta.items())), tuple(sorted(options.items())))
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=(grid,), **meta, **options)
        compiled._init_handles()        # loads the module: n_regs is known from here (Triton 3.x)
        props = torch.cuda.get_device_properties(device)
        threads = 32 * options["num_warps"]
        # as the hardware allocates: registers per thread in steps of 8, a warp's in steps of 256 (sm_90), and 1 KB
        # of shared memory a block reserved beside what the kernel asks for (CUDA occupancy calculator's rules)
        warp_regs = -(-(-(-compiled.n_regs // 8) * 8 * 32) // 256) * 256
        regs = warp_regs * options["num_warps"] * per_sm
        shared = (compiled.metadata.shared + 1024) * per_sm
        fits = (regs <= getattr(props, "regs_per_multiprocessor", 65536)
                and shared <= getattr(props, "shared_memory_per_multiprocessor", 233472)
                and threads * per_sm <= props.max_threads_per_multi_processor)
        _RESIDENT[key] = None if fits else (f"{per_sm} programs of {compiled.n_regs} registers x {threads} threads "
                                            f"and {compiled.metadata.shared} bytes of shared memory do not fit on one SM")
    if _RESIDENT[key] is not None:
        raise ValueError(_RESIDENT[key])


_COUNTERS_GRID: dict[int, int] = {}        # id of a live counters tensor -> its grid (dropped when it is freed)


def claim_counters(counters: torch.Tensor, grid: int) -> None:
    """Record that ``counters`` serves launches of ``grid`` programs; ValueError if it served another grid: its
    counts would then not be at a multiple of this grid, and a barrier would let programs through early or never
    (module docstring). Host bookkeeping only (no read of the tensor)."""
    if id(counters) not in _COUNTERS_GRID:
        _COUNTERS_GRID[id(counters)] = grid
        weakref.finalize(counters, _COUNTERS_GRID.pop, id(counters), None)
    used = _COUNTERS_GRID[id(counters)]
    if used != grid:
        raise ValueError(f"these counters served launches of {used} programs; a launch of {grid} programs "
                         f"(another programs_per_sm) needs its own new_counters()")


def check_config(config: MlpBlockConfig, hidden: int, inter: int) -> None:
    """ValueError naming the tile of ``config`` that does not divide a ``hidden`` x ``inter`` layer (the kernel has
    no masks along N or K), or a head longer than its unit's K range."""
    if not isinstance(config, MlpBlockConfig):
        raise TypeError(f"config must be an MlpBlockConfig, got {type(config).__name__}")
    if hidden < 1 or inter < 1:
        raise ValueError(f"hidden and intermediate must be positive, got {hidden} and {inter}")
    c = config
    for what, n, d in (("hidden", hidden, c.o_bn), ("hidden", hidden, c.d_bn), ("intermediate", inter, c.u_bn),
                       ("hidden", hidden, c.o_split), ("hidden / o_split", hidden // c.o_split, c.block_k),
                       ("intermediate", inter, c.d_split), ("intermediate / d_split", inter // c.d_split, c.block_k),
                       ("hidden", hidden, c.block_k), ("hidden", hidden, c.block_k_u)):
        if n % d:
            raise ValueError(f"{what}={n} is not a multiple of {d} ({config})")
    for name, pre, span in (("pre_o", c.pre_o, hidden // c.o_split), ("pre_u", c.pre_u, hidden),
                            ("pre_d", c.pre_d, inter // c.d_split)):   # a line past the range is another unit's
        if pre > span:
            raise ValueError(f"{name}={pre} exceeds its unit's K range {span} ({config})")


def mlp_block(a: torch.Tensor, x: torch.Tensor, w_o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              ln_in2: torch.Tensor, ln_post: torch.Tensor, ln_post2: torch.Tensor, ln_next: torch.Tensor, eps: float,
              config: MlpBlockConfig, counters: torch.Tensor | None = None,
              gate: tuple[torch.Tensor, torch.Tensor] | None = None, *, staged: bool | None = None,
              only: tuple[int, ...] | None = None):
    """The layer after attention: ``x1, h1 = add_rms_norm(x, a @ w_o.T, ln_in2, ln_post)``, ``act = silu(h1 @
    gate.T) * (h1 @ up.T)``, ``x2, h2 = add_rms_norm(x1, act @ down.T, ln_post2, ln_next)`` (BRIEF section 1's
    sandwich norms; runtime/model.py ``run_loop``), in one launch (module docstring); never synchronises with the host.

    Args:
        a: ``[M, H D]`` attention output, bf16/fp16, 1 <= M <= :data:`MAX_M`, unit last stride. x: ``[M, hidden]``
        residual, a's dtype, contiguous. eps: the norms' epsilon, finite, >= 0. w_o ``[hidden, H D]`` (H D = hidden), gate_up ``[2 I, hidden]`` (gate
        rows then up rows), down ``[hidden, I]``: contiguous, a's dtype and device. ln_*: ``[hidden]`` norm weights.
        config: :class:`MlpBlockConfig` (:data:`CONFIGS`). counters: :func:`new_counters` on a's device (CUDA,
        one launch at a time per tensor, every launch with the same grid: :func:`claim_counters`). gate: the exit gate's (weight ``[1, hidden]``, bias ``[1]``): also return
        the hazard of h2. staged: five launches without barriers (default: on the CPU, for the interpreter).
        only: with ``staged``, launch only these stages (a non-empty sequence of :data:`O` .. :data:`N2` or their
        values 0 .. 4; to time a stage alone: what the others write is left unset).

    Returns:
        (x2, h2) ``[M, hidden]`` in a's dtype, or (x2, h2, hazard [M] fp32) with ``gate``.

    Raises:
        TypeError / ValueError naming the bad argument (dtype, shape, stride, device, M out of range, eps, tiles that
        do not divide the layer, counters missing, of the wrong kind or last used with another grid, programs that
        cannot all be resident at once).
    """
    m, hidden = x.shape if x.dim() == 2 else (0, 0)
    inter = gate_up.shape[0] // 2
    for name, t in (("a", a), ("x", x), ("w_o", w_o), ("gate_up", gate_up), ("down", down)):
        if t.dtype not in gm.DTYPES or t.dtype != a.dtype or t.device != a.device:
            raise TypeError(f"{name} must be bfloat16 or float16 like a ({a.dtype} on {a.device}), got {t.dtype} on "
                            f"{t.device}")
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} must be 2-D with unit last stride, got {tuple(t.shape)} strides {t.stride()}")
    if not x.is_contiguous():       # x1, x2 are written, and x1 read, with x's row stride
        raise ValueError(f"x must be contiguous, got strides {x.stride()}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not 1 <= m <= MAX_M or a.shape != (m, hidden):
        raise ValueError(f"a and x must be [M, hidden] with 1 <= M <= {MAX_M}, got {tuple(a.shape)} and "
                         f"{tuple(x.shape)}")
    for name, t, shape in (("w_o", w_o, (hidden, hidden)), ("gate_up", gate_up, (2 * inter, hidden)),
                           ("down", down, (hidden, inter))):
        if t.shape != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {list(shape)}, got {tuple(t.shape)} strides {t.stride()}")
    check_vectors(a.device, hidden, ln_in2=ln_in2, ln_post=ln_post, ln_post2=ln_post2, ln_next=ln_next)
    for name, t in (("ln_in2", ln_in2), ("ln_post", ln_post), ("ln_post2", ln_post2), ("ln_next", ln_next)):
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if gate is not None and (not isinstance(gate, (tuple, list)) or len(gate) != 2
                             or not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in gate)):
        raise TypeError(f"gate must be (weight, bias), two floating-point tensors, got {gate!r}")
    check_config(config, hidden, inter)
    staged = not a.is_cuda if staged is None else staged
    if not staged and (counters is None or counters.dtype != torch.int64 or counters.numel() != BARRIERS
                       or counters.device != a.device):
        raise ValueError(f"one launch needs counters=new_counters({a.device}), got "
                         f"{None if counters is None else (counters.dtype, tuple(counters.shape), counters.device)}")
    if not staged and not a.is_cuda:
        raise ValueError("one launch needs CUDA: on the interpreter a waiting program waits for ever (staged=True)")
    gw, gb = check_gate(*gate, hidden, a.device) if gate is not None else (ln_in2, ln_in2)
    c = config
    block_m = max(16, triton.next_power_of_2(m))
    part_o = torch.empty((c.o_split, m, hidden), device=a.device, dtype=torch.float32)   # one layout for both
    part_d = torch.empty((c.d_split, m, hidden), device=a.device, dtype=torch.float32)
    x1, h1, x2, h2 = (torch.empty_like(x) for _ in range(4))
    act = torch.empty((m, inter), device=a.device, dtype=a.dtype)
    hazard = torch.empty(m, device=a.device, dtype=torch.float32) if gate is not None else x2
    g = programs_for(a.device, c.programs_per_sm)
    use_pdl = pdl.active(a) and not staged
    # always the late trigger, after every program has arrived: an early one could let a dependent's programs take
    # the SMs a program of this launch still needs, and the barriers would wait for ever
    pdl_mode = int(pdl.LATE.value) if use_pdl else 0
    args = (a, x, w_o, gate_up, down, ln_in2, ln_post, ln_post2, ln_next, gw, gb, part_o, x1, h1, act, part_d, x2, h2,
            hazard, counters if counters is not None else x, m, g, eps, a.stride(0), x.stride(0), h1.stride(0),
            act.stride(0), part_o.stride(1), part_o.stride(0))
    meta = dict(HID=hidden, I=inter, O_BN=c.o_bn, O_SPLIT=c.o_split, U_BN=c.u_bn, D_BN=c.d_bn, D_SPLIT=c.d_split,
                BLOCK_M=block_m, BLOCK_K=c.block_k, BLOCK_KU=c.block_k_u, BLOCK_H=triton.next_power_of_2(hidden), PRE_O=c.pre_o,
                PRE_U=c.pre_u, PRE_D=c.pre_d, GATE=gate is not None, DOT_FP32=not a.is_cuda)
    stages = [s.value for s in (O, N1, U, D, N2)] if staged else [ALL.value]
    if only is not None:
        chosen = [getattr(s, "value", s) for s in only] if isinstance(only, (tuple, list)) else None
        if not staged or not chosen or not set(chosen) <= set(stages):
            raise ValueError(f"only needs staged=True and a non-empty sequence of stages among {stages}, got {only!r}")
        stages = [s for s in stages if s in chosen]
    options = pdl.launch_options(use_pdl, num_warps=c.num_warps, num_stages=_stages_that_fit(c, block_m, a))
    if not staged:
        claim_counters(counters, g)
        _check_resident(_mlp_block_kernel, args, g, dict(meta, STAGE=ALL.value, PDL=pdl_mode), options,
                        c.programs_per_sm, a.device)
    for stage in stages:
        _mlp_block_kernel[(g,)](*args, STAGE=stage, PDL=pdl_mode, **meta, **options)
    return (x2, h2) if gate is None else (x2, h2, hazard)


def mlp_block_ref(a, x, w_o, gate_up, down, ln_in2, ln_post, ln_post2, ln_next, eps, gate=None):
    """Torch reference of :func:`mlp_block` (fp32 products, rounding to a's dtype where the kernels store):
    (x2, h2) or (x2, h2, hazard)."""
    from .fused_ops import add_rms_norm_gate_ref, add_rms_norm_ref, silu_mul_ref
    f = torch.float32
    o = (a.to(f) @ w_o.to(f).T).to(a.dtype)
    x1, h1 = add_rms_norm_ref(x, o, ln_in2, ln_post, eps)[:2]
    gu = (h1.to(f) @ gate_up.to(f).T).to(a.dtype)
    act = silu_mul_ref(gu)
    y = (act.to(f) @ down.to(f).T).to(a.dtype)
    if gate is None:
        return add_rms_norm_ref(x1, y, ln_post2, ln_next, eps)[:2]
    return add_rms_norm_gate_ref(x1, y, ln_post2, ln_next, eps, *gate)
