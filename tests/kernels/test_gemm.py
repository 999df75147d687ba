"""Small-M GEMM (kernels/gemm.py) == its torch reference: interpreter on CPU, every variant on CUDA.

Shapes cross tile boundaries (N, K not multiples of the tiles, M not a power of two) so the masks and the
short last split are exercised; on CUDA also the Ouro shapes of ``CONFIGS``, the TMA and PDL variants,
graph capture, and batch invariance (the first rows of a larger M equal a smaller M's rows bitwise).
"""
import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from loopbench.kernels import fused_ops as fo
from loopbench.kernels import gemm as gm

CPU_CASES = [  # (M, N, K, block_n, block_k, split_k)
    (1, 64, 64, 64, 64, 1),
    (5, 100, 200, 64, 64, 1),        # N, K off the tiles
    (16, 130, 384, 64, 64, 3),       # split-K, even ranges
    (21, 64, 330, 64, 64, 4),        # split-K, short and empty last splits
    (40, 96, 96, 64, 32, 2),         # M > 32: BLOCK_M 64
]


def _inputs(m, n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed + m * 7 + n * 3 + k)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = (0.1 * torch.randn(n, k, generator=g)).to(device, torch.bfloat16)
    return x, w


def _assert_close(got, ref, what, bf16_ulps=1, abs_sum=None):
    # fp32 accumulation in another order than the reference: a few fp32 ulps of the result, or, where the
    # terms cancel, of the sum of their magnitudes ``abs_sum`` (|x| @ |w|.T; the usual bound on a reordered
    # fp32 sum scales with it, Higham, "Accuracy and Stability of Numerical Algorithms", section 4.2).
    # A bf16 result may round the other way at a tie-near value (one bf16 ulp, 2^-7 relative).
    tol = (4e-6 if got.dtype == torch.float32 else bf16_ulps * 2 ** -7) * ref.float().abs().clamp(min=1.0)
    if abs_sum is not None and got.dtype == torch.float32:
        tol = torch.maximum(tol, 2 ** -18 * abs_sum.float())
    diff = (got.float() - ref.float()).abs()
    assert bool((diff <= tol).all()), f"{what}: max diff {diff.max().item():.3e}"


@pytest.mark.parametrize("m,n,k,bn,bk,split", CPU_CASES)
def test_gemm_matches_reference_cpu(m, n, k, bn, bk, split):
    x, w = _inputs(m, n, k, "cpu")
    cfg = gm.GemmConfig(block_n=bn, block_k=bk, split_k=split)
    out = gm.gemm(x, w, cfg)
    ref = gm.gemm_ref(x, w, split, bk)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _assert_close(out, ref, f"gemm M{m} N{n} K{k} split {split}")
    if split > 1:
        red = gm.reduce_partials(out, torch.bfloat16)
        total = out[0]
        for p in out[1:]:
            total = total + p
        # the interpreter rounds fp32 -> bf16 its own way (tests/kernels/test_fused.py): one ulp here,
        # bitwise on CUDA (test_reduce_partials_bitwise_cuda)
        _assert_close(red, total.to(torch.bfloat16), "reduce_partials")
        assert torch.equal(gm.linear(x, w, cfg), red)


def test_add_rms_norm_from_partials_cpu():
    x, w = _inputs(7, 96, 160, "cpu")
    cfg = gm.GemmConfig(block_n=64, block_k=32, split_k=3)
    parts = gm.gemm(x, w, cfg)
    g = torch.Generator().manual_seed(3)
    res = torch.randn(7, 96, generator=g).to(torch.bfloat16)
    w1, w2 = (1 + 0.1 * torch.randn(96, generator=g)).to(torch.bfloat16), torch.randn(96, generator=g).to(torch.bfloat16)
    got = fo.add_rms_norm(res, parts, w1, w2, 1e-6)
    from_reduced = fo.add_rms_norm(res, gm.reduce_partials(parts, torch.bfloat16), w1, w2, 1e-6)
    for a, b, what in zip(got, from_reduced, ("x", "h")):
        assert torch.equal(a, b), f"add_rms_norm({what}) from partials differs from the reduced projection"
    ref = fo.add_rms_norm_ref(res, parts, w1, w2, 1e-6)
    for a, b, what in zip(got, ref, ("x", "h")):   # 8 ulps on the interpreter, as tests/kernels/test_fused.py
        _assert_close(a, b, f"add_rms_norm({what}) from partials vs the torch reference", 8)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x.float(), w), "bfloat16 or float16"),
    (lambda x, w: (x, w[:, :-1]), "K="),
    (lambda x, w: (x.t(), w), "unit stride"),
    (lambda x, w: (torch.cat([x] * 30), w), "1..128 rows"),
])
def test_gemm_rejects_bad_input(bad, match):
    x, w = _inputs(5, 64, 64, "cpu")
    with pytest.raises((TypeError, ValueError), match=match):
        gm.gemm(*bad(x, w), gm.GemmConfig(block_n=64, block_k=64))
    with pytest.raises(ValueError, match="need CUDA"):
        gm.gemm(x, w, gm.GemmConfig(block_n=64, block_k=64, tma=True))
    with pytest.raises(ValueError, match="power of two"):
        gm.GemmConfig(block_n=48)
    with pytest.raises(ValueError, match="prefetch_programs must be an int >= 0, got -1"):
        gm.GemmConfig(prefetch_programs=-1)
    for flag in ("tma", "pdl", "early_epilogue", "early_trigger"):
        with pytest.raises(ValueError, match=f"GemmConfig.{flag} must be true or false, got 1"):
            gm.GemmConfig(**{flag: 1})


def test_config_for_is_per_shape_up_to_its_measured_rows():
    assert gm.config_for(6144, 2048, 1) is gm.config_for(6144, 2048, 64) is gm.CONFIGS[(6144, 2048)]
    assert gm.config_for(6144, 2048, 65) is None, "qkv was measured slower than cuBLAS at 128 rows"
    assert gm.config_for(2048, 5632, 128) is gm.CONFIGS[(2048, 5632)]
    assert gm.config_for(2048, 5632, 129) is None, "more rows than the kernel takes must go to cuBLAS"
    assert gm.config_for(123, 456, 16) is None
    assert set(gm.FASTER_UP_TO) == set(gm.CONFIGS) and set(gm.SWIGLU_FASTER_UP_TO) == set(gm.SWIGLU_CONFIGS)
    swiglu = gm.config_for(11264, 2048, 48, gm.SWIGLU_CONFIGS, gm.SWIGLU_FASTER_UP_TO)
    assert swiglu is gm.SWIGLU_CONFIGS[(11264, 2048)]


def test_num_stages_shrink_to_fit_shared_memory(monkeypatch):
    monkeypatch.setattr(gm, "_max_shared_bytes", lambda device: 232448)        # an H100/H200's opt-in limit
    cuda = torch.device("cuda", 0)
    qkv = gm.CONFIGS[(6144, 2048)]                                             # block_n 64, block_k 256, 4 stages
    assert [gm.num_stages_that_fit(qkv, bm, cuda) for bm in (16, 32, 64, 128)] == [4, 4, 3, 2]
    assert gm.num_stages_that_fit(gm.GemmConfig(block_n=64, block_k=128), 128, cuda, weight_tiles=2) == 3
    assert gm.num_stages_that_fit(gm.GemmConfig(block_n=1024, block_k=1024), 128, cuda) == 1
    assert gm.num_stages_that_fit(qkv, 128, torch.device("cpu")) == 4, "the interpreter keeps the configured stages"


@pytest.mark.gpu
def test_reduce_partials_bitwise_cuda():
    parts = torch.randn(4, 16, 2048, device="cuda")
    total = parts[0] + parts[1] + parts[2] + parts[3]
    assert torch.equal(gm.reduce_partials(parts, torch.bfloat16), total.to(torch.bfloat16))


GPU_VARIANTS = [gm.GemmConfig(block_n=64, block_k=64, split_k=s, tma=t, pdl=p)
                for s in (1, 3) for t in (False, True) for p in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_VARIANTS, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (13, 200, 328), (64, 192, 512), (128, 64, 256)])
def test_gemm_variants_cuda(cfg, m, n, k):
    x, w = _inputs(m, n, k, "cuda")
    out = gm.gemm(x, w, cfg)
    _assert_close(out, gm.gemm_ref(x, w, cfg.split_k, cfg.block_k), f"{cfg} M{m}",
                  abs_sum=gm.gemm_ref(x.abs(), w.abs(), cfg.split_k, cfg.block_k))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(gm.CONFIGS))
def test_ouro_shapes_batch_invariant_and_graph_safe_cuda(shape):
    n, k = shape
    x, w = _inputs(128, n, k, "cuda")
    cfg = gm.CONFIGS[shape]
    full = gm.gemm(x, w, cfg)
    _assert_close(full, gm.gemm_ref(x, w, cfg.split_k, cfg.block_k), f"{shape}",
                  abs_sum=gm.gemm_ref(x.abs(), w.abs(), cfg.split_k, cfg.block_k))
    for m in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96):
        part = gm.gemm(x[:m].contiguous(), w, cfg)
        assert torch.equal(part, full[..., :m, :]), f"{shape}: rows of M={m} differ from the first rows of M=128"
    # replayed from a CUDA graph (PDL launches become graph edges): the same bits
    xs = x[:16].clone()
    eager = gm.gemm(xs, w, cfg).clone()
    assert torch.equal(graph_replay(lambda: gm.gemm(xs, w, cfg)), eager), f"{shape}: graph replay differs from eager"


def graph_replay(fn):
    """``fn()``'s output when captured in a CUDA graph (after one call on a side stream, as capture needs) and
    replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("m,inter,k,bn,bk", [(3, 64, 64, 64, 64), (17, 100, 200, 64, 64), (33, 128, 96, 64, 32),
                                             (9, 70, 96, 16, 32)])     # 5 tiles of 16 gate + 16 up rows
def test_gemm_swiglu_is_gemm_then_silu_mul_cpu(m, inter, k, bn, bk):
    x, w = _inputs(m, 2 * inter, k, "cpu")
    cfg = gm.GemmConfig(block_n=bn, block_k=bk)
    got = gm.gemm_swiglu(x, w, cfg)
    assert got.shape == (m, inter) and got.dtype == x.dtype
    # same tiles and K order as the plain kernel, so the same products; the interpreter's own bf16
    # rounding (tests/kernels/test_fused.py) allows one ulp against the two-launch path here
    _assert_close(got, fo.silu_mul(gm.gemm(x, w, cfg)), "gemm_swiglu vs gemm + silu_mul")
    # torch's reference rounds silu(g) * u in bf16 arithmetic: up to 4 ulps apart from fp32 then one rounding
    _assert_close(got, fo.silu_mul_ref(gm.gemm_ref(x, w, 1, bk)), "gemm_swiglu vs the torch reference", 4)
    with pytest.raises(ValueError, match="split_k == 1"):
        gm.gemm_swiglu(x, w, gm.GemmConfig(block_n=bn, block_k=bk, split_k=2))
    with pytest.raises(ValueError, match="even number of rows"):
        gm.gemm_swiglu(x, w[:-1], cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [c for c in GPU_VARIANTS if c.split_k == 1] + [gm.CONFIGS[(11264, 2048)]]
                         + [gm.GemmConfig(block_n=bn, block_k=128, pdl=True) for bn in (16, 32)], ids=str)
@pytest.mark.parametrize("m,inter,k", [(5, 200, 328), (16, 5632, 2048), (128, 5632, 2048)])
def test_gemm_swiglu_bitwise_equals_two_launches_cuda(cfg, m, inter, k):
    x, w = _inputs(m, 2 * inter, k, "cuda")
    assert torch.equal(gm.gemm_swiglu(x, w, cfg), fo.silu_mul(gm.gemm(x, w, cfg))), f"{cfg} M{m}"


@triton.jit
def _region_offsets_kernel(out_ptr, rows, cols, stride, lines, CHUNK: tl.constexpr):
    """Writes program p's offsets, chunk by chunk, to out[p, :] (the prefetch's addresses, without the PTX)."""
    p = tl.program_id(0)
    for c0 in range(0, lines, CHUNK):
        offs = gm._region_line_offsets(rows, cols, stride, lines, p, c0, CHUNK)
        idx = c0 + tl.arange(0, CHUNK)
        tl.store(out_ptr + p * tl.cdiv(lines, CHUNK) * CHUNK + idx, offs)


@pytest.mark.parametrize("rows,cols,stride,programs", [
    (7, 64, 64, 3),           # one line a row, lines not a multiple of the programs
    (5, 200, 256, 4),         # a partial last line a row; a view's row stride
    (3, 128, 2048, 16),       # more programs than lines: the spare ones repeat the last line
    (40, 512, 2048, 6),       # several chunks a program
])
def test_prefetch_region_offsets_cover_every_line_and_stay_inside(rows, cols, stride, programs):
    """gemm.next_weight_region's split of a region into per-program lines, read back through the interpreter:
    the offsets hit every 128-byte line of the region, and nothing outside it."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(rows, stride, dtype=torch.bfloat16)[:, :cols]
    (_, r, c, s, lines), _ = gm.next_weight_region(w, x, programs, use_pdl=True)
    chunk = 16
    per_prog = triton.cdiv(lines, chunk) * chunk
    out = torch.full((programs, per_prog), -1, dtype=torch.int64)
    _region_offsets_kernel[(programs,)](out, r, c, s, lines, CHUNK=chunk)
    written = out[out >= 0]
    expected = {row * stride + col for row in range(rows) for col in range(0, cols, 64)}
    assert set(written.tolist()) == expected
    assert lines == triton.cdiv(len(expected), programs)


@triton.jit
def _extra_share_kernel(out_ptr, TILES: tl.constexpr):
    tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0),
             gm._extra_share(tl.program_id(0), tl.program_id(1), TILES))


@pytest.mark.parametrize("columns,split_k,prefetch_programs", [(88, 1, 44), (32, 4, 4), (32, 4, 5), (48, 1, 1)])
def test_extra_prefetch_programs_take_every_share_once(columns, split_k, prefetch_programs):
    """GemmConfig.prefetch_programs: gemm.next_weight_launch adds ceil(programs / split_k) columns, the region's
    lines are split over exactly those programs, and each takes a different share (read back through the
    interpreter; the column-tile programs take none)."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(40, 512, dtype=torch.bfloat16)
    grid, region, mode = gm.next_weight_launch(w, x, columns, split_k, prefetch_programs, use_pdl=True)
    extra = grid[0] - columns
    assert grid == (columns + triton.cdiv(prefetch_programs, split_k), split_k) and mode == gm.NEXT_EXTRA.value
    assert region[4] == triton.cdiv(40 * 512 // 64, extra * split_k)
    shares = torch.full((split_k, grid[0]), -2, dtype=torch.int32)
    _extra_share_kernel[grid](shares, TILES=columns)
    assert (shares[:, :columns] == -1).all()
    assert sorted(shares[:, columns:].flatten().tolist()) == list(range(extra * split_k))
    # no extra programs asked for, or no PDL: the grid is the column tiles
    own = gm.NEXT_OWN.value
    assert gm.next_weight_launch(w, x, columns, split_k, 0, use_pdl=True)[::2] == ((columns, split_k), own)
    assert gm.next_weight_launch(w, x, columns, split_k, 8, use_pdl=False)[::2] == ((columns, split_k), 0)
    assert gm.next_weight_launch(None, x, columns, split_k, 0, use_pdl=True)[::2] == ((columns, split_k), 0)
    # extra programs with no region to prefetch would never be launched: refused, with or without PDL
    for use_pdl in (True, False):
        with pytest.raises(ValueError, match="prefetch_programs=8 needs a next_weight region"):
            gm.next_weight_launch(None, x, columns, split_k, 8, use_pdl=use_pdl)


class _LaunchSpy:
    """A Triton kernel that records the grid of each launch (``kernel[grid](...)``) and runs it."""

    def __init__(self, kernel, grids: list):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_prefetch_programs_without_a_next_weight_is_refused_before_the_launch(monkeypatch):
    """GemmConfig.prefetch_programs > 0 only adds programs that prefetch ``next_weight``: every launcher refuses it
    without one (ValueError naming the value) before any kernel runs, and runs it with one (on the CPU there is no
    PDL, so the region is not prefetched and the product is the plain one)."""
    x, w = _inputs(5, 128, 64, "cpu")
    cfg = gm.GemmConfig(block_n=64, block_k=64, prefetch_programs=8)
    launched = []
    monkeypatch.setattr(gm, "_gemm_kernel", _LaunchSpy(gm._gemm_kernel, launched))
    for call in (lambda: gm.gemm(x, w, cfg), lambda: gm.gemm_swiglu(x, w, cfg), lambda: gm.linear(x, w, cfg)):
        with pytest.raises(ValueError, match=r"prefetch_programs=8 needs a next_weight region .* got none"):
            call()
    with pytest.raises(ValueError, match="gemm_argmax takes no next_weight, so prefetch_programs=8"):
        gm.gemm_argmax(x, w, cfg)
    assert launched == [], "a refused configuration launched a kernel"
    nxt = _inputs(1, 32, 128, "cpu")[1]
    plain = gm.gemm(x, w, dataclasses.replace(cfg, prefetch_programs=0))
    assert torch.equal(gm.gemm(x, w, cfg, nxt), plain)
    assert len(launched) == 2


def test_prefetch_at_end_takes_whole_rows_and_refuses_extra_programs_and_unaligned_rows():
    """GemmConfig.prefetch_at_end: gemm.next_weight_launch's NEXT_TAIL mode, each of the grid's programs a share of
    ceil(rows / programs) whole rows; refused beside prefetch_programs (ValueError naming it), and a region whose
    rows a bulk prefetch cannot take (not on 16 bytes, or not 16-byte multiples long) is refused naming its shape."""
    with pytest.raises(ValueError, match="prefetch_at_end needs prefetch_programs=0.*got 4"):
        gm.GemmConfig(prefetch_at_end=True, prefetch_programs=4)
    with pytest.raises(ValueError, match="prefetch_at_end must be true or false, got 1"):
        gm.GemmConfig(prefetch_at_end=1)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(40, 512, dtype=torch.bfloat16)
    grid, region, mode = gm.next_weight_launch(w[:, :128], x, 6, 2, 0, use_pdl=True, at_end=True)
    assert grid == (6, 2) and mode == gm.NEXT_TAIL.value
    assert region[1:] == (40, 128, 512, triton.cdiv(40, 12))
    assert gm.next_weight_launch(w, x, 6, 2, 0, use_pdl=False, at_end=True)[2] == 0       # the CPU: no prefetch
    for bad in (w[:, 1:65], w[:, :12], torch.zeros(4, 100, dtype=torch.bfloat16)[:, :64].as_strided((4, 64), (100, 1))):
        with pytest.raises(ValueError, match="a prefetch at the end needs rows starting on 16 bytes"):
            gm.next_weight_launch(bad, x, 6, 2, 0, use_pdl=True, at_end=True)
    # the per-line modes take any 2-byte region, as before
    assert gm.next_weight_launch(w[:, 1:65], x, 6, 2, 0, use_pdl=True)[2] == gm.NEXT_OWN.value


def test_next_weight_region_refuses_bad_regions_and_is_off_without_pdl():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = torch.zeros(8, 128, dtype=torch.bfloat16)
    assert gm.next_weight_region(w, x, 4, use_pdl=False) == ((x, 0, 0, 0, 0), 0)      # the CPU / no PDL
    assert gm.next_weight_region(None, x, 4, use_pdl=True)[1] == 0
    assert gm.next_weight_region(w[:, :0], x, 4, use_pdl=True)[1] == 0
    with pytest.raises(TypeError, match="2-byte floats, got torch.float32"):
        gm.next_weight_region(w.float(), x, 4, use_pdl=False)
    with pytest.raises(ValueError, match="2-D with unit last stride"):
        gm.next_weight_region(w.t(), x, 4, use_pdl=False)
    with pytest.raises(ValueError, match="2-D with unit last stride"):
        gm.next_weight_region(w[0], x, 4, use_pdl=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(gm.CONFIGS))
def test_next_weight_prefetch_changes_no_bit_cuda(shape):
    """A GEMM that brings a later weight into L2 (gemm.next_weight_region, under PDL) gives the same bits as
    without, eager and replayed from a CUDA graph; likewise gemm_swiglu."""
    from loopbench.kernels import pdl
    n, k = shape
    x, w = _inputs(16, n, k, "cuda")
    nxt = _inputs(1, 11264, 2048, "cuda")[1][:, :512]
    cfg = gm.CONFIGS[shape]
    assert pdl.active(x)
    plain = gm.gemm(x, w, cfg)
    assert torch.equal(gm.gemm(x, w, cfg, nxt), plain)
    extra = dataclasses.replace(cfg, prefetch_programs=40)      # extra programs beside the grid take the region
    assert torch.equal(gm.gemm(x, w, extra, nxt), plain), f"{shape}: extra prefetch programs changed a bit"
    tail = dataclasses.replace(cfg, prefetch_at_end=True)       # every program whole rows at its end (bulk)
    assert torch.equal(gm.gemm(x, w, tail, nxt), plain), f"{shape}: the prefetch at the end changed a bit"
    assert torch.equal(gm.gemm(x, w, tail, _inputs(1, 2048, 2048, "cuda")[1].view(8192, 512)[:, :128]), plain)
    graph = torch.cuda.CUDAGraph()
    gm.gemm(x, w, cfg, nxt)                             # compiled before the capture
    with torch.cuda.graph(graph):
        out = gm.gemm(x, w, cfg, nxt)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain), f"{shape}: graph replay with the prefetch differs"
    if shape == (11264, 2048):
        glu = gm.SWIGLU_CONFIGS[shape]
        assert torch.equal(gm.gemm_swiglu(x, w, glu, nxt), gm.gemm_swiglu(x, w, glu))
        assert torch.equal(gm.gemm_swiglu(x, w, dataclasses.replace(glu, prefetch_programs=44), nxt),
                           gm.gemm_swiglu(x, w, glu))
        assert torch.equal(gm.gemm_swiglu(x, w, dataclasses.replace(glu, prefetch_at_end=True), nxt),
                           gm.gemm_swiglu(x, w, glu))


def _argmax_inputs(m, n, k, block_n, device):
    """x, w whose logits hold greedy ties within a tile and across a tile edge (columns 2, block_n - 1 and
    block_n), and a larger value in the last tile (column n - 1)."""
    x, w = _inputs(m, n, k, device)
    w[block_n - 1] = w[block_n] = w[2]
    w[n - 1] = w[5] * 3
    return x, w


@pytest.mark.parametrize("m,n,k,bn,bk", [(1, 200, 64, 64, 64), (5, 130, 96, 64, 32), (18, 256, 128, 64, 64)])
def test_gemm_argmax_partials_cpu(m, n, k, bn, bk):
    """The epilogue's per-tile maxima and first columns == argmax_partials_ref of the logits gemm writes, and
    the token from them == torch.argmax of those logits; with and without writing the logits."""
    x, w = _argmax_inputs(m, n, k, bn, "cpu")
    cfg = gm.GemmConfig(block_n=bn, block_k=bk)
    logits = gm.gemm(x, w, cfg)
    part, written = gm.gemm_argmax(x, w, cfg, logits=True)
    assert torch.equal(written, logits)
    want = gm.argmax_partials_ref(logits, bn)
    assert part.tile_max.shape == (triton.cdiv(n, bn), m)
    assert torch.equal(part.tile_max, want.tile_max) and torch.equal(part.tile_index, want.tile_index)
    assert torch.equal(gm.argmax_from_tiles_ref(part), logits.argmax(-1))
    alone, none = gm.gemm_argmax(x, w, cfg)
    assert none is None and torch.equal(alone.tile_index, part.tile_index)
    # a NaN logit wins its row, as torch.argmax's first NaN does
    w[7, 0] = float("nan")
    nan_part, nan_logits = gm.gemm_argmax(x, w, cfg, logits=True)
    assert gm.argmax_from_tiles_ref(nan_part).tolist() == nan_logits.argmax(-1).tolist() == [7] * m


def test_gemm_argmax_refuses_split_k():
    x, w = _inputs(4, 64, 64, "cpu")
    with pytest.raises(ValueError, match="split_k == 1"):
        gm.gemm_argmax(x, w, gm.GemmConfig(block_n=64, block_k=32, split_k=2))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [c for c in GPU_VARIANTS if c.split_k == 1] + [gm.CONFIGS[(49152, 2048)]], ids=str)
@pytest.mark.parametrize("m,n,k", [(5, 200, 328), (16, 49152, 2048), (32, 49152, 2048)])
def test_gemm_argmax_bitwise_cuda(cfg, m, n, k):
    """On CUDA, every split_k 1 variant and lm_head's configuration: the same logits bits as gemm, partials ==
    the reference of those logits, the sampled token == their torch.argmax, also captured in a CUDA graph."""
    x, w = _argmax_inputs(m, n, k, cfg.block_n, "cuda")
    logits = gm.gemm(x, w, cfg)
    part, written = gm.gemm_argmax(x, w, cfg, logits=True)
    assert torch.equal(written, logits)
    want = gm.argmax_partials_ref(logits, cfg.block_n)
    assert torch.equal(part.tile_max, want.tile_max) and torch.equal(part.tile_index, want.tile_index)
    assert torch.equal(gm.argmax_from_tiles_ref(part), logits.argmax(-1))
    graph = torch.cuda.CUDAGraph()
    gm.gemm_argmax(x, w, cfg)                    # compile outside the capture
    with torch.cuda.graph(graph):
        captured, _ = gm.gemm_argmax(x, w, cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.tile_index, part.tile_index) and torch.equal(captured.tile_max, part.tile_max)
