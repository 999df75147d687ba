"""kernels/bench/ablate.py: each switch replaces its kernel entry point by a launch-free stand-in of the right shape
and hands the other arguments to the throughput probe unchanged."""
import pytest
import torch

from loopbench.harness import throughput
from loopbench.kernels import decode_attention, fused_ops, gemm, qkv_rope, wgmma_gemm
from loopbench.kernels.bench import ablate


@pytest.fixture
def probe_args(monkeypatch):
    """The arguments the probe would get; the replaced entry points are restored after the test."""
    got = []
    monkeypatch.setattr(throughput, "main", lambda argv: got.append(argv) or 0)
    monkeypatch.setattr(fused_ops, "add_rms_norm", fused_ops.add_rms_norm)
    for replacements in ablate.SWITCHES.values():
        for module, name, _ in replacements:
            monkeypatch.setattr(module, name, getattr(module, name))
    return got


def test_without_a_switch_the_probe_runs_unchanged(probe_args):
    before = (fused_ops.add_rms_norm, decode_attention.decode_attention)
    assert ablate.main(["--preset", "tiny", "--repeats", "2"]) == 0
    assert probe_args == [["--preset", "tiny", "--repeats", "2"]]
    assert (fused_ops.add_rms_norm, decode_attention.decode_attention) == before


def test_no_norm_passes_the_residual_through(probe_args):
    ablate.main(["--preset", "tiny", "--no-norm"])
    assert probe_args == [["--preset", "tiny"]]
    x, y = torch.randn(3, 8), torch.randn(2, 3, 8)              # y as split-K partials: ignored
    x_new, h = fused_ops.add_rms_norm(x, y, torch.ones(8), torch.ones(8), 1e-6)
    assert x_new is x and h is x
    assert decode_attention.decode_attention is not ablate._no_attention


def test_no_attention_returns_one_zero_tensor_per_shape(probe_args):
    ablate.main(["--no-attention", "--max-num-seqs", "4"])
    assert probe_args == [["--max-num-seqs", "4"]]
    q = torch.randn(4, 2, 16, dtype=torch.bfloat16)
    out = decode_attention.decode_attention(q, None, None, layout="native")
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert decode_attention.decode_attention(torch.randn_like(q.float()).to(q.dtype)) is out
    assert decode_attention.decode_attention(q[:2]).shape == (2, 2, 16)


def test_no_projections_return_zeros_of_each_output_shape(probe_args):
    ablate.main(["--no-projections"])
    assert probe_args == [[]]
    x, w = torch.randn(5, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    qkv = qkv_rope.qkv_rope_write_kv(x, w, None, None, None, None, None, None, None, None, None, None)
    assert qkv.shape == (5, 48) and qkv.dtype == torch.bfloat16 and not qkv.any()
    for module in (wgmma_gemm, gemm):
        whole = module.gemm(x, w, wgmma_gemm.WgmmaConfig(split_k=1))
        parts = module.gemm(x, w, wgmma_gemm.WgmmaConfig(split_k=4))
        assert whole.shape == (5, 48) and whole.dtype == torch.bfloat16 and not whole.any()
        assert parts.shape == (4, 5, 48) and parts.dtype == torch.float32 and not parts.any()
    for module in (wgmma_gemm, gemm):
        act = module.gemm_swiglu(x, w, None)
        assert act.shape == (5, 24) and act.dtype == torch.bfloat16 and not act.any()
    assert fused_ops.add_rms_norm is not ablate._no_norm
