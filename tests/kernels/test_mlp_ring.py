"""kernels/mlp_ring.py: the layer's half after attention as one persistent Gluon launch with a weight ring.

CPU: the kernel compiles for sm_90 at every row bucket and fits an SM's shared memory; bad configurations are named.
CUDA (sm_90): a first launch in a child process with a time limit (a broken barrier hangs rather than fails), then
the Ouro shape at several M: near the kernels the fused loop runs today (other accumulation orders in the norms),
repeated and replayed under a CUDA graph bitwise, and its first M rows bitwise those of a 64-row batch.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from loopbench.kernels import fused_ops as fo
from loopbench.kernels import gemm as gm
from loopbench.kernels import mlp_ring as mr
from loopbench.kernels import wgmma_gemm as wg
from tests.kernels.child import REPO, first_half_launch_counts
from tests.kernels.test_gemm_norm import close_ulps

H, I = 2048, 5632


def test_compiles_for_sm90_and_fits_shared_memory():
    """Compiled in a child without TRITON_INTERPRET (the suite sets it, and Gluon's reductions are jit functions that
    the interpreter would take over): at every row bucket the program fits an SM, holds its whole pipeline, and
    has the four grid barriers and the PDL wait; the lean barriers (``_diag`` 4) compile too, and with them the
    timing form without norm steps (``_diag`` 12)."""
    pytest.importorskip("triton.experimental.gluon")
    code = textwrap.dedent("""
        import json
        from loopbench.kernels import mlp_ring as mr
        out = {}
        for bm in (16, 32, 64):
            k = mr.compile_sm90(mr.RingConfig(), bm)
            ptx = k.asm["ptx"]
            out[bm] = [k.metadata.shared, ptx.count("atom.add.release.gpu.u64"), ptx.count("griddepcontrol.wait")]
        lean = mr.compile_sm90(mr.RingConfig(), 16, diag=4).asm["ptx"]
        out["lean"] = [lean.count("setp.eq.u32 p, t, 32"), lean.count("fence.acq_rel.gpu")]
        bare = mr.compile_sm90(mr.RingConfig(), 16, diag=12).asm["ptx"]     # lean barriers without the norm steps
        out["lean_no_norms"] = [bare.count("setp.eq.u32 p, t, 32"), bare.count("atom.add.release.gpu.u64")]
        print(json.dumps(out))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = mr.RingConfig()
    for bm in (16, 32, 64):
        shared, barriers, waits = got[str(bm)]
        assert cfg.smem_bytes(bm, cfg.stages_for(bm)) <= shared <= wg.SHARED_LIMIT, (bm, shared)
        assert barriers == mr.BARRIERS and waits >= 1, (bm, barriers, waits)
    assert got["lean"] == [2 * mr.BARRIERS, 0], got["lean"]        # _diag 4: thread 32 arrives and spins, no fences
    assert got["lean_no_norms"] == [2 * mr.BARRIERS, mr.BARRIERS], got["lean_no_norms"]    # _diag 12 keeps the barriers


def test_bad_configurations_are_named():
    with pytest.raises(ValueError, match="stages must be a positive int, got 0"):
        mr.RingConfig(stages=0)
    with pytest.raises(ValueError, match="block_n 64"):
        mr.RingConfig(block_n=128)
    with pytest.raises(ValueError, match="intermediate / d_split=1424 is not a multiple of 128"):
        mr.check_config(mr.RingConfig(), 2048, 5696)
    with pytest.raises(ValueError, match="more than"):
        mr.RingConfig(x_stages=30).stages_for(64)
    assert mr.RingConfig(stages=12, x_stages=4).stages_for(64) < 12 == mr.RingConfig().stages_for(16)


def _inputs(m, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0):
        return scale * torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    a, x = r(m, H), r(m, H)
    weights = (r(H, H, scale=H ** -0.5), r(2 * I, H, scale=H ** -0.5), r(H, I, scale=I ** -0.5))
    return a, x, weights, [1 + r(H, scale=0.1) for _ in range(4)], (r(1, H, scale=H ** -0.5), r(1))


def _today(a, x, weights, lns, gate):
    """The fused loop's kernels for this half of a layer."""
    w_o, gate_up, down = weights
    o = wg.gemm(a, w_o, wg.CONFIGS[(H, H)])
    x1, h1 = fo.add_rms_norm(x, o, lns[0], lns[1], 1e-6)
    act = gm.gemm_swiglu(h1, gate_up, gm.SWIGLU_CONFIGS[(2 * I, H)])
    return fo.add_rms_norm_gate(x1, wg.gemm(act, down, wg.CONFIGS[(H, I)]), lns[2], lns[3], 1e-6, *gate)


@pytest.mark.gpu
def test_first_cuda_launch_finishes_in_a_child_process():
    """The barriers, once, where a hang costs a time limit and not the suite."""
    first_half_launch_counts("mlp_ring", "k.RingConfig()", mr.BARRIERS, timeout_s=120)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16, 32, 64])
def test_ouro_shape_is_near_todays_kernels_and_batch_invariant(m):
    """Within a few roundings of the kernels the fused loop runs today (x2, h2, hazard; the norms' sums reduce in
    another order), and bitwise itself when repeated, inside a larger batch and replayed from a CUDA graph."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90 GPU")
    a, x, weights, lns, gate = _inputs(m, seed=m)
    cfg = mr.RingConfig()
    counters = mr.new_counters("cuda")
    got = mr.mlp_ring(a, x, *weights, *lns, 1e-6, cfg, counters, gate)
    for _ in range(5):
        again = mr.mlp_ring(a, x, *weights, *lns, 1e-6, cfg, counters, gate)
        for p, q in zip(got, again):
            assert torch.equal(p, q), "a repeated launch differs"
    today = _today(a, x, weights, lns, gate)
    for o, t, what in zip(got[:2], today[:2], ("x2", "h2")):
        close_ulps(o, t, f"{what} against today's kernels", ulps=8)
    close_ulps(got[2].to(got[1].dtype), today[2].to(got[1].dtype), "hazard against today's kernels", ulps=8)
    pad = torch.randn(64 - m, H, device="cuda", dtype=torch.bfloat16)
    big = mr.mlp_ring(torch.cat([a, pad]), torch.cat([x, pad]), *weights, *lns, 1e-6, cfg, counters, gate)
    for p, q in zip(big, got):
        assert torch.equal(p[:m], q), "rows depend on the batch around them"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = mr.mlp_ring(a, x, *weights, *lns, 1e-6, cfg, counters, gate)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(static, got):
        assert torch.equal(p, q), "a replay differs from an eager launch"
