"""kernels/mlp_block.py: the layer's half after attention in one persistent launch == its torch reference.

CPU (Triton interpreter): the staged form (five launches of the same code, no barriers) on shapes whose units
cross tile, split and program boundaries (more units than programs, uneven gate_up shares, rows past the grid),
against ``mlp_block_ref`` to a few roundings (not bitwise: other accumulation orders). CUDA: a first launch in a
child process with a time limit (a broken barrier hangs rather than fails), then the Ouro shape at every bucket:
the one launch bitwise its staged form (the same arithmetic), repeated, under a CUDA graph, and near the five
kernels the fused loop runs today.
"""
import pytest
import torch

from loopbench.kernels import fused_ops as fo
from loopbench.kernels import gemm as gm
from loopbench.kernels import mlp_block as mb
from tests.kernels.child import first_half_launch_counts
from tests.kernels.test_gemm_norm import close_ulps

SMALL = mb.MlpBlockConfig(o_bn=16, o_split=2, u_bn=16, d_bn=16, d_split=2, block_k=32, pre_o=64, pre_u=64,
                          pre_d=64, num_warps=4, num_stages=1, u_block_k=64)


def _inputs(m, hidden, inter, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device, dtype)
    a, x = r(m, hidden), r(m, hidden)
    w_o, gate_up, down = r(hidden, hidden, scale=hidden ** -0.5), r(2 * inter, hidden, scale=hidden ** -0.5), \
        r(hidden, inter, scale=inter ** -0.5)
    lns = [1 + r(hidden, scale=0.1) for _ in range(4)]
    gate = (r(1, hidden, scale=hidden ** -0.5), r(1))
    return a, x, w_o, gate_up, down, lns, gate


def _five(a, x, w_o, gate_up, down, lns, gate, cfg=None):
    """The five kernels the fused loop runs for this half of a layer (``cfg``: every GEMM's, else the Ouro
    shapes' own); they differ from the block in the GEMMs' accumulation order only."""
    h, i = down.shape
    o = gm.gemm(a, w_o, cfg or gm.CONFIGS[(h, h)])
    x1, h1 = fo.add_rms_norm(x, o, lns[0], lns[1], 1e-6)
    act = gm.gemm_swiglu(h1, gate_up, cfg or gm.SWIGLU_CONFIGS[(2 * i, h)])
    d = gm.gemm(act, down, cfg or gm.CONFIGS[(h, i)])
    if gate is None:
        return fo.add_rms_norm(x1, d, lns[2], lns[3], 1e-6)
    return fo.add_rms_norm_gate(x1, d, lns[2], lns[3], 1e-6, *gate)


def _near_the_five_kernels(got, five, ulps):
    """x2 and h2 within ``ulps`` of their dtype's epsilon of the five kernels' (other accumulation orders). The
    hazard is fp32 but a function of h2: an element of h2 a model-dtype ulp off moves it by about that much (seen:
    1.1e-4 at fp16 where numpy's BLAS on another CPU summed in another order), so its tolerance is in h2's ulps."""
    for o, f, what in zip(got[:2], five[:2], ("x2", "h2")):
        close_ulps(o, f, f"{what} against the five kernels", ulps=ulps)
    if len(got) == 3:
        close_ulps(got[2].to(got[1].dtype), five[2].to(got[1].dtype), "hazard against the five kernels", ulps=ulps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,hidden,inter", [(1, 128, 192), (5, 128, 192), (11, 256, 320)])
@pytest.mark.parametrize("with_gate", [False, True])
def test_staged_block_is_the_reference_on_the_interpreter(dtype, m, hidden, inter, with_gate):
    """8 programs: o_proj 16-32 units (2-4 a program; at hidden 128 the head is the whole K range), gate_up 12-20 units of 16
    (1-3 a program), M 11 rows past the grid (program p also takes row p + 8)."""
    a, x, w_o, gate_up, down, lns, gate = _inputs(m, hidden, inter, dtype, "cpu", seed=m + hidden)
    g = gate if with_gate else None
    got = mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, SMALL, gate=g)
    want = mb.mlp_block_ref(a, x, w_o, gate_up, down, *lns, 1e-6, gate=g)
    assert len(got) == len(want) == 2 + with_gate
    close_ulps(got[0], want[0], "x2", ulps=8)      # the torch norms round elsewhere than the norm kernel (3 ulps seen)
    close_ulps(got[1], want[1], "h2", ulps=8)
    if with_gate:
        assert torch.allclose(got[2], want[2].float(), rtol=0, atol=2e-2), (got[2], want[2])
    five = _five(a, x, w_o, gate_up, down, lns, g, gm.GemmConfig(block_n=16, block_k=32, num_stages=1))
    _near_the_five_kernels(got, five, ulps=4)


@pytest.mark.parametrize("split,u_bn,m", [(1, 16, 9), (4, 32, 33)])
def test_other_splits_unit_widths_and_wide_batches_on_the_interpreter(split, u_bn, m):
    """o_proj / down in 1 split (one fp32 partial, rounded before its norm as a stored projection is) or 4, gate_up
    units of 32 columns, and 33 rows (a 64-row tile, rows past 4 x the grid)."""
    cfg = mb.MlpBlockConfig(o_bn=16, o_split=split, u_bn=u_bn, d_bn=16, d_split=split, block_k=32, pre_o=64,
                            pre_u=64, pre_d=64, u_block_k=64)
    a, x, w_o, gate_up, down, lns, gate = _inputs(m, 256, 512, torch.float16, "cpu", seed=split)
    got = mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, cfg, gate=gate)
    five = _five(a, x, w_o, gate_up, down, lns, gate, gm.GemmConfig(block_n=16, block_k=32, num_stages=1))
    close_ulps(got[0], five[0], "x2 against the five kernels", ulps=4)
    close_ulps(got[1], five[1], "h2 against the five kernels", ulps=4)
    # split 4 rounds its projections' sums where the five kernels' split 1 rounds one product: the gate logit may
    # move by a rounding of h2's dtype
    assert torch.allclose(got[2], five[2], rtol=0, atol=1e-3), (got[2] - five[2]).abs().max()


def test_only_runs_the_stages_asked_for():
    """``only`` takes the stage constants or their values; O then N1 alone leave x2 unwritten (NaN-filled here) and
    give the x1 / h1 of the whole block (read back through the next stages, run alone afterwards)."""
    a, x, w_o, gate_up, down, lns, _ = _inputs(4, 128, 192, torch.bfloat16, "cpu")
    whole = mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, SMALL)
    for only in ((mb.O, mb.N1, mb.U, mb.D, mb.N2), (0, 1, 2, 3, 4)):
        got = mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, SMALL, only=only)
        assert all(torch.equal(p, q) for p, q in zip(got, whole))
    for bad in ((), 0, (5,), [mb.ALL]):
        with pytest.raises(ValueError, match="only needs staged=True and a non-empty sequence"):
            mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, SMALL, only=bad)


def test_a_counters_tensor_serves_one_grid():
    """A counters tensor keeps its grid while it lives; a new one (even at a freed one's address) starts free."""
    c = mb.new_counters("cpu")
    mb.claim_counters(c, 132)
    mb.claim_counters(c, 132)
    with pytest.raises(ValueError, match="served launches of 132 programs; a launch of 264 programs"):
        mb.claim_counters(c, 264)
    mb.claim_counters(mb.new_counters("cpu"), 264)


def test_mlp_block_names_what_it_cannot_run():
    a, x, w_o, gate_up, down, lns, gate = _inputs(4, 128, 192, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="1 <= M <= 64"):
        big = torch.zeros(65, 128, dtype=a.dtype)
        mb.mlp_block(big, big, w_o, gate_up, down, *lns, 1e-6, SMALL)
    with pytest.raises(ValueError, match=r"down must be contiguous \[128, 192\]"):
        mb.mlp_block(a, x, w_o, gate_up, down[:, :96], *lns, 1e-6, SMALL)
    with pytest.raises(TypeError, match="gate_up must be bfloat16 or float16 like a"):
        mb.mlp_block(a, x, w_o, gate_up.float(), down, *lns, 1e-6, SMALL)
    with pytest.raises(ValueError, match="intermediate=200 is not a multiple of 16"):
        mb.mlp_block(a, x, w_o, torch.zeros(400, 128, dtype=a.dtype), torch.zeros(128, 200, dtype=a.dtype), *lns,
                     1e-6, SMALL)
    with pytest.raises(ValueError, match="pre_o=128 exceeds its unit's K range 64"):
        mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6,
                     mb.MlpBlockConfig(o_bn=16, o_split=2, u_bn=16, d_bn=16, d_split=2, block_k=32, pre_o=128,
                                       pre_u=64, pre_d=64, u_block_k=None))
    with pytest.raises(ValueError, match=r"ln_next must be \[128\]"):
        mb.mlp_block(a, x, w_o, gate_up, down, *lns[:3], lns[3][:64], 1e-6, SMALL)
    with pytest.raises(ValueError, match=r"x must be contiguous, got strides \(256, 1\)"):
        mb.mlp_block(a, torch.cat([x, x], 1)[:, :128], w_o, gate_up, down, *lns, 1e-6, SMALL)
    with pytest.raises(ValueError, match="x must be contiguous"):
        mb.mlp_block(a, x[:1].expand(4, 128), w_o, gate_up, down, *lns, 1e-6, SMALL)
    for eps in (None, "1e-6", -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            mb.mlp_block(a, x, w_o, gate_up, down, *lns, eps, SMALL)
    with pytest.raises(TypeError, match="ln_post must be a floating-point tensor, got torch.int64"):
        mb.mlp_block(a, x, w_o, gate_up, down, lns[0], lns[1].long(), *lns[2:], 1e-6, SMALL)
    for bad in ((gate[0], 0.5), (gate[0], gate[1], gate[1]), (gate[0], gate[1].long())):
        with pytest.raises(TypeError, match=r"gate must be \(weight, bias\)"):
            mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, SMALL, gate=bad)
    with pytest.raises(ValueError, match="hidden and intermediate must be positive, got 128 and 0"):
        mb.mlp_block(a, x, w_o, gate_up[:0], down[:, :0], *lns, 1e-6, SMALL)
    with pytest.raises(ValueError, match="hidden=128 is not a multiple of 3"):
        mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, mb.MlpBlockConfig(o_bn=16, o_split=3, u_bn=16, d_bn=16,
                                                                                d_split=2, block_k=32, u_block_k=32,
                                                                                pre_o=0, pre_u=0, pre_d=0))
    with pytest.raises(ValueError, match="one launch needs counters"):
        mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, SMALL, staged=False)
    with pytest.raises(ValueError, match=r"pre_u must be 0 or a power of two >= 64 \(128-byte lines\), got 48"):
        mb.MlpBlockConfig(block_k=32, pre_u=48)
    with pytest.raises(ValueError, match="u_bn must be a power of two >= 16, got 24"):
        mb.MlpBlockConfig(u_bn=24)


@pytest.mark.gpu
def test_first_cuda_launch_finishes_in_a_child_process():
    """The barriers, once, where a hang costs a time limit and not the suite."""
    first_half_launch_counts("mlp_block", "k.CONFIGS[(h, i)]", mb.BARRIERS)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("with_gate", [False, True])
def test_ouro_shape_on_cuda_is_its_staged_form_bitwise(m, with_gate):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    h, i = 2048, 5632
    cfg = mb.CONFIGS[(h, i)]
    a, x, w_o, gate_up, down, lns, gate = _inputs(m, h, i, torch.bfloat16, "cuda", seed=m)
    g = gate if with_gate else None
    counters = mb.new_counters("cuda")
    staged = mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, cfg, gate=g, staged=True)
    for _ in range(20):
        got = mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, cfg, counters, g)
    torch.cuda.synchronize()
    grid = mb.programs_for("cuda")
    assert counters.tolist() == [20 * grid] * mb.BARRIERS
    for s, o, what in zip(staged, got, ("x2", "h2", "hazard")):
        assert torch.equal(s, o), f"{what}: max diff {(s.double() - o.double()).abs().max().item():.3e}"
    # near the five kernels of the fused loop (other accumulation orders: a few roundings)
    five = _five(a, x, w_o, gate_up, down, lns, g)
    _near_the_five_kernels(got, five, ulps=8)
    # the first M rows of a larger batch are the M-row result (batch invariance)
    a64, x64 = torch.cat([a, torch.randn(64 - m, h, device="cuda", dtype=a.dtype)]), \
        torch.cat([x, torch.randn(64 - m, h, device="cuda", dtype=a.dtype)])
    big = mb.mlp_block(a64, x64, w_o, gate_up, down, *lns, 1e-6, cfg, counters, g)
    for s, o in zip(big, got):
        assert torch.equal(s[:m], o), "rows depend on the batch around them"
    # under a CUDA graph, replayed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, cfg, counters, g)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    for s, o in zip(static, got):
        assert torch.equal(s, o), "a replay differs from an eager launch"


@pytest.mark.gpu
def test_grid_changes_no_bit_and_a_grid_that_cannot_be_resident_is_refused():
    """Two programs an SM (smaller o_proj / down tiles, which fit twice) give the bits of one program an SM with the
    same tiles: every unit runs whole on one program. A configuration that cannot have two programs on an SM at once
    (shared memory) is refused before it launches, not left to hang on its barriers."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    h, i = 2048, 5632
    one = mb.MlpBlockConfig(o_bn=32, d_bn=32, u_bn=16)
    two = mb.MlpBlockConfig(o_bn=32, d_bn=32, u_bn=16, programs_per_sm=2)
    a, x, w_o, gate_up, down, lns, _ = _inputs(16, h, i, torch.bfloat16, "cuda", seed=3)
    got_one = mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, one, mb.new_counters("cuda"))
    counters = mb.new_counters("cuda")      # one grid a counters tensor (claim_counters)
    got_two = mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, two, counters)
    for p, q in zip(got_one, got_two):
        assert torch.equal(p, q)
    too_big = mb.MlpBlockConfig(programs_per_sm=2)        # 164 KB of shared memory a program (H100)
    with pytest.raises(ValueError, match="do not fit on one SM"):
        mb.mlp_block(a, x, w_o, gate_up, down, *lns, 1e-6, too_big, counters)
