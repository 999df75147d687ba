"""Small-M GEMM in Gluon whose weight tiles start streaming into shared memory before the PDL wait.

The decode loop's projections are weight streams of 8-47 MB (bf16 ``[N, K]`` against ``M`` <= 64 rows), and each
launch of :func:`kernels.gemm.gemm` sits 2.3-3.7 us above its bytes' floor however it is configured
(kernels/results/throughput_budget_5e7afa5.md): the stream restarts from nothing at every kernel boundary.
Triton's ``tl`` kernels can only ask L2 for weight before their PDL wait, and a prefetched region is mostly gone
from L2 by the time it is read (kernels/results/README.md, ``l2_prefetch``). Here every program issues TMA copies of
its first ``pre`` weight tiles into its own shared-memory pipeline, each with its own mbarrier, *before*
``griddepcontrol.wait``; only the activation tiles (which the kernel before may write) wait. Under PDL a program
that becomes resident while the previous kernel's last programs still run so fills that kernel's tail with its own
weight bytes, and those bytes stay where the MMA reads them.

The arithmetic is :func:`kernels.gemm.gemm`'s tile for tile: the weight tile is the warpgroup MMA's wide side (swap
AB: ``acc[BLOCK_N, BLOCK_M] += W[BLOCK_N, BLOCK_K] @ x[BLOCK_M, BLOCK_K].T``), fp32 accumulation over K tiles in
order, split-K ranges stored as fp32 partials, one rounding otherwise. A row's result depends on neither M nor
the other rows (each output element is one dot product over K in a fixed tile order), so it is batch invariant.

Gluon is Triton's experimental tile language (``triton.experimental.gluon``); it has no interpreter, so this
module is exercised by an sm_90 compile test on the CPU and by GPU tests.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from loopbench.kernels import pdl

MAX_M = 64          # the MMA's narrow side (BLOCK_M) is at most 64 rows here
SHARED_LIMIT = 227 * 1024       # the most shared memory one program may take on an H100 / H200 (CUDA C++ Guide)

# The TMA copy into shared memory is ``tma.async_copy_global_to_shared`` in Triton 3.6 (the GPU machine's) and
# ``tma.async_load`` from 3.7 on (the CI's 3.9 refuses the old name).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@dataclass(frozen=True)
class WgmmaConfig:
    """Launch configuration for one weight shape (never per M: batch invariance).

    ``block_n`` / ``block_k``: weight rows and K elements per tile (powers of two, ``block_n`` in 64..256,
    ``block_k`` in 64..256, 128-byte swizzled rows); ``split_k``: contiguous K ranges with their own fp32
    partials; ``stages``: shared-memory pipeline depth (weight and activation tiles); ``pre``: how many of
    the first weight tiles each program issues before its PDL wait (0..stages; changes no bit); ``pdl``:
    launch with programmatic dependent launch (CUDA, sm_90); ``early_trigger``: release the next kernel right
    after the wait instead of after the K loop.
    """
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    stages: int = 4
    pre: int = 4
    num_warps: int = 4
    pdl: bool = True
    early_trigger: bool = False

    def __post_init__(self):
        def whole(name: str) -> int:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"WgmmaConfig.{name} must be an int, got {v!r}")
            return v
        for name, lo, hi in (("block_n", 64, 256), ("block_k", 64, 256)):
            v = whole(name)
            if not lo <= v <= hi or v & (v - 1):
                raise ValueError(f"WgmmaConfig.{name} must be a power of two in {lo}..{hi}, got {v!r}")
        if whole("split_k") < 1:
            raise ValueError(f"WgmmaConfig.split_k must be an int >= 1, got {self.split_k!r}")
        if not 1 <= whole("stages") <= 8:
            raise ValueError(f"WgmmaConfig.stages must be an int in 1..8, got {self.stages!r}")
        if not 0 <= whole("pre") <= self.stages:
            raise ValueError(f"WgmmaConfig.pre must be an int in 0..stages ({self.stages}), got {self.pre!r}")
        if whole("num_warps") not in (4, 8):
            raise ValueError(f"WgmmaConfig.num_warps must be 4 or 8, got {self.num_warps!r}")
        for name in ("pdl", "early_trigger"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"WgmmaConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def smem_bytes(self, block_m: int, glu: bool = False) -> int:
        """Shared memory of one program: the pipeline's weight (two tiles a stage with ``glu``) and activation
        tiles (bf16) and 2 mbarriers a stage. Triton may add a little for the epilogue's layout conversion."""
        return self.stages * (2 * self.block_k * ((2 if glu else 1) * self.block_n + block_m) + 16)

    def check_fits(self, block_m: int, glu: bool = False) -> None:
        """ValueError naming the configuration when one program's pipeline (:meth:`smem_bytes`) exceeds the
        :data:`SHARED_LIMIT` an H100 / H200 program may take (the kernel could not launch)."""
        need = self.smem_bytes(block_m, glu)
        if need > SHARED_LIMIT:
            raise ValueError(f"{self} needs {need:,} bytes of shared memory a program at {block_m} rows"
                             f"{' with SwiGLU' if glu else ''}, more than the {SHARED_LIMIT:,} an sm_90 program may "
                             f"take: fewer stages, or a smaller block_n / block_k")


def parse_overrides(text: str) -> dict[str, int | bool]:
    """``"FIELD=VALUE,..."`` over :class:`WgmmaConfig`'s fields (an int, or for ``pdl`` / ``early_trigger`` true,
    false, 1 or 0) -> {field: value}, checked by building the configuration; ``""`` -> {}. Raises ValueError naming
    the bad part (the throughput probe's ``--wgmma`` and kernels/bench/wgmma_gemm.py's variants)."""
    flags = {f.name for f in dataclasses.fields(WgmmaConfig) if f.type in ("bool", bool)}
    fields = [f.name for f in dataclasses.fields(WgmmaConfig)]
    out: dict[str, int | bool] = {}
    for part in filter(None, text.split(",")):
        name, eq, raw = part.partition("=")
        if name not in fields or not eq:
            raise ValueError(f"{part!r} is not FIELD=VALUE over {', '.join(fields)}")
        if name in flags:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{name} must be true or false, got {raw!r}")
            out[name] = raw.lower() in ("true", "1")
            continue
        try:
            out[name] = int(raw)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    WgmmaConfig(**out)
    return out


# Plain projections (weight shape [N, K]) that run here instead of on kernels/gemm.py wherever the model would run
# ``gemm.gemm`` (runtime/model.py ``OuroModel._project``) at most MAX_M rows with no L2 prefetch asked for. o_proj
# and down, at gemm.CONFIGS' split_k (so the same partials, bitwise), releasing their dependents early. Chosen from
# kernels/results/wgmma_gemm_h100_88a5fb5.md (each the fastest variant of its shape in a chain: o_proj 1.14-1.16x,
# down 1.05-1.08x of gemm.gemm) and kept for the decode loop (wgmma_probe_h100_88a5fb5.log: with gate_up +
# SwiGLU releasing early, ``gemm.SWIGLU_CONFIGS``, 1.020-1.025x tok/s at B16/C32 and 1.030x at B32/C64 on an H100).
CONFIGS: dict[tuple[int, int], WgmmaConfig] = {
    (2048, 2048): WgmmaConfig(block_n=128, block_k=128, split_k=4, stages=3, pre=3, early_trigger=True),  # o_proj
    (2048, 5632): WgmmaConfig(block_n=64, block_k=128, split_k=4, stages=6, pre=6, early_trigger=True),   # down
}
# gate_up weights ([2 I, K]) whose SwiGLU projection runs on :func:`gemm_swiglu` wherever the model would run
# ``gemm.gemm_swiglu`` at most MAX_M rows with no L2 prefetch asked for. Empty: in the loop it was no faster than
# ``gemm.gemm_swiglu`` releasing early (wgmma_probe_h100_88a5fb5.log, the ``$G`` rows); the probe's ``--wgmma swiglu:``.
SWIGLU_CONFIGS: dict[tuple[int, int], WgmmaConfig] = {}


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _load_w(w_desc, w_smem, w_bar, slot, row0, k, pred, up_row0, GLU: gl.constexpr):
    """The slot's weight tile (and with GLU its up tile, rows from ``up_row0``) on one mbarrier."""
    mbarrier.expect(w_bar.index(slot), w_desc.block_type.nbytes * (2 if GLU else 1), pred)
    _tma_load(w_desc, [row0, k], w_bar.index(slot), w_smem.index(2 * slot if GLU else slot), pred)
    if GLU:
        _tma_load(w_desc, [up_row0, k], w_bar.index(slot), w_smem.index(2 * slot + 1), pred)


@gluon.jit
def _load_x(x_desc, x_smem, x_bar, slot, k, pred):
    mbarrier.expect(x_bar.index(slot), x_desc.block_type.nbytes, pred)
    _tma_load(x_desc, [0, k], x_bar.index(slot), x_smem.index(slot), pred)


@gluon.jit
def _wgmma_gemm_kernel(w_desc, x_desc, out_ptr, M, N, K, tiles_per_split, stride_om, stride_os,
                       BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                       STAGES: gl.constexpr, PRE: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
                       GLU: gl.constexpr = False):
    """One program: weight rows ``[pid_n * BLOCK_N, +BLOCK_N)`` over split ``program_id(1)``'s K tiles.
    ``PDL``: 0, :data:`pdl.LATE` or :data:`pdl.EARLY` (:func:`kernels.pdl.mode`). ``GLU``: the weight holds N gate
    rows then N up rows, and the program stores silu(gate) * up (:func:`kernels.gemm._swiglu`'s roundings)."""
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    lo = split * tiles_per_split
    num_tiles = gl.minimum(tiles_per_split, gl.cdiv(K, BLOCK_K) - lo)
    k0 = lo * BLOCK_K
    row0 = pid_n * BLOCK_N

    up_row0 = N + row0
    W_TILES: gl.constexpr = 2 * STAGES if GLU else STAGES
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [W_TILES, BLOCK_N, BLOCK_K], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(w_bar.index(s), count=1)
        mbarrier.init(x_bar.index(s), count=1)

    # Weights are written by no kernel, so their copies may start before the wait (kernels/pdl.py's rule).
    for s in gl.static_range(PRE):
        _load_w(w_desc, w_smem, w_bar, s, row0, k0 + s * BLOCK_K, s < num_tiles, up_row0, GLU)
    if PDL != 0:
        _gdc_wait()
    if PDL == pdl.EARLY:
        _gdc_launch_dependents()
    for s in gl.static_range(PRE, STAGES):
        _load_w(w_desc, w_smem, w_bar, s, row0, k0 + s * BLOCK_K, s < num_tiles, up_row0, GLU)
    for s in gl.static_range(STAGES):
        _load_x(x_desc, x_smem, x_bar, s, k0 + s * BLOCK_K, s < num_tiles)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
    acc_up = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
    for i in range(num_tiles):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(w_bar.index(slot), phase)
        mbarrier.wait(x_bar.index(slot), phase)
        xt = x_smem.index(slot).permute((1, 0))
        if GLU:
            acc = warpgroup_mma(w_smem.index(2 * slot), xt, acc, is_async=True)
            acc_up = warpgroup_mma(w_smem.index(2 * slot + 1), xt, acc_up, is_async=True)
            acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
        else:
            acc = warpgroup_mma(w_smem.index(slot), xt, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # The slot's MMA is done, so its buffers take the tile STAGES ahead.
        nxt = i + STAGES
        _load_w(w_desc, w_smem, w_bar, slot, row0, k0 + nxt * BLOCK_K, nxt < num_tiles, up_row0, GLU)
        _load_x(x_desc, x_smem, x_bar, slot, k0 + nxt * BLOCK_K, nxt < num_tiles)
    if PDL == pdl.LATE:
        _gdc_launch_dependents()
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(w_bar.index(s))
        mbarrier.invalidate(x_bar.index(s))

    if GLU:
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        g = acc.to(dtype).to(gl.float32)
        act = (g / (1.0 + gl.exp(-g))).to(dtype).to(gl.float32)
        acc = act * acc_up.to(dtype).to(gl.float32)
    offs_n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    out = (out_ptr + split.to(gl.int64) * stride_os + offs_m[None, :].to(gl.int64) * stride_om
           + offs_n[:, None])
    gl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))


def block_m_for(m: int) -> int:
    """The MMA's narrow side for ``m`` rows: 16, 32 or 64 (rows past ``m`` are read as zero, never stored).
    Raises ValueError outside 1..:data:`MAX_M`."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"wgmma_gemm takes 1..{MAX_M} rows, got {m}")
    return max(16, triton.next_power_of_2(m))


def _validate(x: torch.Tensor, weight: torch.Tensor, config: WgmmaConfig, glu: bool = False) -> None:
    if not isinstance(config, WgmmaConfig):
        raise TypeError(f"config must be a WgmmaConfig, got {type(config).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise TypeError(f"x and weight must be bf16 or fp16 of one dtype, got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"K must be >= 1, got x {tuple(x.shape)}")
    if not (x.is_cuda and weight.device == x.device):
        raise ValueError(f"wgmma_gemm runs on one CUDA device, got x on {x.device} and weight on {weight.device}")
    for name, t in (("x", x), ("weight", weight)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name} needs unit stride along K, 16-byte aligned rows and a 16-byte aligned start "
                             f"(TMA), got strides {t.stride()} at address {t.data_ptr():#x}")
    config.check_fits(block_m_for(x.shape[0]), glu)


def _layout(block: list[int], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def gemm(x: torch.Tensor, weight: torch.Tensor, config: WgmmaConfig) -> torch.Tensor:
    """``x @ weight.T`` with fp32 accumulation; never synchronises with the host.

    Args:
        x: ``[M, K]`` bf16/fp16 on a CUDA device of compute capability 9.0, 1 <= M <= :data:`MAX_M`, unit
        stride along K, 16-byte aligned rows. weight: ``[N, K]``, same dtype, device and alignment.
        config: :class:`WgmmaConfig`.

    Returns:
        ``split_k == 1``: ``[M, N]`` in x's dtype (one rounding). ``split_k > 1``: fp32 partials
        ``[split_k, M, N]`` whose sum in split order is the product.

    Raises:
        TypeError / ValueError naming the bad argument (a pipeline larger than :data:`SHARED_LIMIT` too).
    """
    _validate(x, weight, config)
    return _launch(x, weight, config, weight.shape[0], glu=False)


def gemm_swiglu(x: torch.Tensor, gate_up: torch.Tensor, config: WgmmaConfig) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``gate_up = [gate; up]`` (``[2 I, K]``), in one launch: a program's
    gate rows and their up rows share its pipeline; the roundings of :func:`kernels.gemm.gemm_swiglu`.

    Args:
        x: as :func:`gemm`. gate_up: ``[2 I, K]``, I gate rows then I up rows, as :func:`gemm`'s weight.
        config: :class:`WgmmaConfig` with ``split_k`` 1.

    Returns:
        ``[M, I]`` in x's dtype.

    Raises:
        TypeError / ValueError naming the bad argument (an odd row count, ``split_k`` > 1).
    """
    _validate(x, gate_up, config, glu=True)
    if gate_up.shape[0] % 2:
        raise ValueError(f"gate_up must hold gate rows then as many up rows, got {gate_up.shape[0]} rows")
    if config.split_k != 1:
        raise ValueError(f"gemm_swiglu needs whole sums for SwiGLU: split_k must be 1, got {config.split_k}")
    return _launch(x, gate_up, config, gate_up.shape[0] // 2, glu=True)


def _launch(x: torch.Tensor, weight: torch.Tensor, config: WgmmaConfig, n: int, glu: bool) -> torch.Tensor:
    m, k = x.shape
    block_m = block_m_for(m)
    c = config
    # gemm.gemm's K ranges: a split past the last K tile has none and stores zeros, so there are always split_k
    tiles_per_split = triton.cdiv(triton.cdiv(k, c.block_k), c.split_k)
    if c.split_k == 1:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
        stride_os = 0
    else:
        out = torch.empty((c.split_k, m, n), device=x.device, dtype=torch.float32)
        stride_os = out.stride(0)
    w_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k], _layout([c.block_n, c.block_k], x.dtype))
    x_desc = TensorDescriptor.from_tensor(x, [block_m, c.block_k], _layout([block_m, c.block_k], x.dtype))
    use_pdl = c.pdl and pdl.active(x)
    _wgmma_gemm_kernel[(triton.cdiv(n, c.block_n), c.split_k)](
        w_desc, x_desc, out, m, n, k, tiles_per_split, out.stride(-2), stride_os,
        c.block_n, block_m, c.block_k, c.stages, c.pre, pdl.mode(use_pdl, c.early_trigger),
        num_warps=c.num_warps, GLU=glu, **pdl.launch_options(use_pdl))
    return out


def compile_sm90(config: WgmmaConfig, block_m: int, glu: bool = False, split: bool | None = None):
    """The kernel :func:`gemm` / :func:`gemm_swiglu` would launch with ``config`` at ``block_m`` rows, compiled for
    sm_90 (H100 / H200) with Triton's own ptxas, on any machine (no GPU needed). ``split``: fp32 partials out
    (default: ``config.split_k`` > 1). Returns Triton's compiled kernel (``.asm["ptx"]``, ``.metadata.shared``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    c = config
    split = c.split_k > 1 if split is None else split
    lw = _layout([c.block_n, c.block_k], torch.bfloat16)
    lx = _layout([block_m, c.block_k], torch.bfloat16)
    signature = {"w_desc": f"tensordesc<bf16[{c.block_n}, {c.block_k}],{lw!r}>",
                 "x_desc": f"tensordesc<bf16[{block_m}, {c.block_k}],{lx!r}>",
                 "out_ptr": "*fp32" if split else "*bf16", "M": "i32", "N": "i32", "K": "i32",
                 "tiles_per_split": "i32", "stride_om": "i32", "stride_os": "i32", "BLOCK_N": "constexpr",
                 "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "STAGES": "constexpr", "PRE": "constexpr",
                 "PDL": "constexpr", "num_warps": "constexpr", "GLU": "constexpr"}
    constexprs = {"BLOCK_N": c.block_n, "BLOCK_M": block_m, "BLOCK_K": c.block_k, "STAGES": c.stages, "PRE": c.pre,
                  "PDL": pdl.mode(c.pdl, c.early_trigger), "num_warps": c.num_warps, "GLU": glu}
    return triton.compile(GluonASTSource(_wgmma_gemm_kernel, signature, constexprs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=c.num_warps))
