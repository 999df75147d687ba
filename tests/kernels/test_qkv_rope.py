"""qkv projection + RoPE + KV write in one launch (kernels/qkv_rope.py) == gemm then rope_write_kv_, bitwise:
the same tiles and K order, the same roundings. Interpreter on CPU (bf16 through the interpreter's own
conversions on both sides), every check on CUDA. Rows with a negative or out-of-range slot, depth or
position must write nothing into the cache.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from loopbench.kernels import gemm as gm
from loopbench.kernels.kv_write import rope_write_kv_
from loopbench.kernels.qkv_rope import qkv_rope_write_kv

PAGE, SLOTS, PLANES, MAX_BLOCKS = 16, 5, 4, 5
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _case(device, heads, kv_heads, head_dim, hidden, seed=0):
    from loopbench.runtime.model import OuroConfig, rope_tables
    gen = torch.Generator().manual_seed(seed + head_dim + hidden)
    num_blocks = SLOTS * PLANES * MAX_BLOCKS + 4
    tables = torch.randperm(num_blocks, generator=gen)[: SLOTS * PLANES * MAX_BLOCKS].view(SLOTS, PLANES, MAX_BLOCKS)
    dt = torch.bfloat16
    caches = [torch.randn((num_blocks, PAGE, kv_heads, head_dim), generator=gen).to(dt).to(device) for _ in range(2)]
    cos, sin = rope_tables(OuroConfig(head_dim=head_dim, rope_theta=10_000.0), 128, device)
    # page edges; the last four rows are padding or out of range and must write nothing
    slot = [0, 1, 2, 3, 4, 0, 2, -1, 7, 1, 3]
    depth = [1, 2, 3, 4, 1, 4, 2, 2, 1, 0, 5]
    pos = [0, 15, 16, 31, 79, 47, 33, 3, 3, 3, 3]
    meta = [tables.int().to(device)] + [torch.tensor(v, dtype=torch.int32, device=device) for v in (slot, depth, pos)]
    x = torch.randn((len(slot), hidden), generator=gen).to(dt).to(device)
    w = (0.1 * torch.randn(((heads + 2 * kv_heads) * head_dim, hidden), generator=gen)).to(dt).to(device)
    return x, w, cos, sin, caches, meta


def _fused_row_order(num_heads: int, head_dim: int, parts: int) -> torch.Tensor:
    """Weight rows in the order the fused kernel's programs hold them: per head and part, dims
    part*Q .. part*Q + Q - 1, then the same dims + D/2 (Q = D / (2 parts)); the identity for parts 1."""
    half, q = head_dim // 2, head_dim // (2 * parts)
    order = [h * head_dim + half * side + p * q + i
             for h in range(num_heads) for p in range(parts) for side in (0, 1) for i in range(q)]
    return torch.tensor(order)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,hidden,block_k,parts", [
    (4, 2, 16, 96, 32, 1), (2, 2, 32, 64, 64, 1), (2, 1, 64, 80, 32, 2), (2, 1, 64, 80, 32, 4),
    (16, 16, 128, 256, 128, 1), (16, 16, 128, 256, 128, 2), (16, 16, 128, 256, 128, 4)])
@pytest.mark.parametrize("early", [True, False])
def test_fused_qkv_rope_write_is_gemm_then_rope_write(device, heads, kv_heads, head_dim, hidden, block_k, parts,
                                                      early):
    # early: the epilogue's inputs loaded before the K loop (GemmConfig.early_epilogue) or after it, the same bits.
    # parts > 1: a head's rotary pairs over several programs (block_n = head_dim / parts), against the gemm
    # of the same block_n: the same K tiles and order, so the same bits. The interpreter's tl.dot (numpy's
    # matmul) rounds an element by where its row sits in the tile, so on the CPU the gemm gets the weight's
    # rows in the fused programs' order (dims d and d + D/2 side by side) and its columns are put back.
    if device == "cpu" and head_dim == 128:
        pytest.skip("the Ouro head in the interpreter is slow; CUDA covers it")
    x, w, cos, sin, (k_cache, v_cache), meta = _case(device, heads, kv_heads, head_dim, hidden)
    cfg = gm.GemmConfig(block_n=head_dim // parts, block_k=block_k, early_epilogue=early)
    fused_k, fused_v = k_cache.clone(), v_cache.clone()
    fused = qkv_rope_write_kv(x, w, cfg, cos, sin, fused_k, fused_v, *meta, heads)
    two_k, two_v = k_cache.clone(), v_cache.clone()
    if device == "cpu":
        order = _fused_row_order(w.shape[0] // head_dim, head_dim, parts)
        projected = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
        projected[:, order] = gm.gemm(x, w[order], cfg)
    else:
        projected = gm.gemm(x, w, cfg)
    two = rope_write_kv_(projected, cos, sin, two_k, two_v, *meta, heads)
    for got, want, what in ((fused, two, "qkv"), (fused_k, two_k, "k cache"), (fused_v, two_v, "v cache")):
        diff = (got.float() - want.float()).abs()
        assert torch.equal(got, want), f"{what}: {int((diff > 0).sum())} elements differ, max {diff.max().item():.3e}"
    written = int((fused_k != k_cache).any(-1).any(-1).sum())
    assert 0 < written <= 7, f"{written} cache cells changed; the 7 valid rows write one cell each"
    if device == "cuda":        # bringing a later weight into L2 (gemm.next_weight_region, PDL on) changes no bit
        cfg_pdl = gm.GemmConfig(block_n=head_dim // parts, block_k=block_k, pdl=True, early_epilogue=early)
        outs = []
        # no prefetch; every program a share; 36 extra programs take it all (GemmConfig.prefetch_programs); every
        # program whole rows at its end (GemmConfig.prefetch_at_end)
        region = w[:, : min(hidden, 128)]
        for nxt, extra, at_end in ((None, 0, False), (region, 0, False), (region, 36, False), (region, 0, True)):
            kc, vc = k_cache.clone(), v_cache.clone()
            c = dataclasses.replace(cfg_pdl, prefetch_programs=extra, prefetch_at_end=at_end)
            outs.append((qkv_rope_write_kv(x, w, c, cos, sin, kc, vc, *meta, heads, next_weight=nxt), kc, vc))
        for out in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], out)), "a later weight's prefetch changed a bit"


def test_fused_qkv_rope_write_rejects_a_tile_that_does_not_divide_a_head():
    x, w, cos, sin, (k_cache, v_cache), meta = _case("cpu", 4, 2, 16, 96)
    with pytest.raises(ValueError, match="block_n dividing head_dim"):
        qkv_rope_write_kv(x, w, gm.GemmConfig(block_n=32, block_k=32), cos, sin, k_cache, v_cache, *meta, 4)
    with pytest.raises(ValueError, match="rows"):
        qkv_rope_write_kv(x, w[:-16], gm.GemmConfig(block_n=16, block_k=32), cos, sin, k_cache, v_cache, *meta, 4)


def test_fused_qkv_rope_write_refuses_prefetch_programs_without_a_next_weight():
    """GemmConfig.prefetch_programs > 0 only adds programs that prefetch ``next_weight``: without one the launch is
    refused (ValueError naming the value) and nothing is written; with one it runs (on the CPU, without PDL, the
    region is not prefetched) and gives the bits of the configuration without extra programs."""
    x, w, cos, sin, (k_cache, v_cache), meta = _case("cpu", 4, 2, 16, 96)
    cfg = gm.GemmConfig(block_n=16, block_k=32, prefetch_programs=36)
    kc, vc = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match="prefetch_programs=36 needs a next_weight region"):
        qkv_rope_write_kv(x, w, cfg, cos, sin, kc, vc, *meta, 4)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache), "a refused launch wrote the cache"
    got = qkv_rope_write_kv(x, w, cfg, cos, sin, kc, vc, *meta, 4, next_weight=w[:, :64])
    pk, pv = k_cache.clone(), v_cache.clone()
    want = qkv_rope_write_kv(x, w, dataclasses.replace(cfg, prefetch_programs=0), cos, sin, pk, pv, *meta, 4)
    assert torch.equal(got, want) and torch.equal(kc, pk) and torch.equal(vc, pv)
