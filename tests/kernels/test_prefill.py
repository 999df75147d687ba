"""Prefill attention (SDPA wrapper) == explicit fp32 causal softmax, for MHA and grouped-query heads."""
from __future__ import annotations

import pytest
import torch

from loopbench.kernels.prefill_attention import prefill_attention, prefill_attention_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 4, 16), (33, 4, 4, 16), (47, 6, 2, 32),
                                                             (128, 16, 16, 128)])
def test_prefill_matches_reference(device, tokens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn((tokens, h, head_dim), generator=gen).to(dtype).to(device)
               for h in (heads, kv_heads, kv_heads))
    out = prefill_attention(q, k, v)
    ref = prefill_attention_ref(q, k, v)
    assert out.shape == (tokens, heads, head_dim) and out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= tol + tol * ref.float().abs()).all()), (
        f"max abs diff {diff.max().item():.3e}, mean abs diff {diff.mean().item():.3e}")


def test_prefill_is_causal():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((9, 2, 8), generator=gen) for _ in range(3))
    out = prefill_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[5:], v2[5:] = 100.0, -100.0                 # later keys must not reach earlier queries
    assert torch.equal(prefill_attention(q, k2, v2)[:5], out[:5])


def test_prefill_rejects_bad_shapes():
    q = torch.zeros((4, 6, 16))
    with pytest.raises(ValueError, match="multiple"):
        prefill_attention(q, torch.zeros((4, 4, 16)), torch.zeros((4, 4, 16)))
    with pytest.raises(ValueError, match="agree"):
        prefill_attention(q, torch.zeros((5, 2, 16)), torch.zeros((5, 2, 16)))
