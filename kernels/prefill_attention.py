"""Causal prefill attention over the fresh, dense K/V of one prompt.

Prefill runs once per request and every loop of it sees the whole prompt, so its K/V never need the paged,
depth-planed lookup of decode: the caller attends over the dense ``[T, Hkv, D]`` tensors it just computed
and writes them into the cache separately (``kv_write.write_kv``). This is a thin wrapper over
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, which dispatches to FlashAttention /
cuDNN / memory-efficient kernels on CUDA and to a fused CPU kernel otherwise; prefill is compute-bound and
a small share of a P128/D128 run, so a custom kernel would buy little. Grouped-query attention is handled
by repeating kv heads (head ``h`` uses kv head ``h // (H // Hkv)``), which every SDPA backend accepts.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


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
