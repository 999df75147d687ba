"""Batch-invariant prefill projection: ``x @ w.T`` for many rows in one launch, each row's bits independent of M.

Why: a batch-invariant engine needs a row's result not to depend on how many other rows share the call. cuBLAS
picks its algorithm by shape, so today's prefill runs every projection as calls of exactly
``EngineConfig.prefill_call_rows`` (256) rows (runtime/model.py ``linear``). At 256 rows an Ouro projection has
only 32-176 output tiles of 128 x 128 for 132 SMs, and a packed prefill of 16 prompts (2,048 rows a loop) is 8
such calls after one another per projection: the run's first prefill, which nothing overlaps, runs far below the
GPU's matmul rate. Measured (kernels/results/README.md, ``prefill_gemm``): faster there, slower on the small packs
beside decode, no faster in the loop, so ``OuroModel.prefill_gemm`` is off.

How: one fixed tile configuration per engine (never chosen by M), one program per ``BLOCK_M x BLOCK_N`` output
tile, fp32 accumulation over K in ``BLOCK_K`` steps in order (``tl.dot``), one rounding to the output dtype, no
split-K. An output element is one dot product over K whose order depends only on the tile constants, and rows
past M are loaded as zeros and never stored, so a row's result is the same for every M and whatever the other
rows hold (the construction of the published batch-invariant matmuls: He et al., "Defeating Nondeterminism in
LLM Inference", Thinking Machines Lab 2025; vLLM's batch-invariant mode). M is not specialised (``do_not_specialize``),
so one compiled kernel serves every row count.

The Triton interpreter runs it on CPU tensors (``TRITON_INTERPRET=1``); its bf16 ``tl.dot`` is wrong there
(BRIEF section 4), so interpreter tests pass fp32 inputs (tests/kernels/test_prefill_gemm.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class PrefillGemmConfig:
    """Tile configuration (one per engine, never per M: batch invariance). ``block_m`` / ``block_n`` /
    ``block_k``: output rows, output columns and K elements per step of one program (powers of two, >= 16);
    ``group_m``: row tiles a group of programs walks before the next column tile (L2 reuse of the weight; changes
    no bit); ``stages``: software-pipeline depth; ``num_warps``: warps per program."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    stages: int = 4
    num_warps: int = 8

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"PrefillGemmConfig.{name} must be a power of two >= 16, got {v!r}")
        for name in ("group_m", "stages", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PrefillGemmConfig.{name} must be an int >= 1, got {v!r}")


# The configuration OuroModel.prefill_gemm runs (kernels/results/prefill_gemm_h100_3a975e2.md: within 6% of the
# fastest of five at 2,048-4,096 rows on every Ouro projection).
DEFAULT = PrefillGemmConfig()


@triton.jit(do_not_specialize=["M"])
def _prefill_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share each weight column tile while it is in L2
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = (k0 + offs_k)[None, :] < K
        a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok & k_ok, other=0.0)
        b = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_ok & k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok & (offs_n[None, :] < N))


def prefill_gemm(x: torch.Tensor, w: torch.Tensor, config: PrefillGemmConfig = DEFAULT,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` in one launch whose rows are batch invariant (module docstring).

    x: [M, K] and w: [N, K] of one dtype in :data:`DTYPES`, on one device, unit stride along K; M may be 0.
    Returns (or writes into ``out``, which must not overlap x or w) [M, N] in x's dtype: fp32 accumulation, one
    rounding; fp32 inputs multiply in IEEE fp32 (``input_precision="ieee"``), not in TF32, ``tl.dot``'s default for
    fp32 on NVIDIA GPUs, which the cuBLAS path (``torch.backends.cuda.matmul.allow_tf32`` off) does not use.
    Raises TypeError for another x or w dtype or config type, ValueError for mismatched shapes, strides or devices
    and for an ``out`` of another shape, dtype, device or column stride."""
    if not isinstance(config, PrefillGemmConfig):
        raise TypeError(f"config must be a PrefillGemmConfig, got {type(config).__name__}")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise TypeError(f"x and w must share one dtype of {DTYPES}, got {x.dtype} and {w.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.shape[1] == 0:
        raise ValueError(f"x [M, K] and w [N, K] must share K >= 1, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.device != w.device:
        raise ValueError(f"x on {x.device} and w on {w.device}: one device")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"x and w need unit stride along K, got strides {x.stride()} and {w.stride()}")
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        out = x.new_empty((M, N))
    elif out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1:
        raise ValueError(f"out must be [{M}, {N}] {x.dtype} on {x.device} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if M == 0:
        return out
    c = config
    grid = (triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n),)
    _prefill_gemm_kernel[grid](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                               BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                               STAGES=c.stages, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                               num_warps=c.num_warps)
    return out


def prefill_gemm_ref(x: torch.Tensor, w: torch.Tensor, config: PrefillGemmConfig = DEFAULT,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: fp32 ``x @ w.T`` rounded once to x's dtype (same signature; ``config`` unused)."""
    ref = (x.float() @ w.float().t()).to(x.dtype)
    if out is not None:
        out.copy_(ref)
        return out
    return ref
