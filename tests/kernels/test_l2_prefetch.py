"""kernels/bench/l2_prefetch.py on the interpreter: the timed read sums each program's share as torch does, and the
command line refuses bad values before it measures anything. (The prefetches are PTX: the bench runs on a GPU, where
it checks that every read gives the cold read's bits.)"""
import pytest
import torch

from loopbench.kernels.bench import l2_prefetch


@pytest.mark.parametrize("region_mb, programs", [(0.1, 3), (0.25, 2)])
def test_read_sums_each_share_like_torch(region_mb, programs):
    r = l2_prefetch.Region(region_mb, programs, device="cpu")
    assert r.bytes >= region_mb * 2 ** 20 and r.bytes % (2 * l2_prefetch.GROUP * programs) == 0
    torch.testing.assert_close(r.read().double(), r.reference(), rtol=1e-5, atol=1e-3)


def test_region_must_hold_bytes():
    with pytest.raises(ValueError, match="region_mb must be > 0, got 0"):
        l2_prefetch.Region(0, 4, device="cpu")


@pytest.mark.parametrize("argv, message", [
    (["--region-mb", "8,x"], "--region-mb must be comma-separated numbers, got '8,x'"),
    (["--region-mb", "0"], "--region-mb must be > 0"),
    (["--between-mb", "-1"], "--between-mb >= 0"),
    (["--chunk-kb", "0"], "--chunk-kb and --reps must be >= 1"),
])
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys):
    assert l2_prefetch.main(argv) == 2
    assert message in capsys.readouterr().err
