"""kernels/gemm_norm.py: the split-K projection whose programs then run the norm step == gemm + add_rms_norm.

CPU (Triton interpreter): the last program to arrive runs every row, bitwise the separate kernels' results (the
interpreter's sums do not depend on the launch's warps). CUDA: the last M programs wait for the others and take a
row each; a first launch runs in a child process with a time limit (a broken arrival protocol hangs rather than
fails), then the Ouro shapes at every graph bucket, repeated and under a CUDA graph, against the separate kernels
to rounding (this kernel's fp32 row sums run in another warp layout).
"""
import pytest
import torch

from loopbench.kernels import fused_ops as fo
from loopbench.kernels import gemm as gm
from loopbench.kernels import gemm_norm as gn
from tests.kernels.child import run_in_child

SMALL = gm.GemmConfig(block_n=64, block_k=64, split_k=4, num_stages=1)


def _inputs(m, n, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    res = torch.randn(m, n, generator=g).to(device, dtype)
    w1, w2 = (1 + 0.1 * torch.randn(n, generator=g)).to(device, dtype), torch.randn(n, generator=g).to(device, dtype)
    gate = ((torch.randn(1, n, generator=g) / n ** 0.5).to(device, dtype), torch.randn(1, generator=g).to(device, dtype))
    return x, w, res, w1, w2, gate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,spin", [(1, 128, False), (5, 128, False), (8, 128, False), (3, 96, False),
                                      (8, 200, False), (1, 128, True), (1, 200, True)])
@pytest.mark.parametrize("with_gate", [False, True])
def test_gemm_add_rms_norm_is_the_separate_kernels_bitwise_on_the_interpreter(dtype, m, n, spin, with_gate):
    """Column tiles of 64 over N 96-200 (uneven, masked), K 320 in 5 tiles over 4 splits, M up to the grid's size.
    ``spin``: the CUDA protocol itself (the one waiting program at M 1 is the last to arrive, so it does not wait
    on the interpreter): the rank-to-row mapping, the done counter and both resets."""
    x, w, res, w1, w2, gate = _inputs(m, n, 320, dtype, "cpu", seed=m + n)
    counters = gn.new_counters("cpu")
    got = gn.gemm_add_rms_norm(x, w, SMALL, res, w1, w2, 1e-6, counters, gate if with_gate else None, spin=spin)
    part = gm.gemm(x, w, SMALL)
    want = (fo.add_rms_norm_gate(res, part, w1, w2, 1e-6, *gate) if with_gate else fo.add_rms_norm(res, part, w1, w2, 1e-6))
    assert len(got) == len(want)
    for a, b, what in zip(got, want, ("x_new", "h", "hazard")):
        assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max().item():.3e}"
    assert counters.tolist() == [0, 0], "a launch must leave its counters zero"


def test_gemm_add_rms_norm_names_what_it_cannot_run():
    x, w, res, w1, w2, gate = _inputs(4, 128, 256, torch.bfloat16, "cpu")
    c = gn.new_counters("cpu")
    with pytest.raises(ValueError, match="pointer-load config with split_k > 1"):
        gn.gemm_add_rms_norm(x, w, gm.GemmConfig(split_k=1), res, w1, w2, 1e-6, c)
    with pytest.raises(ValueError, match="pointer-load config with split_k > 1"):
        gn.gemm_add_rms_norm(x, w, gm.GemmConfig(split_k=4, tma=True), res, w1, w2, 1e-6, c)
    with pytest.raises(ValueError, match="9 rows but 8 programs"):
        x9, _, res9, *_ = _inputs(9, 128, 256, torch.bfloat16, "cpu")
        gn.gemm_add_rms_norm(x9, w, SMALL, res9, w1, w2, 1e-6, c)
    with pytest.raises(ValueError, match=r"residual must be \[4, 128\]"):
        gn.gemm_add_rms_norm(x, w, SMALL, res[:, :64], w1, w2, 1e-6, c)
    with pytest.raises(ValueError, match="counters must be new_counters"):
        gn.gemm_add_rms_norm(x, w, SMALL, res, w1, w2, 1e-6, torch.zeros(2))
    with pytest.raises(ValueError, match=r"the gate must be a \[1, 128\] or \[128\] weight .* got \(1, 64\)"):
        gn.gemm_add_rms_norm(x, w, SMALL, res, w1, w2, 1e-6, c, (gate[0][:, :64], gate[1]))
    with pytest.raises(ValueError, match=r"got \(2, 64\)"):                 # as many elements, another shape
        gn.gemm_add_rms_norm(x, w, SMALL, res, w1, w2, 1e-6, c, (gate[0].reshape(2, 64), gate[1]))
    with pytest.raises(ValueError, match=r"w1 must be \[128\] with unit stride"):
        gn.gemm_add_rms_norm(x, w, SMALL, res, torch.ones(256, dtype=w1.dtype)[::2], w2, 1e-6, c)
    with pytest.raises(ValueError, match="spin on the interpreter needs M = 1"):
        gn.gemm_add_rms_norm(x, w, SMALL, res, w1, w2, 1e-6, c, spin=True)
    assert c.tolist() == [0, 0], "a refused call must not touch the counters"


def close_ulps(a, b, what, ulps=2):
    """a within ``ulps`` of its dtype's epsilon of b, relative (absolute below 1); the message gives max and mean."""
    diff = (a.double() - b.double()).abs()
    tol = ulps * torch.finfo(a.dtype).eps * b.double().abs().clamp(min=1.0)
    assert bool((diff <= tol).all()), f"{what}: max diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}"


@pytest.mark.gpu
def test_first_cuda_launch_finishes_in_a_child_process():
    """The arrival protocol, once, where a hang costs a time limit and not the suite."""
    proc = run_in_child("""
        import torch
        from loopbench.kernels import gemm as gm, gemm_norm as gn
        torch.manual_seed(0)
        x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) / 45
        res = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
        w1 = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
        c = gn.new_counters("cuda")
        gn.gemm_add_rms_norm(x, w, gm.config_for(2048, 2048, 16), res, w1, w1, 1e-6, c)
        torch.cuda.synchronize()
        print("counters", c.tolist())
    """)
    assert proc.returncode == 0 and "counters [0, 0]" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 2048), (2048, 5632)], ids=["o_proj", "down"])
@pytest.mark.parametrize("m", [1, 16, 32, 64, 128])
@pytest.mark.parametrize("with_gate", [False, True])
def test_ouro_shapes_on_cuda_match_the_separate_kernels(shape, m, with_gate):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, k = shape
    cfg = gm.config_for(n, k, m)
    if cfg is None or cfg.tma or cfg.split_k < 2 or not gn.fits("cuda", cfg, n):
        pytest.skip(f"no split-K pointer config that fits for {shape} at M={m}: {cfg}")
    x, w, res, w1, w2, gate = _inputs(m, n, k, torch.bfloat16, "cuda", seed=m)
    counters = gn.new_counters("cuda")
    part = gm.gemm(x, w, cfg)
    want = (fo.add_rms_norm_gate(res, part, w1, w2, 1e-6, *gate) if with_gate else fo.add_rms_norm(res, part, w1, w2, 1e-6))
    for _ in range(20):        # repeated launches: each must find its counters zero
        got = gn.gemm_add_rms_norm(x, w, cfg, res, w1, w2, 1e-6, counters, gate if with_gate else None)
    torch.cuda.synchronize()
    assert counters.tolist() == [0, 0]
    close_ulps(got[0], want[0], "x_new")
    close_ulps(got[1], want[1], "h")
    if with_gate:
        assert torch.allclose(got[2], want[2], rtol=0, atol=2e-3)
    # the same under a CUDA graph, replayed
    static = gn.gemm_add_rms_norm(x, w, cfg, res, w1, w2, 1e-6, counters, gate if with_gate else None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = gn.gemm_add_rms_norm(x, w, cfg, res, w1, w2, 1e-6, counters, gate if with_gate else None)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    assert counters.tolist() == [0, 0]
    for a, b in zip(static, got):
        assert torch.equal(a, b), "a replay differs from an eager launch"
