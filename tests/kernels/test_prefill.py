"""Prefill attention == explicit fp32 causal softmax: the one-prompt SDPA wrapper and the packed kernel.

The packed kernel is checked against the per-prompt reference on prompts that cross tile and key-block
boundaries (mixed in one pack, MHA and grouped-query heads), for exactly-zero padding rows, for bitwise
equality of a prompt alone and packed at another offset, and (GPU) for CUDA-graph replay with a new table.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loopbench.kernels.prefill_attention import (DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, DEFAULT_NUM_STAGES,
                                                 DEFAULT_NUM_WARPS, max_prefill_tiles,
                                                 packed_prefill_attention, packed_prefill_attention_ref,
                                                 prefill_attention, prefill_attention_ref, prefill_tiles)

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


# ---------------------------------------------------------------------------------------------------------
# Packed (varlen) prefill. On CPU the Triton kernel runs in the interpreter (float32, small heads); the
# GPU tests run the Ouro shape in bf16.

LENS = [1, 15, 16, 17, 31, 33, 50]          # both sides of the 16-row tile and 16-key block boundaries
HAS_CUDA = torch.cuda.is_available()


def make_packed(seed: int, lens: list[int], heads: int, kv_heads: int, head_dim: int, padding: int = 0,
                device: str = "cpu", dtype: torch.dtype = torch.float32, pad_value: float = float("nan")):
    """q, k, v of prompts ``lens`` packed back to back, then ``padding`` rows of ``pad_value``."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    out = []
    for h in (heads, kv_heads, kv_heads):
        t = torch.full((n + padding, h, head_dim), pad_value)
        t[:n] = torch.randn((n, h, head_dim), generator=gen)
        out.append(t.to(dtype).to(device))
    return out


def packed_tiles(lens, block_m: int, device: str = "cpu", num_tiles=None) -> torch.Tensor:
    return torch.from_numpy(prefill_tiles(lens, block_m=block_m, num_tiles=num_tiles)).to(device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = 2e-2 if actual.dtype in (torch.bfloat16, torch.float16) else 2e-5
    a, e = actual.float(), expected.float()
    diff = (a - e).abs()
    ok = bool(torch.isfinite(a).all()) and bool((diff <= tol + tol * e.abs()).all())
    assert ok, f"{what}: max abs diff {diff.max().item():.3e}, mean abs diff {diff.mean().item():.3e}"


def test_prefill_tiles_layout():
    tiles = prefill_tiles([1, 16, 17, 40], block_m=16)
    assert tiles.dtype == np.int32 and tiles.shape == (3, 1 + 1 + 2 + 3)
    assert tiles.tolist() == [[0, 1, 17, 17, 34, 34, 34],
                              [0, 1, 17, 33, 34, 50, 66],
                              [1, 17, 33, 34, 50, 66, 74]]
    padded = prefill_tiles([1, 16, 17, 40], block_m=16, num_tiles=10)
    assert np.array_equal(padded[:, :7], tiles) and not padded[:, 7:].any()
    assert prefill_tiles([], block_m=32).shape == (3, 0)
    assert not prefill_tiles([], block_m=32, num_tiles=3).any()


def test_prefill_tiles_split_depends_only_on_the_prompt():
    rng = np.random.default_rng(0)
    for block_m in (16, 64):
        lens = rng.integers(1, 300, size=12).tolist()
        tiles = prefill_tiles(lens, block_m=block_m)
        alone = prefill_tiles([lens[5]], block_m=block_m)
        offset = sum(lens[:5])
        mine = tiles[:, tiles[0] == offset]
        assert np.array_equal(mine - offset, alone)
        assert ((tiles[2] - tiles[1] >= 1) & (tiles[2] - tiles[1] <= block_m)).all()
        assert ((tiles[1] - tiles[0]) % block_m == 0).all()
        covered = np.concatenate([np.arange(a, b) for a, b in zip(tiles[1], tiles[2])])
        assert np.array_equal(covered, np.arange(sum(lens)))     # every row once, in order
        bucket = sum(lens) + int(rng.integers(0, 100))
        assert tiles.shape[1] <= max_prefill_tiles(bucket, len(lens), block_m)


def test_prefill_tiles_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"num_tiles=3 .* need 4 tiles"):
        prefill_tiles([17, 20], block_m=16, num_tiles=3)
    for bad in ([0], [5, -1]):
        with pytest.raises(ValueError, match="positive"):
            prefill_tiles(bad, block_m=16)
    for bad in ([True], [2.0], "abc", 5):
        with pytest.raises(TypeError):
            prefill_tiles(bad, block_m=16)
    for block_m in (8, 24, 0):
        with pytest.raises(ValueError, match="block_m"):
            prefill_tiles([3], block_m=block_m)
    with pytest.raises(ValueError, match="num_seqs"):
        max_prefill_tiles(10, -1, 16)
    assert max_prefill_tiles(0, 0, 16) == 0 and max_prefill_tiles(33, 2, 16) == 5


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 2, 16), (4, 2, 32), (2, 1, 24)])
def test_packed_interpreter_matches_reference(heads, kv_heads, head_dim):
    # NaN padding rows: read by no tile, so they must neither leak into real rows nor come out non-zero.
    q, k, v = make_packed(1, LENS, heads, kv_heads, head_dim, padding=5)
    n = sum(LENS)
    tiles = packed_tiles(LENS, 16, num_tiles=max_prefill_tiles(n + 5, len(LENS), 16))
    ref = packed_prefill_attention_ref(q[:n], k[:n], v[:n], LENS)
    for backend in ("triton", "torch"):
        stale = torch.full_like(q, float("nan"))                  # the kernel itself must write the zeros
        out = packed_prefill_attention(q, k, v, tiles, block_m=16, block_n=16, backend=backend, out=stale)
        assert out is stale and out.shape == q.shape and out.dtype == q.dtype
        assert_close(out[:n], ref, f"{backend} vs reference")
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), f"{backend}: padding rows must be 0"


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors need the Triton interpreter")
def test_packed_interpreter_wide_table_in_any_order():
    # A table wider than one scan of the padding programs (256 entries) with its tiles last: the padding
    # rows' zeros must come from the largest q_end wherever it sits, and tile order must not matter.
    lens = [20, 5]
    q, k, v = make_packed(8, lens, 2, 2, 16, padding=15)
    tiles = packed_tiles(lens, 16)
    wide = torch.zeros((3, 600), dtype=torch.int32)
    wide[:, [590, 350, 599]] = tiles
    stale = torch.full_like(q, float("nan"))
    out = packed_prefill_attention(q, k, v, wide, block_m=16, block_n=16, backend="triton", out=stale)
    assert_close(out[:25], packed_prefill_attention_ref(q[:25], k[:25], v[:25], lens), "wide table")
    assert torch.equal(out[25:], torch.zeros_like(out[25:]))


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_packed_interpreter_alone_equals_packed_bitwise(block_m, block_n):
    lens = [17, 50, 31]                                       # the 50-row prompt sits at offset 17
    q, k, v = make_packed(2, lens, 2, 2, 16)
    kw = dict(block_m=block_m, block_n=block_n, backend="triton")
    packed = packed_prefill_attention(q, k, v, packed_tiles(lens, block_m), **kw)
    alone = [packed_prefill_attention(*(t[17:67].clone() for t in (q, k, v)), packed_tiles([50], block_m),
                                      **kw)]
    alone.append(packed_prefill_attention(*(t[:17].clone() for t in (q, k, v)), packed_tiles([17], block_m),
                                          **kw))
    assert torch.equal(packed[17:67], alone[0]) and torch.equal(packed[:17], alone[1])


def test_packed_rejects_bad_arguments(monkeypatch):
    q, k, v = make_packed(3, [4], 2, 2, 16)
    tiles = packed_tiles([4], 16)
    with pytest.raises(ValueError, match="tiles"):
        packed_prefill_attention(q, k, v, tiles.long(), block_m=16)
    with pytest.raises(ValueError, match="tiles"):
        packed_prefill_attention(q, k, v, tiles[:2], block_m=16)
    with pytest.raises(ValueError, match="block_m"):
        packed_prefill_attention(q, k, v, tiles, block_m=48)
    with pytest.raises(ValueError, match="block_n"):
        packed_prefill_attention(q, k, v, tiles, block_m=16, block_n=8)
    with pytest.raises(ValueError, match="scale"):
        packed_prefill_attention(q, k, v, tiles, block_m=16, scale=-1.0)
    with pytest.raises(ValueError, match="backend"):
        packed_prefill_attention(q, k, v, tiles, block_m=16, backend="cuda")
    with pytest.raises(ValueError, match="float64"):
        packed_prefill_attention(q.double(), k.double(), v.double(), tiles, block_m=16, backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        packed_prefill_attention(q.int(), k.int(), v.int(), tiles, block_m=16)
    with pytest.raises(ValueError, match="out must be"):
        packed_prefill_attention(q, k, v, tiles, block_m=16, out=torch.empty((4, 2, 8)))
    with pytest.raises(ValueError, match="sum to 5"):
        packed_prefill_attention_ref(q, k, v, [5])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        packed_prefill_attention(q, k, v, tiles, block_m=16, backend="triton")


# GPU: Ouro-1.4B attention (16 heads, head_dim 128, bf16), the module's default tiles.
GPU_LENS = [1, 100, 128, 129, 511, 1000, 2048]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_heads", [16, 4])
@pytest.mark.parametrize("block_m,block_n,num_warps,num_stages", [
    (DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES), (64, 64, 4, 2), (128, 128, 8, 2)])
def test_packed_gpu_matches_reference(kv_heads, block_m, block_n, num_warps, num_stages):
    q, k, v = make_packed(4, GPU_LENS, 16, kv_heads, 128, padding=77, device="cuda", dtype=torch.bfloat16)
    n = sum(GPU_LENS)
    tiles = packed_tiles(GPU_LENS, block_m, "cuda", max_prefill_tiles(n + 77, len(GPU_LENS) + 3, block_m))
    out = packed_prefill_attention(q, k, v, tiles, block_m=block_m, block_n=block_n, num_warps=num_warps,
                                   num_stages=num_stages)
    ref = packed_prefill_attention_ref(q[:n], k[:n], v[:n], GPU_LENS)
    assert_close(out[:n], ref, f"block_m {block_m} block_n {block_n}")
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be 0"
    sdpa = torch.cat([prefill_attention(*(t[a:a + m] for t in (q, k, v)))
                      for a, m in zip(np.cumsum([0] + GPU_LENS[:-1]).tolist(), GPU_LENS)])
    assert_close(out[:n], sdpa, "vs SDPA")


@pytest.mark.gpu
@needs_cuda
def test_packed_gpu_alone_equals_packed_bitwise():
    q, k, v = make_packed(5, GPU_LENS, 16, 16, 128, device="cuda", dtype=torch.bfloat16)
    packed = packed_prefill_attention(q, k, v, packed_tiles(GPU_LENS, DEFAULT_BLOCK_M, "cuda"),
                                      block_m=DEFAULT_BLOCK_M)
    start = 0
    for m in GPU_LENS:
        alone = packed_prefill_attention(*(t[start:start + m].clone() for t in (q, k, v)),
                                         packed_tiles([m], DEFAULT_BLOCK_M, "cuda"), block_m=DEFAULT_BLOCK_M)
        assert torch.equal(alone, packed[start:start + m]), f"prompt of {m} rows at offset {start}"
        start += m


@pytest.mark.gpu
@needs_cuda
def test_packed_gpu_cuda_graph_replay():
    # Capture once on static buffers, then replay with new data and other tile tables of the same bucket:
    # each replay must give the eager call's bits, so nothing in the call was fixed at capture. The second
    # table ends earlier than the first, so its padding rows held real outputs before and must be zeroed.
    bucket, max_seqs, block_m = 4096, 8, DEFAULT_BLOCK_M
    num_tiles = max_prefill_tiles(bucket, max_seqs, block_m)
    static = make_packed(6, [bucket], 16, 16, 128, device="cuda", dtype=torch.bfloat16)
    tiles = packed_tiles([17, 3000], block_m, "cuda", num_tiles)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                           # compile outside the capture
        packed_prefill_attention(*static, tiles, block_m=block_m)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = packed_prefill_attention(*static, tiles, block_m=block_m)
    for seed, lens in enumerate([[1000, 2000, 37, 1059], [2048, 1500, 300, 1, 129], [5, 700]]):
        n = sum(lens)
        fresh = make_packed(7 + seed, lens, 16, 16, 128, padding=bucket - n, device="cuda", dtype=torch.bfloat16)
        for buf, new in zip(static, fresh):
            buf.copy_(new)
        tiles.copy_(packed_tiles(lens, block_m, "cuda", num_tiles))
        graph.replay()
        torch.cuda.synchronize()
        eager = packed_prefill_attention(*static, tiles, block_m=block_m)
        assert torch.equal(out, eager), f"replay {lens} differs from the eager call"
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), f"{lens}: padding rows (NaN inputs) must be 0"
        assert_close(out[:n], packed_prefill_attention_ref(*(t[:n] for t in static), lens), f"replay {lens}")
