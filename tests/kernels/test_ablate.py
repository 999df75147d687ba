"""kernels/bench/ablate.py: each switch replaces its kernel entry point by a launch-free stand-in of the right shape
and hands the other arguments to the throughput probe unchanged."""
import pytest
import torch

from loopbench.harness import throughput
from loopbench.kernels import decode_attention, fused_ops
from loopbench.kernels.bench import ablate


@pytest.fixture
def probe_args(monkeypatch):
    """The arguments the probe would get; the replaced entry points are restored after the test."""
    got = []
    monkeypatch.setattr(throughput, "main", lambda argv: got.append(argv) or 0)
    monkeypatch.setattr(fused_ops, "add_rms_norm", fused_ops.add_rms_norm)
    monkeypatch.setattr(decode_attention, "decode_attention", decode_attention.decode_attention)
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
