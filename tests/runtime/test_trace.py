"""EngineConfig.trace_loops (the natural track's traced run): it changes nothing the engine computes, and
what it records is what the exit rule decided on: per token one S_r per loop run, from which the policy's
own rule gives back the exit depth, and the top-2 logits of the sampled token."""
import pytest

from loopbench.runtime.api import EngineConfig
from loopbench.runtime.engine import LoopEngine
from tests.runtime.test_engine import make_requests


def _run(model, policy, trace):
    eng = LoopEngine(model, EngineConfig(max_num_seqs=3, max_model_len=128, exit_policy=policy, trace_loops=trace))
    for r in make_requests(5, 6, policy):
        eng.add_request(r)
    return eng, eng.run()


def _rule_depth(survival: list[float], req, delayed: bool) -> int:
    """The exit depth the ouro / ouro_delayed rule gives for one token's survivals (BRIEF section 1)."""
    for r, s in enumerate(survival, start=1):
        if r >= req.max_loops:
            return r
        if req.exit_threshold < 1 and r >= req.min_loops and 1 - s >= req.exit_threshold:
            return min(r + 1, req.max_loops) if delayed else r
    return -1   # the token stopped although the rule never said so


@pytest.mark.parametrize("policy", ["ouro", "ouro_delayed"])
def test_traced_run_equals_the_untraced_one_and_records_what_decided(model64, policy):
    _, plain = _run(model64, policy, False)
    eng, traced = _run(model64, policy, True)
    assert traced == plain
    reqs = {r.request_id: r for r in make_requests(5, 6, policy)}
    for rid, out in traced.items():
        tr = eng.loop_trace[rid]
        assert len(tr["survival"]) == len(tr["top2"]) == len(out.token_ids)
        assert tr["survival"][0] == []                     # the prefill token: every loop, no gate
        for i in range(1, len(out.token_ids)):
            s = tr["survival"][i]
            assert len(s) == out.exit_depths[i]
            assert all(a >= b for a, b in zip(s, s[1:]))   # survival never grows
            # the delayed rule may stop the trace one loop after the test held: the depth is the rule's
            assert _rule_depth(s, reqs[rid], policy == "ouro_delayed") == out.exit_depths[i]
        assert all(t[0] >= t[1] for t in tr["top2"])
    eng.reset_run()
    assert eng.loop_trace == {}


def test_untraced_engine_keeps_no_trace(model64):
    eng, _ = _run(model64, "ouro_delayed", False)
    assert eng.loop_trace == {}
    with pytest.raises(TypeError, match="trace_loops"):
        EngineConfig(trace_loops=1)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_traced_run_on_cuda_with_and_without_graphs_equals_the_untraced_one(tiny_ckpt, graphs):
    """The lead's H200 check of the hook the natural track's traced runs use (graphs replayed, survival read
    from the resident state after each step)."""
    import torch

    from loopbench.runtime.model import OuroModel

    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, device="cuda", dtype=torch.float32)
    outs = []
    for trace in (False, True):
        eng = LoopEngine(model, EngineConfig(max_num_seqs=3, max_model_len=128, exit_policy="ouro_delayed",
                                             attention_backend="triton", cuda_graphs=graphs, trace_loops=trace))
        for r in make_requests(5, 6, "ouro_delayed"):
            eng.add_request(r)
        outs.append(eng.run())
    assert outs[0] == outs[1]
    for rid, out in outs[1].items():
        assert [len(s) for s in eng.loop_trace[rid]["survival"][1:]] == list(out.exit_depths[1:])
