"""Zero-copy descriptor read: a device kernel loads a step descriptor straight from pinned host memory.

Under unified virtual addressing, page-locked host memory from ``cudaHostAlloc`` (what torch's
``pin_memory`` uses) is mapped into the device address space at the same address, so a kernel can read
it over PCIe/NVLink-C2C without a copy-engine transfer. This is the ``mapped`` descriptor mode of the
engine; ``h2d`` uses an async ``copy_`` instead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_mapped_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_mapped(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst[...] = src[...] read by the device from pinned host memory.

    src: contiguous pinned CPU tensor (on CUDA) or any CPU tensor (interpreter); dst: same shape and
    dtype, contiguous, on the device. Raises ValueError on a shape/dtype/pinning mismatch.
    """
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"copy_mapped: src {tuple(src.shape)} {src.dtype} vs dst {tuple(dst.shape)} {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_mapped: src and dst must be contiguous")
    if dst.is_cuda and not src.is_pinned():
        raise ValueError("copy_mapped: src must be pinned host memory to be readable by the device")
    numel, block = src.numel(), 1024
    _copy_mapped_kernel[(triton.cdiv(numel, block),)](src, dst, numel, BLOCK=block)
    return dst
