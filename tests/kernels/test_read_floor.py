"""kernels/bench/read_floor.py's streaming-sum kernel on the interpreter: each program sums its share, the last
share cut by the mask."""
import pytest
import torch

from loopbench.kernels.bench import read_floor


@pytest.mark.parametrize("programs, block", [(1, 64), (3, 64), (7, 128)])
def test_each_program_sums_its_share(programs, block):
    n = 5 * block * programs - 37                      # not a whole number of blocks: the last share is masked
    w = torch.randn(n, generator=torch.Generator().manual_seed(programs)).to(torch.bfloat16)
    out = torch.full((programs + 1,), -1.0)
    read_floor.stream_sum(w, out, programs, block, warps=4, stages=2)
    share = -(-n // (programs * block)) * block
    want = torch.stack([w[i * share:(i + 1) * share].double().sum() for i in range(programs)])
    diff = (out[:programs].double() - want).abs()
    assert diff.max() < 1e-3, f"max diff {diff.max():.3g}, mean {diff.mean():.3g}"
    assert out[programs] == -1.0, "a program past the grid wrote"
