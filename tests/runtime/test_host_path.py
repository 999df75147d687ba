"""The host path on the CPU: packed prefill == per-request prefill (fp64, token for token against the
naive reference) across prompt lengths that cross KV blocks and prefill query tiles, with several
depths in one pack and aborts mid-prefill; the delayed gate read one step late gives the same run."""
import dataclasses

import numpy as np
import pytest
import torch

from loopbench.kernels.prefill_attention import DEFAULT_BLOCK_M
from loopbench.runtime.api import EngineConfig, Request
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.exit_policy import NaturalPolicy
from loopbench.runtime.graphs import prefill_bucket_for

# Block size 16 and the prefill query tile: lengths on both sides of each boundary.
LENS = [1, 15, 16, 17, DEFAULT_BLOCK_M - 1, DEFAULT_BLOCK_M, DEFAULT_BLOCK_M + 1, 2 * DEFAULT_BLOCK_M + 3, 40]
BOUNDS = [(2, 4, 0.5), (1, 2, 0.4), (2, 3, 0.5), (1, 4, 0.3)]


def requests(lens, max_tokens, seed=0, prefix="r"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lens):
        mn, mx, thr = BOUNDS[i % len(BOUNDS)]
        out.append(Request(f"{prefix}{i}", torch.randint(0, 256, (n,), generator=g).tolist(), max_tokens,
                           min_loops=mn, max_loops=mx, exit_threshold=thr))
    return out


def engine(model, **cfg):
    cfg = dict(dict(max_num_seqs=4, max_model_len=2 * DEFAULT_BLOCK_M + 16, exit_policy="ouro_delayed",
                    poison_kv=True), **cfg)
    return LoopEngine(model, EngineConfig(**cfg))


def spy_prefill(eng):
    """Record the (slot, depth) of every loop of every packed prefill call."""
    calls, real = [], eng.runner.prefill

    def prefill(loops):
        calls.append([(loop.slot, loop.depth) for loop in loops])
        return real(loops)

    eng.runner.prefill = prefill
    return calls


@pytest.mark.parametrize("layout", [dict(kv_layout="native"), dict(kv_layout="alias", prefix_tiles=True)])
def test_packed_prefill_matches_the_per_request_reference(model64, naive, layout):
    reqs = requests(LENS, 3)
    eng = engine(model64, **layout)
    calls = spy_prefill(eng)
    for r in reqs:
        eng.add_request(r)
    outs = eng.run()
    for r in reqs:
        tokens, exits = naive.generate(list(r.prompt_token_ids), r.max_tokens, policy="ouro_delayed",
                                       min_loops=r.min_loops, max_loops=r.max_loops, threshold=r.exit_threshold)
        got = outs[r.request_id]
        assert list(got.token_ids) == tokens, f"{r.request_id} (prompt {len(r.prompt_token_ids)}): tokens"
        assert list(got.exit_depths) == exits, f"{r.request_id} (prompt {len(r.prompt_token_ids)}): exits"
    assert max(len(c) for c in calls) == 4, "the first admission wave is prefilled in one pack"
    assert any(len({d for _, d in c}) > 1 for c in calls), "a pack holds requests at different depths"
    assert all(len({s for s, _ in c}) == len(c) for c in calls), "one loop per request per pack"


def test_abort_mid_prefill_leaves_the_rest_of_the_pack_unchanged(model64):
    reqs = requests(LENS[:4], 4)
    eng = engine(model64)
    for r in reqs:
        eng.add_request(r)
    eng.step()                                  # four prompts admitted, loop 1 run as one pack
    eng.abort("r2")
    late = requests([DEFAULT_BLOCK_M + 1], 4, seed=5, prefix="late")[0]
    eng.add_request(late)                       # takes r2's slot while the others are mid-prefill
    outs = eng.run()
    assert outs["r2"].finish_reason == "abort" and outs["r2"].token_ids == ()
    for r in [reqs[0], reqs[1], reqs[3], late]:
        alone = engine(model64, max_num_seqs=1)
        alone.add_request(r)
        assert alone.run()[r.request_id] == outs[r.request_id], r.request_id
    assert eng.kv.allocator.num_used == 0


@pytest.mark.parametrize("policy", ["fixed", "ouro_delayed"])
def test_natural_exits_are_known_without_reading_the_step(model64, policy, monkeypatch):
    """fixed reads no flags and ouro_delayed starts one read-back per step, consumed a step later (each
    step's device flags are checked against the host's prediction); the run equals a replay of itself."""
    reqs = requests(LENS[:6], 6)
    eng = engine(model64, exit_policy=policy)
    steps, reads = [0], []
    real_read, real_exits = NaturalPolicy._read_later, eng.policy.exits_after_step
    monkeypatch.setattr(NaturalPolicy, "_read_later",
                        lambda self, *a: (reads.append(steps[0]), real_read(self, *a))[1])

    def exits(plan, exit_flags, triggered):
        steps[0] += 1
        with monkeypatch.context() as m:            # the exits of this step come from the host's own state
            m.setattr(torch.Tensor, "tolist", lambda t: pytest.fail("the step's flags were read at once"))
            return real_exits(plan, exit_flags, triggered)

    eng.policy.exits_after_step = exits
    for r in reqs:
        eng.add_request(r)
    outs = eng.run()
    assert reads == (list(range(1, steps[0] + 1)) if policy == "ouro_delayed" else [])
    replay = engine(model64, exit_policy="replay", schedule=eng.capture_schedule())
    for r in reqs:
        replay.add_request(r)
    assert replay.run() == outs


def test_a_host_device_exit_disagreement_is_an_error():
    policy = NaturalPolicy("ouro_delayed", None, 2)
    with pytest.raises(RuntimeError, match="diverged"):
        policy._check(np.array([True, False]), np.array([True, True]))


@pytest.mark.parametrize("total,bucket", [(1, 16), (16, 16), (17, 24), (25, 32), (100, 128), (129, 192),
                                          (2048, 2048), (2049, 3072), (32768, 32768)])
def test_prefill_buckets_pad_by_less_than_half(total, bucket):
    assert prefill_bucket_for(total) == bucket
    assert bucket < 1.5 * total or total <= 16


def test_prefill_bucket_refuses_an_empty_pack():
    with pytest.raises(ValueError, match="at least one row"):
        prefill_bucket_for(0)


@pytest.mark.parametrize("total,bucket", [(1, 256), (256, 256), (257, 512), (700, 768), (1025, 1536), (2048, 2048),
                                          (2049, 3072)])
def test_batch_invariant_prefill_buckets_are_whole_calls_of_gemm_rows(total, bucket):
    assert prefill_bucket_for(total, 256) == bucket and bucket % 256 == 0


def test_linear_in_fixed_row_calls_is_the_product_and_refuses_a_ragged_batch():
    from loopbench.runtime.model import linear
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(96, 40, generator=g, dtype=torch.float64), torch.randn(24, 40, generator=g, dtype=torch.float64)
    assert torch.allclose(linear(x, w, 32), x @ w.T, rtol=1e-12, atol=1e-12)
    assert torch.equal(linear(x[:32], w, 32), linear(x, w, 32)[:32])      # a call's rows: the same call
    with pytest.raises(ValueError, match="100 rows are not a multiple of gemm_rows=32"):
        linear(torch.zeros(100, 40, dtype=torch.float64), w, 32)
