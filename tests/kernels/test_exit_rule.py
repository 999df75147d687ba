"""kernels/exit_rule.py == runtime/exit_policy.exit_step (and replay's forced exits), bitwise: the same float
operations in the same order, on random rows that cross the kernel's blocks (interpreter on CPU, CUDA)."""
import pytest
import torch

from loopbench.kernels import exit_rule as er
from loopbench.runtime.exit_policy import exit_step

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _rows(n, slots, device, seed):
    g = torch.Generator().manual_seed(seed)
    hazard = torch.rand(n, generator=g)
    hazard[::7] = torch.tensor([0.0, 1.0, 0.5])[torch.arange(0, n, 7) % 3]         # the edges of (0, 1)
    depth = torch.randint(1, 5, (n,), generator=g, dtype=torch.int32)
    survival = torch.rand(n, generator=g)
    triggered = torch.rand(n, generator=g) < 0.3
    forced = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32)
    sl = torch.randint(0, slots + 1, (n,), generator=g)                             # slot S: the padding scratch
    min_loops = torch.randint(1, 3, (slots + 1,), generator=g, dtype=torch.int32)
    max_loops = torch.randint(2, 5, (slots + 1,), generator=g, dtype=torch.int32)
    threshold = torch.rand(slots + 1, generator=g)
    threshold[::3] = 1.0                                                            # threshold 1: fixed depth
    # Rows exactly on the boundary, 1 - S_r == threshold (torch's rounding of S_r first): a kernel that contracts
    # 1 - survival * (1 - hazard) into one fused multiply-add, or tests > for >=, decides some of them otherwise.
    first = {}
    for i, slot in enumerate(sl.tolist()):
        first.setdefault(slot, i)
    for slot, i in list(first.items())[1::3]:
        threshold[slot] = 1.0 - survival[i] * (1.0 - hazard[i])
    return [t.to(device) for t in (hazard, depth, survival, triggered, forced, sl, min_loops, max_loops, threshold)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", er.POLICIES)
@pytest.mark.parametrize("n", [1, 16, 1500])
def test_exit_rule_is_exit_step_bitwise(device, policy, n):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hazard, depth, survival, triggered, forced, sl, min_loops, max_loops, threshold = _rows(n, 33, device, n)
    got = er.exit_rule(policy, hazard, depth, survival, triggered, forced, sl, min_loops, max_loops, threshold)
    if policy == "replay":
        want = (forced > 0, survival * (1.0 - hazard), triggered)
    else:
        want = exit_step(policy, hazard, depth, survival, triggered, min_loops[sl], max_loops[sl], threshold[sl])
    for what, a, b in zip(("exit_now", "survival", "triggered"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{policy} {what}: {int((a != b).sum())} of {n} rows differ"
    assert torch.equal(got[3], max_loops[sl])


def test_exit_rule_names_a_bad_argument():
    args = _rows(4, 3, "cpu", 0)
    with pytest.raises(ValueError, match="policy must be one of"):
        er.exit_rule("ouro_early", *args)
    bad = list(args)
    bad[1] = bad[1].long()                                                          # depth int64
    with pytest.raises(ValueError, match=r"depth must be a contiguous \[4\] torch.int32"):
        er.exit_rule("ouro", *bad)
    bad = list(args)
    bad[8] = bad[8][:3]                                                             # threshold of another size
    with pytest.raises(ValueError, match="threshold must be a contiguous"):
        er.exit_rule("ouro", *bad)
