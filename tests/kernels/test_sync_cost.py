"""kernels/bench/sync_cost.py's stream kernel on the interpreter: chain and stream modes sum what torch sums.
(The barrier mode waits for programs the interpreter runs later: GPU only, where the bench itself checks that
chain and barrier agree bitwise.)"""
import pytest
import torch

from loopbench.kernels.bench import sync_cost


@pytest.mark.parametrize("mode, dependent", [("chain", True), ("stream", False)])
@pytest.mark.parametrize("prewait", [False, True])
def test_stream_sums_match_torch(mode, dependent, prewait):
    group_mb = sync_cost.UNROLL * sync_cost.BLOCK * 2 / 2 ** 20
    s = sync_cost.Stream(2.5 * 3 * group_mb, programs=3, device="cpu", min_bytes=1)   # 3 groups a share
    assert (s.iters, s.slices) == (3, 8)
    got = s.result(mode, False, prewait)
    torch.testing.assert_close(got.double(), s.reference(dependent), rtol=1e-5, atol=1e-3)


def test_no_bytes_leaves_only_the_dependency():
    s = sync_cost.Stream(0, programs=4, device="cpu")
    assert s.iters == 0 and s.slices == 64
    assert torch.equal(s.result("chain", False, False), torch.zeros(64, 4))


@pytest.mark.parametrize("mode", ["chunks", "dynamic"])
def test_chunk_modes_sum_each_chunk_onto_the_previous_slice(mode):
    group_mb = sync_cost.UNROLL * sync_cost.BLOCK * 2 / 2 ** 20
    s = sync_cost.Stream(2 * 3 * group_mb, programs=3, device="cpu", min_bytes=1)    # 6 chunks a slice
    assert s.chunks == 6
    for _ in range(2):      # the work queue restarts at chunk 0 in the next launch without a reset
        got = s.result(mode, False, False)
        torch.testing.assert_close(got.double(), s.chunk_reference(), rtol=1e-5, atol=1e-3)
    assert s.queue.tolist() == [2 * (6 + 3) if mode == "dynamic" else 0] * s.slices
