"""The second half of a decode layer as one persistent Gluon launch whose weight stream runs on across its stage
barriers: o_proj, its sandwich-norm step, gate_up with SwiGLU, down and its norm step. An experiment, timed by
kernels/bench/mlp_block.py against the five launches the fused loop runs; runtime/model.py does not use it.

Why: the loop loses about 2 us of weight streaming at every kernel boundary (kernels/results/README.md,
``read_floor`` and ``sync_cost``), and the Triton persistent form (kernels/mlp_block.py) could not carry weight
bytes across its grid barriers: registers were too few and an L2 prefetch is mostly evicted before it is read. A
weight never depends on an activation, so here each program walks *one* sequence of weight tiles through all
three projections (its o_proj tiles, then its gate_up tiles, then its down tiles) and keeps ``stages`` of them in
flight in a shared-memory ring (TMA copies, one mbarrier a slot) whatever stage it is computing. When a program
reaches a barrier the ring holds the next stage's first ``stages`` tiles (12 x 16 KB an SM is about 25 MB on 132
SMs, some 8 us of HBM time), so the memory stream runs on while the programs wait, norm and reload activations.

One program per SM (all resident for the whole launch), five stages:

- ``O``: o_proj in split-K units (64 rows x a quarter of K), program p takes units p, p + G, ...; fp32 partials
  ``[o_split, M, hidden]``;
- ``N1``: program m < M takes row m: x1 = x + RMSNorm(sum of partials; ln_in2), h1 = RMSNorm(x1; ln_post)
  (``fused_ops.norm_pair_store``'s roundings);
- ``U``: gate_up + SwiGLU, 64 gate rows and their 64 up rows a unit (two ring tiles a K step), contiguous units a
  program; stores act = silu(gate) * up (``wgmma_gemm``'s GLU roundings);
- ``D``: down as ``O`` over act; ``N2``: as ``N1`` into (x2, h2).

Activation tiles (``[BLOCK_M, block_k]``, rows past M read as zero) go through a second, small TMA ring that is
filled only after the barrier that publishes them. Grid barriers: every thread passes a CTA barrier, then thread 0
adds one to an arrival counter (release, GPU scope) and later spins until the counter shows every program
(acquire), and a proxy fence lets the TMA unit see what other programs stored. The int64 counters only grow, by G
a barrier, so a tensor used only with one grid size needs no reset (kernels/mlp_block.py's ``claim_counters``).

Each output element is one fp32 dot product over its K range in a fixed tile order, so rows are batch invariant;
they are not bitwise the five kernels' (the norm steps' sums reduce in another order; kernels/results/README.md).
Measured slower than those five launches (kernels/results/README.md, ``mlp_ring``): its weight stream runs at the
read floor, but its barriers (1.3 us each after the last arrival) and its norm steps (2.3 us chains on M programs)
sit on the critical path, and gate_up runs on 88 of the SMs. Gluon has no interpreter: this is exercised by an
sm_90 compile test on the CPU and by GPU runs of the bench and tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import pdl
from .fused_ops import check_gate
from .gemm import sm_count
from .mlp_block import claim_counters
from .wgmma_gemm import SHARED_LIMIT, _gdc_launch_dependents, _gdc_wait, _layout, _tma_load

MAX_M = 64
BARRIERS = 4        # arrival counters a launch uses: before N1, U, D and N2


@dataclass(frozen=True)
class RingConfig:
    """Tiles of :func:`mlp_ring` (never per M: batch invariance). ``block_n`` x ``block_k``: one ring tile (bf16);
    ``o_split`` / ``d_split``: o_proj's and down's K splits; ``stages``: weight tiles in flight a program;
    ``x_stages``: activation tiles in flight; ``num_warps``: 4 (one warpgroup)."""
    block_n: int = 64
    block_k: int = 128
    o_split: int = 4
    d_split: int = 4
    stages: int = 12
    x_stages: int = 4
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k", "o_split", "d_split", "stages", "x_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RingConfig.{name} must be a positive int, got {v!r}")
        if self.block_n != 64 or self.block_k not in (64, 128):
            raise ValueError(f"RingConfig needs block_n 64 (one warpgroup's MMA rows) and block_k 64 or 128, got "
                             f"{self.block_n} x {self.block_k}")
        if self.num_warps != 4:
            raise ValueError(f"RingConfig.num_warps must be 4, got {self.num_warps!r}")

    def smem_bytes(self, block_m: int, stages: int | None = None) -> int:
        """Shared memory of one program at ``block_m`` rows: the weight ring (``stages``, default the
        configuration's), the activation ring and their mbarriers."""
        stages = self.stages if stages is None else stages
        return 2 * self.block_k * (stages * self.block_n + self.x_stages * block_m) + 8 * (stages + self.x_stages)

    def stages_for(self, block_m: int) -> int:
        """``stages``, lowered until the program fits :data:`SHARED_LIMIT` at ``block_m`` rows (the ring's depth
        changes no bit). Raises ValueError when not even two weight tiles fit."""
        stages = self.stages
        while stages > 2 and self.smem_bytes(block_m, stages) > SHARED_LIMIT:
            stages -= 1
        if self.smem_bytes(block_m, stages) > SHARED_LIMIT:
            raise ValueError(f"{self} needs {self.smem_bytes(block_m, stages):,} bytes of shared memory at {block_m} "
                             f"rows, more than {SHARED_LIMIT:,}")
        return stages


# (hidden, intermediate) -> the RingConfig with which the fused decode loop runs this half of a layer as one launch
# (runtime/model.py ``OuroModel.ring_config``), at most MAX_M rows. Empty (off) until it is measured faster in the
# loop; the throughput probe's ``--mlp-ring`` puts ``RingConfig()`` here.
CONFIGS: dict[tuple[int, int], RingConfig] = {}


@gluon.jit
def _arrive(cnt_ptr, G, LEAN: gl.constexpr = False):
    """Every thread passes a CTA barrier (the program's stores come first), then one thread adds one to the counter
    (release, GPU scope) and returns, in that thread, the count :func:`_wait` must see: the next multiple of ``G``.
    As measured: thread 0 (the thread that issues the TMA copies), after a proxy fence and an acq_rel fence.
    ``LEAN`` (a timing switch, ``_diag`` 4; on an H100 bitwise the measured barriers and 1.4 us a launch faster, not
    under the GPU tests): thread 32 (warp 1), no fences."""
    if LEAN:
        return gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u64 old; .reg .u32 t; mov.u64 $0, 0; barrier.sync 0; mov.u32 t, %tid.x; "
            "setp.eq.u32 p, t, 32;\n"
            "@p atom.add.release.gpu.u64 old, [$1], 1;\n"
            "@p div.u64 old, old, $2; @p add.u64 old, old, 1; @p mul.lo.u64 $0, old, $2; }",
            "=l,l,l", [cnt_ptr, G.to(gl.int64)], dtype=gl.int64, is_pure=False, pack=1)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u64 old; .reg .u32 t; mov.u64 $0, 0; barrier.sync 0; mov.u32 t, %tid.x; "
        "setp.eq.u32 p, t, 0;\n"
        "@p fence.proxy.async.global; @p fence.acq_rel.gpu;\n"
        "@p atom.add.release.gpu.u64 old, [$1], 1;\n"
        "@p div.u64 old, old, $2; @p add.u64 old, old, 1; @p mul.lo.u64 $0, old, $2; }",
        "=l,l,l", [cnt_ptr, G.to(gl.int64)], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _wait(cnt_ptr, target, LEAN: gl.constexpr = False):
    """The thread that arrived spins until the counter reaches ``target`` (acquire); then every thread passes a CTA
    barrier and a proxy fence, so later TMA copies see what the counted programs stored before they arrived
    (``LEAN``: thread 32, as :func:`_arrive`)."""
    if LEAN:
        gl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .u64 v; .reg .u32 t; mov.u32 $0, 0; mov.u32 t, %tid.x; setp.eq.u32 p, t, 32;\n"
            "@!p bra DONE;\n"
            "SPIN: ld.acquire.gpu.u64 v, [$1]; setp.lt.u64 q, v, $2; @q bra SPIN;\n"
            "DONE: barrier.sync 0; fence.proxy.async.global; }",
            "=r,l,l", [cnt_ptr, target], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .u64 v; .reg .u32 t; mov.u32 $0, 0; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;\n"
            "@!p bra DONE;\n"
            "SPIN: ld.acquire.gpu.u64 v, [$1]; setp.lt.u64 q, v, $2; @q bra SPIN;\n"
            "DONE: barrier.sync 0; fence.proxy.async.global; }",
            "=r,l,l", [cnt_ptr, target], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _stamp(trace_ptr, p, i, TRACE: gl.constexpr):
    """With ``TRACE``: this program's %globaltimer (ns) at point ``i`` into ``trace[p, i]`` (timing diagnostics)."""
    if TRACE:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(trace_ptr + p * 16 + i, t)


@gluon.jit
def _issue(j, p, G, nO, nU, nD, lo_u, wo_desc, wgu_desc, wd_desc, w_smem, w_bar,
           HID: gl.constexpr, I: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, O_SPLIT: gl.constexpr,
           D_SPLIT: gl.constexpr, STAGES: gl.constexpr):
    """Start the TMA copy of this program's weight tile ``j`` (of its O, then U, then D tiles) into ring slot
    ``j % STAGES``; nothing past its last tile."""
    slot = j % STAGES
    TN: gl.constexpr = HID // BN
    if j < nO:
        TK_O: gl.constexpr = HID // O_SPLIT // BK
        u = p + (j // TK_O) * G
        mbarrier.expect(w_bar.index(slot), wo_desc.block_type.nbytes)
        _tma_load(wo_desc, [(u % TN) * BN, (u // TN) * (HID // O_SPLIT) + (j % TK_O) * BK], w_bar.index(slot),
                  w_smem.index(slot))
    elif j < nO + nU:
        jj = j - nO
        TK_U: gl.constexpr = HID // BK
        u = lo_u + jj // (2 * TK_U)
        r = jj % (2 * TK_U)
        mbarrier.expect(w_bar.index(slot), wgu_desc.block_type.nbytes)
        _tma_load(wgu_desc, [u * BN + (r % 2) * I, (r // 2) * BK], w_bar.index(slot), w_smem.index(slot))
    elif j < nO + nU + nD:
        jj = j - nO - nU
        TK_D: gl.constexpr = I // D_SPLIT // BK
        u = p + (jj // TK_D) * G
        mbarrier.expect(w_bar.index(slot), wd_desc.block_type.nbytes)
        _tma_load(wd_desc, [(u % TN) * BN, (u // TN) * (I // D_SPLIT) + (jj % TK_D) * BK], w_bar.index(slot),
                  w_smem.index(slot))


@gluon.jit
def _load_x(x_desc, x_smem, x_bar, i, k, pred, XS: gl.constexpr):
    slot = i % XS
    mbarrier.expect(x_bar.index(slot), x_desc.block_type.nbytes, pred)
    _tma_load(x_desc, [0, k], x_bar.index(slot), x_smem.index(slot), pred)


@gluon.jit
def _split_stage(x_desc, part_ptr, M, p, G, units, c, xi, k_lo, nk, stride_pm, stride_ps,
                 wo_desc, wgu_desc, wd_desc, w_smem, w_bar, x_smem, x_bar, nO, nU, nD, lo_u,
                 HID: gl.constexpr, I: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, BLOCK_M: gl.constexpr,
                 O_SPLIT: gl.constexpr, D_SPLIT: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                 XS: gl.constexpr, DIAG: gl.constexpr, num_warps: gl.constexpr):
    """O or D: this program's units p, p + G, ... (``units`` of them), ``nk`` K tiles each from K ``k_lo`` of its
    split, each storing an fp32 partial ``[M, BN]``. ``c`` / ``xi``: the weight and activation tiles consumed so
    far. Returns the new (c, xi)."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    TN: gl.constexpr = HID // BN
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, mma_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    for i in range(units):
        u = p + i * G
        row0 = (u % TN) * BN
        s = u // TN
        k0 = s * k_lo
        for t in gl.static_range(XS):
            _load_x(x_desc, x_smem, x_bar, xi + t, k0 + t * BK, t < nk, XS)
        acc = gl.zeros((BN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        for t in range(nk):
            slot = c % STAGES
            mbarrier.wait(w_bar.index(slot), (c // STAGES) & 1)
            xs = (xi + t) % XS
            mbarrier.wait(x_bar.index(xs), ((xi + t) // XS) & 1)
            if DIAG & 2 == 0:
                acc = warpgroup_mma(w_smem.index(slot), x_smem.index(xs).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _issue(c + STAGES, p, G, nO, nU, nD, lo_u, wo_desc, wgu_desc, wd_desc, w_smem, w_bar,
                   HID, I, BN, BK, O_SPLIT, D_SPLIT, STAGES)
            _load_x(x_desc, x_smem, x_bar, xi + t + XS, k0 + (t + XS) * BK, t + XS < nk, XS)
            c += 1
        xi += nk
        out = (part_ptr + s.to(gl.int64) * stride_ps + offs_m[None, :].to(gl.int64) * stride_pm
               + (row0 + offs_n)[:, None])
        gl.store(out, acc, mask=offs_m[None, :] < M)
    return c, xi


@gluon.jit
def _glu_stage(x_desc, act_ptr, M, p, G, lo_u, hi_u, c, xi, stride_a,
               wo_desc, wgu_desc, wd_desc, w_smem, w_bar, x_smem, x_bar, nO, nU, nD,
               HID: gl.constexpr, I: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, BLOCK_M: gl.constexpr,
               O_SPLIT: gl.constexpr, D_SPLIT: gl.constexpr, STAGES: gl.constexpr, XS: gl.constexpr,
               DIAG: gl.constexpr, num_warps: gl.constexpr):
    """U: units [lo_u, hi_u) of 64 gate columns, each K step a gate tile then its up tile; stores
    silu(gate) * up ``[M, BN]`` at ``act[:, u BN ..]``. Returns the new (c, xi)."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    NK: gl.constexpr = HID // BK
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, mma_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    dtype: gl.constexpr = act_ptr.dtype.element_ty
    for u in range(lo_u, hi_u):
        for t in gl.static_range(XS):
            _load_x(x_desc, x_smem, x_bar, xi + t, t * BK, t < NK, XS)
        acc = gl.zeros((BN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        acc_up = gl.zeros((BN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        for t in range(NK):
            xs = (xi + t) % XS
            mbarrier.wait(x_bar.index(xs), ((xi + t) // XS) & 1)
            xt = x_smem.index(xs).permute((1, 0))
            slot = c % STAGES
            mbarrier.wait(w_bar.index(slot), (c // STAGES) & 1)
            slot_up = (c + 1) % STAGES
            mbarrier.wait(w_bar.index(slot_up), ((c + 1) // STAGES) & 1)
            if DIAG & 2 == 0:
                acc = warpgroup_mma(w_smem.index(slot), xt, acc, is_async=True)
                acc_up = warpgroup_mma(w_smem.index(slot_up), xt, acc_up, is_async=True)
                acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
            _issue(c + STAGES, p, G, nO, nU, nD, lo_u, wo_desc, wgu_desc, wd_desc, w_smem, w_bar,
                   HID, I, BN, BK, O_SPLIT, D_SPLIT, STAGES)
            _issue(c + 1 + STAGES, p, G, nO, nU, nD, lo_u, wo_desc, wgu_desc, wd_desc, w_smem, w_bar,
                   HID, I, BN, BK, O_SPLIT, D_SPLIT, STAGES)
            _load_x(x_desc, x_smem, x_bar, xi + t + XS, (t + XS) * BK, t + XS < NK, XS)
            c += 2
        xi += NK
        g = acc.to(dtype).to(gl.float32)
        act = (g / (1.0 + gl.exp(-g))).to(dtype).to(gl.float32)
        out = act * acc_up.to(dtype).to(gl.float32)
        ptrs = act_ptr + offs_m[None, :].to(gl.int64) * stride_a + (u * BN + offs_n)[:, None]
        gl.store(ptrs, out.to(dtype), mask=offs_m[None, :] < M)
    return c, xi


@gluon.jit
def _norm_rows(part_ptr, res_ptr, w1_ptr, w2_ptr, x_out_ptr, h_out_ptr, gw_ptr, gb_ptr, hazard_ptr, M, p, G,
               stride_pm, stride_ps, stride_r, stride_o, eps, HID: gl.constexpr, SPLIT: gl.constexpr,
               GATE: gl.constexpr, num_warps: gl.constexpr):
    """N1 / N2: rows p, p + G, ... < M: x_new = res + RMSNorm(sum of partials; w1), h = RMSNorm(x_new; w2), and with
    ``GATE`` the exit gate's hazard on h, rounded as ``fused_ops.norm_pair_store`` rounds (the summed projection
    rounded to bf16 first). Its sums reduce in Gluon's order for this layout, not necessarily the add_rms_norm
    kernel's."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs = gl.arange(0, HID, layout=layout)
    dtype: gl.constexpr = x_out_ptr.dtype.element_ty
    for row in range(p, M, G):
        y = gl.load(part_ptr + row * stride_pm + offs, cache_modifier=".cg")
        for s in gl.static_range(1, SPLIT):
            y += gl.load(part_ptr + s * stride_ps + row * stride_pm + offs, cache_modifier=".cg")
        y = y.to(dtype).to(gl.float32)
        x = gl.load(res_ptr + row * stride_r + offs, cache_modifier=".cg").to(gl.float32)
        w1 = gl.load(w1_ptr + offs).to(gl.float32)
        w2 = gl.load(w2_ptr + offs).to(gl.float32)
        inv_y = 1.0 / gl.sqrt(gl.sum(y * y, axis=0) / HID + eps)
        normed = (w1 * (y * inv_y)).to(dtype).to(gl.float32)
        x_new = (x + normed).to(dtype)
        gl.store(x_out_ptr + row * stride_o + offs, x_new)
        xf = x_new.to(gl.float32)
        inv_x = 1.0 / gl.sqrt(gl.sum(xf * xf, axis=0) / HID + eps)
        h = (w2 * (xf * inv_x)).to(dtype)
        gl.store(h_out_ptr + row * stride_o + offs, h)
        if GATE:
            gw = gl.load(gw_ptr + offs).to(gl.float32)
            logit = (gl.sum(h.to(gl.float32) * gw, axis=0) + gl.load(gb_ptr).to(gl.float32)).to(dtype)
            gl.store(hazard_ptr + row, 1.0 / (1.0 + gl.exp(-logit.to(gl.float32))))


@gluon.jit
def _mlp_ring_kernel(wo_desc, wgu_desc, wd_desc, a_desc, h1_desc, act_desc,
                     x_ptr, ln_in2, ln_post, ln_post2, ln_next, part_o, x1_ptr, h1_ptr, act_ptr, part_d, x2_ptr,
                     h2_ptr, gw_ptr, gb_ptr, hazard_ptr, cnt_ptr, M, G, eps, stride_pm, stride_ps, stride_x, stride_a,
                     HID: gl.constexpr, I: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, BLOCK_M: gl.constexpr,
                     O_SPLIT: gl.constexpr, D_SPLIT: gl.constexpr, STAGES: gl.constexpr, XS: gl.constexpr,
                     PDL: gl.constexpr, GATE: gl.constexpr, num_warps: gl.constexpr, DIAG: gl.constexpr = 0,
                     trace_ptr=None, TRACE: gl.constexpr = False):
    p = gl.program_id(0)
    TN: gl.constexpr = HID // BN
    TK_O: gl.constexpr = HID // O_SPLIT // BK
    TK_D: gl.constexpr = I // D_SPLIT // BK
    units_o = (TN * O_SPLIT - p + G - 1) // G
    units_d = (TN * D_SPLIT - p + G - 1) // G
    lo_u = p * (I // BN) // G
    hi_u = (p + 1) * (I // BN) // G
    nO = units_o * TK_O
    nU = (hi_u - lo_u) * 2 * (HID // BK)
    nD = units_d * TK_D

    w_smem = gl.allocate_shared_memory(wo_desc.dtype, [STAGES, BN, BK], wo_desc.layout)
    x_smem = gl.allocate_shared_memory(a_desc.dtype, [XS, BLOCK_M, BK], a_desc.layout)
    w_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bar = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(w_bar.index(s), count=1)
    for s in gl.static_range(XS):
        mbarrier.init(x_bar.index(s), count=1)
    # Weights are written by no kernel: the ring fills before the PDL wait (kernels/pdl.py's rule).
    for j in gl.static_range(STAGES):
        _issue(j, p, G, nO, nU, nD, lo_u, wo_desc, wgu_desc, wd_desc, w_smem, w_bar,
               HID, I, BN, BK, O_SPLIT, D_SPLIT, STAGES)
    _stamp(trace_ptr, p, 0, TRACE)
    if PDL != 0:
        _gdc_wait()
    _stamp(trace_ptr, p, 1, TRACE)
    c = 0
    xi = 0
    c, xi = _split_stage(a_desc, part_o, M, p, G, units_o, c, xi, HID // O_SPLIT, TK_O, stride_pm, stride_ps,
                         wo_desc, wgu_desc, wd_desc, w_smem, w_bar, x_smem, x_bar, nO, nU, nD, lo_u,
                         HID, I, BN, BK, BLOCK_M, O_SPLIT, D_SPLIT, O_SPLIT, STAGES, XS, DIAG, num_warps)
    _stamp(trace_ptr, p, 2, TRACE)
    if DIAG & 1 == 0:
        _wait(cnt_ptr, _arrive(cnt_ptr, G, DIAG & 4 != 0), DIAG & 4 != 0)
        _stamp(trace_ptr, p, 3, TRACE)
        if DIAG & 8 == 0:
            _norm_rows(part_o, x_ptr, ln_in2, ln_post, x1_ptr, h1_ptr, gw_ptr, gb_ptr, hazard_ptr, M, p, G, stride_pm,
                       stride_ps, stride_x, stride_x, eps, HID, O_SPLIT, False, num_warps)
        _stamp(trace_ptr, p, 4, TRACE)
        _wait(cnt_ptr + 1, _arrive(cnt_ptr + 1, G, DIAG & 4 != 0), DIAG & 4 != 0)
    _stamp(trace_ptr, p, 5, TRACE)
    c, xi = _glu_stage(h1_desc, act_ptr, M, p, G, lo_u, hi_u, c, xi, stride_a,
                       wo_desc, wgu_desc, wd_desc, w_smem, w_bar, x_smem, x_bar, nO, nU, nD,
                       HID, I, BN, BK, BLOCK_M, O_SPLIT, D_SPLIT, STAGES, XS, DIAG, num_warps)
    _stamp(trace_ptr, p, 6, TRACE)
    if DIAG & 1 == 0:
        _wait(cnt_ptr + 2, _arrive(cnt_ptr + 2, G, DIAG & 4 != 0), DIAG & 4 != 0)
    _stamp(trace_ptr, p, 7, TRACE)
    if PDL != 0:
        _gdc_launch_dependents()       # every program has arrived, so every one is resident
    c, xi = _split_stage(act_desc, part_d, M, p, G, units_d, c, xi, I // D_SPLIT, TK_D, stride_pm, stride_ps,
                         wo_desc, wgu_desc, wd_desc, w_smem, w_bar, x_smem, x_bar, nO, nU, nD, lo_u,
                         HID, I, BN, BK, BLOCK_M, O_SPLIT, D_SPLIT, D_SPLIT, STAGES, XS, DIAG, num_warps)
    _stamp(trace_ptr, p, 8, TRACE)
    if DIAG & 1 == 0:
        target = _arrive(cnt_ptr + 3, G, DIAG & 4 != 0)
    if p < M and DIAG & 1 == 0:
        _wait(cnt_ptr + 3, target, DIAG & 4 != 0)
        _stamp(trace_ptr, p, 9, TRACE)
        if DIAG & 8 == 0:
            _norm_rows(part_d, x1_ptr, ln_post2, ln_next, x2_ptr, h2_ptr, gw_ptr, gb_ptr, hazard_ptr, M, p, G,
                       stride_pm, stride_ps, stride_x, stride_x, eps, HID, D_SPLIT, GATE, num_warps)
    _stamp(trace_ptr, p, 10, TRACE)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(w_bar.index(s))
    for s in gl.static_range(XS):
        mbarrier.invalidate(x_bar.index(s))


def new_counters(device) -> torch.Tensor:
    """The arrival counters of :func:`mlp_ring`: int64 [4], zero (allocate outside a graph capture)."""
    return torch.zeros(BARRIERS, dtype=torch.int64, device=device)


def check_config(config: RingConfig, hidden: int, inter: int) -> None:
    """ValueError naming the tile of ``config`` that does not divide a ``hidden`` x ``inter`` layer (no masks along N
    or K) or a hidden size the norm step's layout cannot hold."""
    if not isinstance(config, RingConfig):
        raise TypeError(f"config must be a RingConfig, got {type(config).__name__}")
    c = config
    for what, n, d in (("hidden", hidden, c.block_n), ("intermediate", inter, c.block_n),
                       ("hidden / o_split", hidden // c.o_split, c.block_k), ("hidden", hidden, c.o_split),
                       ("intermediate", inter, c.d_split), ("intermediate / d_split", inter // c.d_split, c.block_k),
                       ("hidden", hidden, c.block_k), ("hidden", hidden, 32 * c.num_warps)):
        if n % d:
            raise ValueError(f"{what}={n} is not a multiple of {d} ({config})")
    if hidden & (hidden - 1):
        raise ValueError(f"hidden must be a power of two (the norm step's layout), got {hidden}")


def mlp_ring(a: torch.Tensor, x: torch.Tensor, w_o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             ln_in2: torch.Tensor, ln_post: torch.Tensor, ln_post2: torch.Tensor, ln_next: torch.Tensor, eps: float,
             config: RingConfig, counters: torch.Tensor, gate: tuple[torch.Tensor, torch.Tensor] | None = None, *,
             _diag: int = 0, _trace: torch.Tensor | None = None):
    """``kernels.mlp_block.mlp_block_ref``'s (x2, h2) in one persistent launch (module docstring); never
    synchronises with the host.

    Args:
        a: ``[M, hidden]`` attention output, bf16, contiguous, 1 <= M <= :data:`MAX_M`, on a CUDA device of compute
        capability 9.0. x: ``[M, hidden]`` residual, bf16, contiguous. w_o ``[hidden, hidden]``, gate_up ``[2 I,
        hidden]`` (gate rows then up rows), down ``[hidden, I]``: bf16, contiguous. ln_*: ``[hidden]`` norm
        weights. eps: the norms' epsilon. config: :class:`RingConfig`. counters: :func:`new_counters`, used only
        with this device's grid (one program an SM). gate: the exit gate's (weight ``[1, hidden]``, bias ``[1]``):
        also return the hazard of h2 (``fused_ops.add_rms_norm_gate``). _diag: timing diagnostics only (wrong
        results): 1 skips the barriers and norm steps, 2 the MMAs (kernels/bench/mlp_block.py's ``ring:diag*``), 8
        the norm steps only (the barriers stay); 4 runs the barriers lean (:func:`_arrive`; the bench checks its
        bits).
        _trace: int64 ``[G, 16]``: each program's %globaltimer (ns) at its stage points (timing diagnostics).

    Returns:
        (x2, h2) ``[M, hidden]`` bf16, or (x2, h2, hazard [M] fp32) with ``gate``.

    Raises:
        TypeError / ValueError naming the bad argument (dtype, shape, device, M, tiles that do not divide the layer,
        an activation ring too large for an SM's shared memory, counters of another kind or grid).
    """
    m, hidden = x.shape
    inter = gate_up.shape[0] // 2
    for name, t in (("a", a), ("x", x), ("w_o", w_o), ("gate_up", gate_up), ("down", down)):
        if t.dtype != torch.bfloat16 or not t.is_cuda or t.device != a.device or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous bf16 CUDA tensor on a's device, got {t.dtype} on {t.device}")
    if not 1 <= m <= MAX_M or a.shape != (m, hidden):
        raise ValueError(f"a and x must be [M, hidden] with 1 <= M <= {MAX_M}, got {tuple(a.shape)}, {tuple(x.shape)}")
    for name, t, shape in (("w_o", w_o, (hidden, hidden)), ("gate_up", gate_up, (2 * inter, hidden)),
                           ("down", down, (hidden, inter))):
        if t.shape != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {tuple(t.shape)}")
    check_config(config, hidden, inter)
    c = config
    block_m = max(16, triton.next_power_of_2(m))
    stages = c.stages_for(block_m)
    if counters is None or counters.dtype != torch.int64 or counters.numel() != BARRIERS or counters.device != a.device:
        raise ValueError(f"counters must be new_counters({a.device})")
    g = sm_count(a.device)
    claim_counters(counters, g)
    part_o = torch.empty((c.o_split, m, hidden), device=a.device, dtype=torch.float32)
    part_d = torch.empty((c.d_split, m, hidden), device=a.device, dtype=torch.float32)
    x1, h1, x2, h2 = (torch.empty_like(x) for _ in range(4))
    act = torch.empty((m, inter), device=a.device, dtype=a.dtype)
    gw, gb = check_gate(*gate, hidden, a.device) if gate is not None else (ln_in2, ln_in2)
    hazard = torch.empty(m, device=a.device, dtype=torch.float32) if gate is not None else x2
    wl = _layout([c.block_n, c.block_k], a.dtype)
    xl = _layout([block_m, c.block_k], a.dtype)
    wo_d, wgu_d, wd_d = (TensorDescriptor.from_tensor(w, [c.block_n, c.block_k], wl) for w in (w_o, gate_up, down))
    a_d, h1_d, act_d = (TensorDescriptor.from_tensor(t, [block_m, c.block_k], xl) for t in (a, h1, act))
    use_pdl = pdl.active(a)
    _mlp_ring_kernel[(g,)](wo_d, wgu_d, wd_d, a_d, h1_d, act_d, x, ln_in2, ln_post, ln_post2, ln_next, part_o, x1,
                           h1, act, part_d, x2, h2, gw, gb, hazard, counters, m, g, eps, part_o.stride(1), part_o.stride(0),
                           x.stride(0), act.stride(0), hidden, inter, c.block_n, c.block_k, block_m, c.o_split,
                           c.d_split, stages, c.x_stages, pdl.mode(use_pdl), gate is not None, num_warps=c.num_warps,
                           DIAG=_diag, trace_ptr=_trace, TRACE=_trace is not None, **pdl.launch_options(use_pdl))
    return (x2, h2) if gate is None else (x2, h2, hazard)


def compile_sm90(config: RingConfig, block_m: int, use_pdl: bool = True, gate: bool = True, diag: int = 0):
    """The kernel :func:`mlp_ring` would launch for the Ouro layer (hidden 2048, intermediate 5632) at ``block_m``
    rows (``diag``: its ``_diag`` timing switches), compiled for sm_90 with Triton's own ptxas on any machine (no GPU
    needed): Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    c = config
    lw, lx = _layout([c.block_n, c.block_k], torch.bfloat16), _layout([block_m, c.block_k], torch.bfloat16)
    wd = f"tensordesc<bf16[{c.block_n}, {c.block_k}],{lw!r}>"
    xd = f"tensordesc<bf16[{block_m}, {c.block_k}],{lx!r}>"
    signature = dict(wo_desc=wd, wgu_desc=wd, wd_desc=wd, a_desc=xd, h1_desc=xd, act_desc=xd)
    signature.update({n: "*bf16" for n in ("x_ptr", "ln_in2", "ln_post", "ln_post2", "ln_next", "x1_ptr", "h1_ptr",
                                           "act_ptr", "x2_ptr", "h2_ptr", "gw_ptr", "gb_ptr")})
    signature.update(part_o="*fp32", part_d="*fp32", hazard_ptr="*fp32", trace_ptr="*i64", cnt_ptr="*i64", M="i32", G="i32", eps="fp32", stride_pm="i32",
                     stride_ps="i32", stride_x="i32", stride_a="i32")
    constexprs = dict(HID=2048, I=5632, BN=c.block_n, BK=c.block_k, BLOCK_M=block_m, O_SPLIT=c.o_split,
                      D_SPLIT=c.d_split, STAGES=c.stages_for(block_m), XS=c.x_stages, PDL=pdl.mode(use_pdl),
                      GATE=gate, num_warps=c.num_warps, DIAG=diag, TRACE=False)
    signature.update({k: "constexpr" for k in constexprs})
    order = list(_mlp_ring_kernel.arg_names)
    signature = {k: signature[k] for k in order}
    return triton.compile(GluonASTSource(_mlp_ring_kernel, signature, constexprs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=c.num_warps))
