"""KV writes: write_kv, native_fill, publish_exits and the fused rope_write_kv_ (Triton) == their torch
references (rope_write_kv_: == rope_ then write_kv, and == the torch references), exactly.

Each case starts two identical random caches (or exit maps), applies the kernel to one and the reference
to the other, and requires ``torch.equal``: these are copies, so there is no rounding to allow for.
Entries with a negative slot, an out-of-range slot, depth or position must write nothing.
"""
from __future__ import annotations

import pytest
import torch

from loopbench.kernels.fused_ops import rope_, rope_ref
from loopbench.kernels.kv_write import (native_fill, native_fill_ref, publish_exits, publish_exits_ref,
                                        rope_write_kv_, write_kv, write_kv_ref)

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="CPU tensors need the Triton interpreter")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
PAGE = 16
SLOTS, PLANES, MAX_BLOCKS = 5, 4, 5


def kv_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not torch.equal(actual, expected):
        diff = (actual.float() - expected.float()).abs().nan_to_num(float("inf"))
        raise AssertionError(f"{what}: {int((diff > 0).sum())} elements differ, max abs diff "
                             f"{diff.max().item():.3e}, mean abs diff {diff.mean().item():.3e}")


def shuffled_tables(gen: torch.Generator, extra_blocks: int = 4) -> tuple[torch.Tensor, int]:
    num_blocks = SLOTS * PLANES * MAX_BLOCKS + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)[: SLOTS * PLANES * MAX_BLOCKS]
    return perm.view(SLOTS, PLANES, MAX_BLOCKS).int(), num_blocks


def int32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 16), (3, 24), (16, 128)])
def test_write_kv_matches_reference(device, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(10 + head_dim)
    block_tables, num_blocks = shuffled_tables(gen)
    dtype = kv_dtype(device)
    k_cache = torch.randn((num_blocks, PAGE, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    v_cache = torch.randn((num_blocks, PAGE, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    # Positions at page edges; the last four rows are padding or out of range and must be skipped.
    slot = [0, 1, 2, 3, 4, 0, 2, -1, 7, 1, 3]
    depth = [1, 2, 3, 4, 1, 4, 2, 2, 1, 0, 5]
    pos = [0, 15, 16, 31, 79, 47, 33, 3, 3, 3, 3]
    n = len(slot)
    k_new = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    v_new = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    args = (block_tables.to(device), int32(slot, device), int32(depth, device), int32(pos, device))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k_cache, v_cache, k_new, v_new, *args)
    write_kv_ref(k_ref, v_ref, k_new, v_new, *args)
    assert_equal(k_cache, k_ref, "k_cache")
    assert_equal(v_cache, v_ref, "v_cache")
    # The valid rows really landed (the reference is not a no-op).
    block = int(block_tables[1, 1, 0])
    assert torch.equal(k_cache[block, 15], k_new[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 16), (16, 128)])
def test_native_fill_matches_reference(device, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(20 + head_dim)
    block_tables, num_blocks = shuffled_tables(gen)
    dtype = kv_dtype(device)
    layers = 3
    shape = (layers, num_blocks, PAGE, kv_heads, head_dim)
    k_all = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_all = torch.randn(shape, generator=gen).to(dtype).to(device)
    # Exits at every depth, a request with max_loops 3, a max above the plane count (clamped), and
    # entries that copy nothing: exit at max, padding slot, slot out of range, position out of range.
    slot = [0, 1, 2, 3, 4, 0, 1, 2, -1, 9, 3]
    pos = [0, 15, 16, 33, 79, 64, 31, 2, 5, 5, 80]
    exit_depth = [1, 2, 3, 1, 2, 1, 2, 4, 1, 1, 1]
    max_depth = [4, 4, 4, 3, 3, 6, 4, 4, 4, 4, 4]
    args = [int32(x, device) for x in (slot, pos, exit_depth, max_depth)]
    k_ref, v_ref = k_all.clone(), v_all.clone()
    native_fill(k_all, v_all, block_tables.to(device), *args)
    native_fill_ref(k_ref, v_ref, block_tables.to(device), *args)
    assert_equal(k_all, k_ref, "k_cache_all")
    assert_equal(v_all, v_ref, "v_cache_all")
    # Entry 0 (slot 0, pos 0, e=1) fanned out to planes 2..4 in every layer.
    src = int(block_tables[0, 0, 0])
    for plane in (2, 3, 4):
        assert torch.equal(k_all[:, int(block_tables[0, plane - 1, 0]), 0], k_all[:, src, 0])


@pytest.mark.parametrize("device", DEVICES)
def test_publish_exits_matches_reference(device):
    gen = torch.Generator().manual_seed(30)
    max_len = 300
    exit_map = torch.randint(1, 5, (SLOTS, max_len), generator=gen, dtype=torch.int32).to(device)
    m = 200                                   # more than one program's block of entries
    flat = torch.randperm(SLOTS * max_len, generator=gen)[:m]
    slot = (flat // max_len).int()
    pos = (flat % max_len).int()
    slot[::17] = -1
    slot[5] = SLOTS + 2
    pos[7] = max_len
    exit_depth = torch.randint(1, 5, (m,), generator=gen, dtype=torch.int32)
    args = [t.to(device) for t in (slot, pos, exit_depth)]
    ref = exit_map.clone()
    publish_exits(exit_map, *args)
    publish_exits_ref(ref, *args)
    assert_equal(exit_map, ref, "exit_map")


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches_write_nothing(device):
    gen = torch.Generator().manual_seed(40)
    block_tables, num_blocks = shuffled_tables(gen)
    k = torch.randn((2, num_blocks, PAGE, 2, 16), generator=gen).to(device)
    before = k.clone()
    empty = int32([], device)
    native_fill(k, k.clone(), block_tables.to(device), empty, empty, empty, empty)
    write_kv(k[0], k[1], k[0, :0, 0], k[0, :0, 0], block_tables.to(device), empty, empty, empty)
    publish_exits(torch.zeros((2, 4), dtype=torch.int32, device=device), empty, empty, empty)
    assert torch.equal(k, before)


def test_rejects_bad_arguments():
    block_tables = torch.zeros((2, 4, 3), dtype=torch.int32)
    k = torch.zeros((10, PAGE, 2, 16))
    row = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_new"):
        write_kv(k, k, torch.zeros((1, 3, 16)), torch.zeros((1, 3, 16)), block_tables, row, row, row)
    with pytest.raises(ValueError, match="row_pos"):
        write_kv(k, k, torch.zeros((1, 2, 16)), torch.zeros((1, 2, 16)), block_tables, row, row, row.long())
    with pytest.raises(ValueError, match="k_cache_all"):
        native_fill(k, k, block_tables, row, row, row, row)
    with pytest.raises(ValueError, match="exit_depth"):
        publish_exits(torch.zeros((2, 4), dtype=torch.int32), row, row, torch.zeros(2, dtype=torch.int32))


def test_rejects_strided_entry_vectors():
    exit_map = torch.zeros((2, 8), dtype=torch.int32)
    strided = torch.zeros(4, dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        publish_exits(exit_map, strided, strided, strided)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 3, 24), (16, 16, 128)])
def test_rope_write_kv_is_rope_then_write(device, heads, kv_heads, head_dim):
    from loopbench.runtime.model import OuroConfig, rope_tables
    gen = torch.Generator().manual_seed(20 + head_dim)
    block_tables, num_blocks = shuffled_tables(gen)
    dtype = kv_dtype(device)
    k_cache = torch.randn((num_blocks, PAGE, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    v_cache = torch.randn((num_blocks, PAGE, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    cos, sin = rope_tables(OuroConfig(head_dim=head_dim, rope_theta=10_000.0), 128, device)
    # Positions at page edges; the last four rows are padding or out of range and must write nothing.
    slot = [0, 1, 2, 3, 4, 0, 2, -1, 7, 1, 3]
    depth = [1, 2, 3, 4, 1, 4, 2, 2, 1, 0, 5]
    pos = [0, 15, 16, 31, 79, 47, 33, 3, 3, 3, 3]
    n = len(slot)
    qkv = torch.randn((n, (heads + 2 * kv_heads) * head_dim), generator=gen).to(dtype).to(device)
    meta = (block_tables.to(device), int32(slot, device), int32(depth, device), int32(pos, device))
    positions = meta[3]

    fused_qkv, fused_k, fused_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    rope_write_kv_(fused_qkv, cos, sin, fused_k, fused_v, *meta, heads)
    two_qkv, two_k, two_v = rope_(qkv.clone(), cos, sin, positions, heads + kv_heads, head_dim), k_cache.clone(), v_cache.clone()
    kv = two_qkv[:, heads * head_dim:].view(n, 2, kv_heads, head_dim)
    write_kv(two_k, two_v, kv[:, 0], kv[:, 1], *meta)
    assert_equal(fused_qkv, two_qkv, "qkv vs rope_")
    assert_equal(fused_k, two_k, "k cache vs rope_ + write_kv")
    assert_equal(fused_v, two_v, "v cache vs rope_ + write_kv")

    ref_qkv = rope_ref(qkv.cpu(), cos.cpu(), sin.cpu(), positions.cpu(), heads + kv_heads, head_dim)
    ref_k, ref_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    kv = ref_qkv[:, heads * head_dim:].view(n, 2, kv_heads, head_dim)
    write_kv_ref(ref_k, ref_v, kv[:, 0], kv[:, 1], *(t.cpu() for t in meta))
    close = torch.allclose(fused_qkv.cpu().double(), ref_qkv.double(), rtol=0, atol=4 * torch.finfo(dtype).eps * 8)
    assert close, f"qkv vs rope_ref: max diff {(fused_qkv.cpu().double() - ref_qkv.double()).abs().max():.3e}"
    assert_equal(fused_v.cpu(), ref_v, "v cache vs write_kv_ref")


def test_rope_write_kv_rejects_a_qkv_of_the_wrong_width():
    k_cache = torch.zeros((4, PAGE, 2, 16))
    cos = sin = torch.zeros((8, 8))
    meta = (torch.zeros((1, 1, 1), dtype=torch.int32),) + tuple(torch.zeros(1, dtype=torch.int32) for _ in range(3))
    with pytest.raises(ValueError, match=r"qkv must be \[N, \(H \+ 2 Hkv\) \* D\] = \[N, 128\]"):
        rope_write_kv_(torch.zeros((1, 100)), cos, sin, k_cache, k_cache.clone(), *meta, 4)
