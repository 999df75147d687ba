"""The runtime on the CPU: engine == naive reference, native == alias == alias+prefix bitwise,
schedule capture/replay, aborts and slot reuse, checkpoint round trip, the 1.4B preset's size."""
import dataclasses
import json
import re

import pytest
import torch

from loopbench.harness.fixtures import write_synthetic_checkpoint
from loopbench.runtime.checkpoint import load_checkpoint
from loopbench.runtime.api import (AttentionBackendName, DescriptorMode, EngineConfig, ExitPolicyName, KVLayout,
                                   Request)
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.model import PRESETS, OuroModel, tensor_shapes
from loopbench.runtime.schedule import Schedule, ScheduleMismatchError

PROMPT_LENS = [1, 15, 16, 17, 31, 32, 33, 34, 64]
POLICY_BOUNDS = {  # policy -> (min_loops, max_loops, threshold) cycled over requests
    "fixed": [(1, 4, 1.0), (1, 2, 1.0), (1, 3, 1.0)],
    "ouro": [(2, 4, 0.5), (1, 4, 0.3), (1, 3, 0.6)],
    "ouro_delayed": [(2, 4, 0.5), (1, 4, 0.4), (2, 3, 0.5)],
}


def make_requests(n, max_tokens, policy, seed=0, lens=PROMPT_LENS):
    g = torch.Generator().manual_seed(seed)
    bounds = POLICY_BOUNDS["ouro_delayed" if policy == "replay" else policy]
    out = []
    for i in range(n):
        mn, mx, thr = bounds[i % len(bounds)]
        prompt = torch.randint(0, 256, (lens[i % len(lens)],), generator=g).tolist()
        out.append(Request(f"r{i}", prompt, max_tokens, min_loops=mn, max_loops=mx, exit_threshold=thr))
    return out


def run_engine(model, requests, **cfg):
    cfg.setdefault("max_model_len", 128)
    cfg.setdefault("poison_kv", True)      # KV cells without a live value are NaN: no reader may touch them
    cfg.setdefault("prefill_gemm_rows", 16)   # the tiny model: 256-row prefill packs only slow the interpreter
    eng = LoopEngine(model, EngineConfig(**cfg))
    for r in requests:
        eng.add_request(r)
    return eng, eng.run()


_ref_cache = {}


def reference(naive, req, policy, forced=None):
    key = (req, policy, forced)
    if key not in _ref_cache:
        _ref_cache[key] = naive.generate(list(req.prompt_token_ids), req.max_tokens, policy=policy,
                                         min_loops=req.min_loops, max_loops=req.max_loops,
                                         threshold=req.exit_threshold, forced_exits=forced)
    return _ref_cache[key]


@pytest.mark.parametrize("policy", ["fixed", "ouro", "ouro_delayed", "replay"])
@pytest.mark.parametrize("max_tokens", [1, 8])
@pytest.mark.parametrize("num_requests", [1, 5, 16])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_engine_matches_naive_reference(model64, naive, max_num_seqs, num_requests, max_tokens, policy):
    reqs = make_requests(num_requests, max_tokens, policy)
    if policy == "replay":
        eng, natural = run_engine(model64, reqs, max_num_seqs=max_num_seqs, exit_policy="ouro_delayed")
        sched = eng.capture_schedule()
        _, outs = run_engine(model64, reqs, max_num_seqs=max_num_seqs, exit_policy="replay", schedule=sched)
    else:
        _, outs = run_engine(model64, reqs, max_num_seqs=max_num_seqs, exit_policy=policy)
    for r in reqs:
        forced = outs[r.request_id].exit_depths if policy == "replay" else None
        tokens, exits = reference(naive, r, policy, forced)
        o = outs[r.request_id]
        assert list(o.token_ids) == tokens, f"{r.request_id} (prompt {len(r.prompt_token_ids)}): tokens"
        assert list(o.exit_depths) == exits, f"{r.request_id} (prompt {len(r.prompt_token_ids)}): exits"
        assert len(tokens) == max_tokens
    if policy != "fixed":
        assert len({e for o in outs.values() for e in o.exit_depths}) > 1 or max_tokens == 1


ARMS = {"native": dict(kv_layout="native"), "alias": dict(kv_layout="alias"),
        "alias_prefix": dict(kv_layout="alias", prefix_tiles=True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile_size", [32, 16])
def test_native_alias_prefix_bitwise_equal(tiny_ckpt, dtype, tile_size):
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=dtype)
    reqs = make_requests(12, 24, "ouro_delayed", seed=3, lens=[33, 34, 1, 64, 17, 31])
    base, _ = run_engine(model, reqs, max_num_seqs=4, exit_policy="ouro_delayed", **ARMS["native"])
    sched = base.capture_schedule()
    for policy in ("ouro_delayed", "replay"):
        results = {}
        for name, arm in ARMS.items():
            extra = dict(schedule=sched) if policy == "replay" else {}
            eng, outs = run_engine(model, reqs, max_num_seqs=4, exit_policy=policy, keep_logits=True,
                                   tile_size=tile_size, **arm, **extra)
            results[name] = (outs, eng.logits_log, eng.stats.copy())
        ref_outs, ref_logits, ref_stats = results["native"]
        assert any(e < 4 for o in ref_outs.values() for e in o.exit_depths[1:]), "no early exits: alias untested"
        for name, (outs, logits, stats) in results.items():
            assert outs == ref_outs, f"{name} tokens/exits differ from native under {policy}"
            assert stats == ref_stats, f"{name} work counters differ"
            for rid, rows in ref_logits.items():
                for i, (a, b) in enumerate(zip(rows, logits[rid])):
                    assert torch.equal(a, b), (f"{name} {policy} {rid} token {i}: max diff "
                                               f"{(a.float() - b.float()).abs().max().item():.3e}")
        sched.verify(results["alias_prefix"][0]) if policy == "replay" else None


def test_replay_reproduces_capture_and_drift_fails(model64):
    reqs = make_requests(7, 10, "ouro_delayed", seed=5)
    eng, natural = run_engine(model64, reqs, max_num_seqs=3, exit_policy="ouro_delayed")
    sched = eng.capture_schedule()
    assert Schedule.from_json(sched.to_json()) == sched
    rep, outs = run_engine(model64, reqs, max_num_seqs=3, exit_policy="replay", schedule=sched)
    sched.verify(outs, rep.trace_sha256)
    assert outs == natural

    # A frozen token the model does not produce: the replay drifts and verify names the place.
    r0 = sched.requests[0]
    bad = dataclasses.replace(sched, requests=(dataclasses.replace(
        r0, token_ids=r0.token_ids[:4] + ((r0.token_ids[4] + 1) % 256,) + r0.token_ids[5:]),) + sched.requests[1:])
    with pytest.raises(ScheduleMismatchError, match=r"request 'r0' token_ids\[4\]"):
        bad.verify(outs)
    # Forced exit depths that differ from the capture change the run: tokens or trace no longer match.
    flipped = tuple(e if i == 0 else (3 if e == 4 else 4) for i, e in enumerate(r0.exit_depths))
    forced = dataclasses.replace(sched, requests=(dataclasses.replace(r0, exit_depths=flipped),) + sched.requests[1:])
    rep2, outs2 = run_engine(model64, reqs, max_num_seqs=3, exit_policy="replay", schedule=forced)
    with pytest.raises(ScheduleMismatchError):
        sched.verify(outs2, rep2.trace_sha256)


@pytest.mark.parametrize("text, match", [
    ('[1]', "a JSON object"), ('{"version": 1}', "lacks 'max_num_seqs'"),
    ('{"version": 1, "max_num_seqs": 1, "admission_order": [], "requests": [{"request_id": "r0"}], "num_steps": 0, '
     '"trace_sha256": ""}', "request 0 lacks 'prompt_sha256', .*'exit_depths'"),
    ('{"version": 1, "max_num_seqs": 1, "admission_order": [], "requests": [], "num_steps": 0, "trace_sha256": "", '
     '"steps": 3}', "unknown field 'steps'"),
])
def test_a_malformed_schedule_file_is_a_value_error_naming_what_lacks(text, match):
    with pytest.raises(ValueError, match=match):
        Schedule.from_json(text)


@pytest.mark.parametrize("damage, match", [
    (lambda d: d.update(requests=None), "schedule field 'requests' must be a JSON array, got NoneType"),
    (lambda d: d.update(requests={"r0": d["requests"][0]}), "schedule field 'requests' must be a JSON array, got dict"),
    (lambda d: d.update(admission_order="r0"), "schedule field 'admission_order' must be a JSON array, got str"),
    (lambda d: d["requests"][0].update(exit_depths=4), "schedule request 0 field 'exit_depths' must be a JSON array"),
    (lambda d: d["requests"][0].update(exit_depths=[4, 2.5]),
     "schedule request 0 field 'exit_depths' item 1 must be a JSON int, got 2.5"),
    (lambda d: d["requests"][0].update(token_ids=[5, True]),
     "schedule request 0 field 'token_ids' item 1 must be a JSON int, got True"),
    (lambda d: d.update(admission_order=[7]), "schedule field 'admission_order' item 0 must be a JSON str, got 7"),
    (lambda d: d.update(max_num_seqs="1"), "schedule field 'max_num_seqs' must be a JSON int, got '1'"),
    (lambda d: d["requests"][0].update(max_loops=4.0), "schedule request 0 field 'max_loops' must be a JSON int, got 4.0"),
    (lambda d: d["requests"][0].update(exit_threshold="1"),
     "schedule request 0 field 'exit_threshold' must be a JSON float, got '1'"),
    (lambda d: d["requests"][0].update(prompt_sha256=None),
     "schedule request 0 field 'prompt_sha256' must be a JSON str, got None"),
])
def test_a_schedule_field_of_the_wrong_json_type_is_a_value_error_naming_it(damage, match):
    """A list field of another type failed with TypeError ('NoneType' object is not iterable), was misread (a dict's
    keys taken for its requests) or taken apart (the string "r0" as the admission order ('r', '0')); a scalar of
    another type was taken as it was (an exit depth of 2.5, which no loop reaches, failed only mid-run)."""
    data = {"version": 1, "max_num_seqs": 1, "admission_order": ["r0"], "num_steps": 2, "trace_sha256": "",
            "requests": [{"request_id": "r0", "prompt_sha256": "", "prompt_len": 1, "max_tokens": 2, "min_loops": 1,
                          "max_loops": 4, "exit_threshold": 1.0, "token_ids": [5, 6], "exit_depths": [4, 2]}]}
    assert Schedule.from_json(json.dumps(data)).admission_order == ("r0",)
    damage(data)
    with pytest.raises(ValueError, match=re.escape(match)):
        Schedule.from_json(json.dumps(data))


def test_schedule_that_does_not_fit_is_refused(model64):
    reqs = make_requests(3, 4, "ouro_delayed")
    eng, _ = run_engine(model64, reqs, max_num_seqs=2, exit_policy="ouro_delayed")
    sched = eng.capture_schedule()
    other = dataclasses.replace(reqs[1], prompt_token_ids=reqs[1].prompt_token_ids + (1,))
    with pytest.raises(ValueError, match="request 'r1' has prompt sha256"):
        run_engine(model64, [reqs[0], other], max_num_seqs=2, exit_policy="replay", schedule=sched)
    longer = dataclasses.replace(reqs[0], max_tokens=5)
    with pytest.raises(ValueError, match="max_tokens 5"):
        run_engine(model64, [longer], max_num_seqs=2, exit_policy="replay", schedule=sched)
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        EngineConfig(max_num_seqs=3, exit_policy="replay", schedule=sched)
    with pytest.raises(ValueError, match="not in the schedule"):
        run_engine(model64, [dataclasses.replace(reqs[0], request_id="zz")], max_num_seqs=2,
                   exit_policy="replay", schedule=sched)
    # exit depths no loop can reach are refused at add_request, not found mid-run by the host's depth check
    r0 = sched.requests[0]
    for depths in ((r0.exit_depths[0], r0.max_loops + 1) + r0.exit_depths[2:], (r0.exit_depths[0], 0)):
        bad = dataclasses.replace(sched, requests=(dataclasses.replace(r0, exit_depths=depths),) + sched.requests[1:])
        eng = LoopEngine(model64, EngineConfig(max_num_seqs=2, max_model_len=128, exit_policy="replay", schedule=bad))
        with pytest.raises(ValueError, match=rf"request 'r0' has exit depth {depths[1]} at token 1, outside 1\.\.4"):
            eng.add_request(reqs[0])
        assert eng.stats.steps == 0 and not eng.has_unfinished()


@pytest.mark.parametrize("layout", [dict(kv_layout="native"), dict(kv_layout="alias", prefix_tiles=True)])
def test_abort_mid_prefill_and_mid_decode_then_slot_reuse(model64, layout):
    reqs = make_requests(4, 12, "ouro_delayed", seed=9, lens=[33, 17, 34, 20])
    late = make_requests(2, 12, "ouro_delayed", seed=11, lens=[31, 33])
    late = [dataclasses.replace(r, request_id=f"late{i}") for i, r in enumerate(late)]
    eng = LoopEngine(model64, EngineConfig(max_num_seqs=2, max_model_len=128, exit_policy="ouro_delayed",
                                           poison_kv=True, **layout))
    eng.add_request(reqs[0])
    eng.add_request(reqs[1])
    eng.step()                          # both admitted, one prefill loop done (of max_loops)
    eng.abort("r0")                     # mid-prefill
    eng.add_request(late[0])            # takes r0's slot
    for _ in range(14):
        eng.step()                      # r1 decodes
    eng.abort("r1")                     # mid-decode
    eng.add_request(late[1])            # takes r1's slot
    outs = eng.run()
    assert outs["r0"].finish_reason == "abort" and outs["r1"].finish_reason == "abort"
    assert 1 < len(outs["r1"].token_ids) < 12
    for r in late:
        _, fresh = run_engine(model64, [r], max_num_seqs=2, exit_policy="ouro_delayed", **layout)
        assert outs[r.request_id] == fresh[r.request_id]
    with pytest.raises(ValueError, match="unknown or finished request 'r0'"):
        eng.abort("r0")
    assert eng.kv.allocator.num_used == 0


def test_checkpoint_round_trip_gives_identical_logits(tmp_path):
    a, b = tmp_path / "single", tmp_path / "sharded"
    write_synthetic_checkpoint(a, "tiny", seed=4, dtype=torch.bfloat16)
    write_synthetic_checkpoint(b, "tiny", seed=4, dtype=torch.bfloat16, max_shard_bytes=40_000)
    outs = []
    for path in (a, b):
        cfg, tensors = load_checkpoint(path)
        model = OuroModel.from_tensors(cfg, tensors, dtype=torch.bfloat16)
        reqs = make_requests(3, 6, "ouro_delayed", seed=1)
        eng, o = run_engine(model, reqs, max_num_seqs=2, exit_policy="ouro_delayed", keep_logits=True)
        outs.append((o, eng.logits_log))
    assert outs[0][0] == outs[1][0]
    for rid in outs[0][1]:
        assert all(torch.equal(x, y) for x, y in zip(outs[0][1][rid], outs[1][1][rid]))


def test_ouro_1_4b_preset_builds_on_meta_with_exact_parameter_count():
    cfg = PRESETS["ouro-1.4b"]
    tensors = {n: torch.empty(s, device="meta", dtype=torch.bfloat16) for n, s in tensor_shapes(cfg).items()}
    model = OuroModel.from_tensors(cfg, tensors, device="meta", dtype=torch.bfloat16, rope_len=16)
    assert model.num_parameters() == 1_434_652_673


def test_bad_requests_and_configs_are_refused(model64):
    eng = LoopEngine(model64, EngineConfig(max_num_seqs=2, max_model_len=64))
    with pytest.raises(ValueError, match="token id 999"):
        eng.add_request(Request("a", [1, 999], 4))
    with pytest.raises(ValueError, match="max_model_len=64"):
        eng.add_request(Request("b", [1] * 60, 8))
    with pytest.raises(ValueError, match="max_loops"):
        eng.add_request(Request("c", [1], 4, min_loops=3, max_loops=2))
    with pytest.raises(ValueError, match="kv_layout 'paged'"):
        EngineConfig(kv_layout="paged")
    with pytest.raises(ValueError, match="exit policy 'early'"):
        EngineConfig(exit_policy="early")
    with pytest.raises(ValueError, match="attention backend 'cuda'"):
        EngineConfig(attention_backend="cuda")
    with pytest.raises(ValueError, match="descriptor_mode 'zero'"):
        EngineConfig(descriptor_mode="zero")


@pytest.mark.parametrize("bad", [{"max_num_seqs": 2}, None])
def test_loop_engine_takes_only_an_engine_config(model64, bad):
    with pytest.raises(TypeError, match="LoopEngine needs an EngineConfig, got"):
        LoopEngine(model64, bad)


@pytest.mark.parametrize("bad", [("a", [1], 2), {"request_id": "a", "prompt_token_ids": [1], "max_tokens": 2}, None])
def test_add_request_takes_only_a_request(model64, bad):
    eng = LoopEngine(model64, EngineConfig(max_num_seqs=2, max_model_len=64))
    with pytest.raises(TypeError, match="add_request needs a Request, got"):
        eng.add_request(bad)
    assert not eng.has_unfinished()


def test_config_choices_are_enums_that_accept_plain_strings():
    members = EngineConfig(kv_layout=KVLayout.ALIAS, exit_policy=ExitPolicyName.FIXED,
                           attention_backend=AttentionBackendName.TRITON, descriptor_mode=DescriptorMode.MAPPED)
    plain = EngineConfig(kv_layout="alias", exit_policy="fixed", attention_backend="triton", descriptor_mode="mapped")
    assert members == plain and f"{members.kv_layout}" == "alias"


def test_the_scheduler_plans_on_the_host_into_a_frozen_plan(model64):
    """A step's plan names the admissions (lowest slot first), one prefill loop each, and later the decode
    rows with their descriptor; the trace records exactly those decisions, in that order."""
    eng = LoopEngine(model64, EngineConfig(max_num_seqs=2, max_model_len=64, exit_policy="fixed"))
    for r in make_requests(3, 2, "fixed", lens=[3, 5, 7]):
        eng.add_request(r)
    plan = eng.scheduler.schedule()
    assert [r.req.request_id for r in plan.admitted] == ["r0", "r1"] and [r.slot for r in plan.admitted] == [0, 1]
    assert [(p.slot, p.depth, p.final) for p in plan.prefill] == [(0, 1, False), (1, 1, False)]
    assert plan.decode == () and plan.rows is None and [r.request_id for r in eng.scheduler.queue] == ["r2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decode = ()
    eng2 = LoopEngine(model64, EngineConfig(max_num_seqs=2, max_model_len=64, exit_policy="fixed"))
    for r in make_requests(3, 2, "fixed", lens=[3, 5, 7]):
        eng2.add_request(r)
    for _ in range(4):                        # r0 has max_loops 4: four prefill loops, then it decodes
        eng2.step()
    plan = eng2.scheduler.schedule()
    assert [r.req.request_id for r in plan.decode] == ["r0"]
    assert plan.rows.tolist() == [[0, 1, 3, 4, 0]] and plan.forced == [False]   # slot, depth, pos, first-alias


def test_calibrated_gate_gives_about_three_quarters_three_loop_tokens(tmp_path):
    from loopbench.harness.fixtures import write_calibrated_checkpoint
    write_calibrated_checkpoint(tmp_path / "ckpt", "tiny", seed=0, dtype=torch.float32)
    cfg, tensors = load_checkpoint(tmp_path / "ckpt")
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    reqs = [Request(f"r{i}", torch.randint(0, 256, (32,), generator=g).tolist(), 32, 2, 4, 0.5) for i in range(32)]
    _, outs = run_engine(model, reqs, max_num_seqs=16, exit_policy="ouro_delayed")
    exits = [e for o in outs.values() for e in o.exit_depths[1:]]
    assert set(exits) == {3, 4}
    share = exits.count(3) / len(exits)
    assert 0.6 <= share <= 0.9, f"three-loop share {share:.3f}"


def test_reset_run_repeats_the_same_workload_identically(model64):
    reqs = make_requests(5, 6, "ouro_delayed", seed=2)
    eng, first = run_engine(model64, reqs, max_num_seqs=2, exit_policy="ouro_delayed")
    trace = eng.trace_sha256
    eng.reset_run()
    for r in reqs:
        eng.add_request(r)
    assert eng.run() == first and eng.trace_sha256 == trace


def test_a_capture_after_reset_run_is_the_runs_own_schedule(model64):
    """The measured run after a warmup freezes the same schedule as a fresh engine's run (num_steps included):
    the cumulative stats count the warmup's steps too."""
    reqs = make_requests(3, 4, "ouro_delayed", seed=2)
    eng, _ = run_engine(model64, reqs, max_num_seqs=2, exit_policy="ouro_delayed")
    fresh = eng.capture_schedule()
    eng.reset_run()
    for r in reqs:
        eng.add_request(r)
    eng.run()
    assert eng.capture_schedule() == fresh


@pytest.mark.slow      # about 100 s a layout on 2 cores (the interpreter)
@pytest.mark.parametrize("layout", [dict(kv_layout="native"), dict(kv_layout="alias", prefix_tiles=True)])
def test_triton_backend_and_fused_ops_match_reference_under_interpreter(tiny_ckpt, naive, layout):
    """The GPU path (Triton attention, KV kernels and fused elementwise ops) on the CPU interpreter."""
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.float32, fused=True)
    reqs = make_requests(4, 6, "ouro_delayed", seed=6, lens=[1, 17, 33, 34])
    _, outs = run_engine(model, reqs, max_num_seqs=3, exit_policy="ouro_delayed", attention_backend="triton",
                         **layout)
    for r in reqs:
        assert (list(outs[r.request_id].token_ids), list(outs[r.request_id].exit_depths)) == \
            reference(naive, r, "ouro_delayed")


@pytest.mark.slow      # about 85 s on 2 cores (the interpreter)
def test_the_exit_rule_kernel_is_each_policys_device_step_in_the_engine(tiny_ckpt, monkeypatch):
    """Runner._exit_rule on the Triton path (kernels/exit_rule.py, the interpreter here) against the policy's torch
    device_step at every decode step of fixed, ouro and a replay of the ouro run (ouro_delayed: the reference test
    above), with a padded batch (2 requests at max_num_seqs 3)."""
    from loopbench.runtime import runner as runner_mod
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.float32, fused=True)
    steps = []
    kernel_rule = runner_mod.Runner._exit_rule

    def checked(self, hazard, depth, s_prev, t_prev, forced, sl):
        got = kernel_rule(self, hazard, depth, s_prev, t_prev, forced, sl)
        want = (*self.policy.device_step(hazard, depth, s_prev, t_prev, forced, self, sl), self.max_loops[sl])
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (self.policy.name, got, want)
        steps.append(self.policy.name)
        return got

    monkeypatch.setattr(runner_mod.Runner, "_exit_rule", checked)
    reqs = make_requests(2, 3, "ouro", seed=9, lens=[3, 17])
    kw = dict(max_num_seqs=3, attention_backend="triton")
    run_engine(model, make_requests(2, 3, "fixed", seed=9, lens=[3, 17]), exit_policy="fixed", **kw)
    eng, _ = run_engine(model, reqs, exit_policy="ouro", **kw)
    run_engine(model, reqs, exit_policy="replay", schedule=eng.capture_schedule(), **kw)
    assert {"fixed", "ouro", "replay"} <= set(map(str, steps)), set(steps)


def test_kv_pool_exhaustion_waits_or_fails_clearly_and_loses_nothing(model64):
    from loopbench.runtime.kv_cache import OutOfBlocksError
    a, b = make_requests(2, 3, "fixed", seed=12, lens=[5, 5])
    # 2 prompt blocks x 4 planes each; 9 blocks (8 usable) hold one request at a time: b waits for a
    eng, outs = run_engine(model64, [a, b], max_num_seqs=2, block_size=4, num_blocks=9, max_model_len=64,
                           exit_policy="fixed")
    for r in (a, b):
        _, fresh = run_engine(model64, [r], max_num_seqs=2, block_size=4, max_model_len=64, exit_policy="fixed")
        assert outs[r.request_id] == fresh[r.request_id]
    # a prompt that can never fit fails naming the request and stays queued (so it can be aborted)
    big = dataclasses.replace(a, request_id="big", prompt_token_ids=tuple(range(40)))
    eng = LoopEngine(model64, EngineConfig(max_num_seqs=2, block_size=4, num_blocks=9, max_model_len=64,
                                           exit_policy="fixed", poison_kv=True))
    eng.add_request(big)
    with pytest.raises(OutOfBlocksError, match="request 'big' needs 40 KV blocks"):
        eng.step()
    eng.abort("big")
    assert eng.outputs()["big"].finish_reason == "abort" and not eng.has_unfinished()
    # running requests that outgrow the pool fail before any work of the step, naming them
    eng = LoopEngine(model64, EngineConfig(max_num_seqs=2, block_size=4, num_blocks=9, max_model_len=64,
                                           exit_policy="fixed", poison_kv=True))
    eng.add_request(dataclasses.replace(a, max_tokens=20))
    with pytest.raises(OutOfBlocksError, match=r"running requests \['r0'\] need 4 more KV blocks"):
        eng.run()
    steps = eng.stats.steps
    with pytest.raises(OutOfBlocksError):
        eng.step()
    assert eng.stats.steps == steps


def test_stats_snapshot_is_not_aliased(model64):
    eng = LoopEngine(model64, EngineConfig(max_num_seqs=2, max_model_len=64, exit_policy="fixed", poison_kv=True))
    before = eng.stats.copy()
    eng.add_request(make_requests(1, 3, "fixed")[0])
    eng.run()
    assert before.rows_per_depth == [0, 0, 0, 0] and sum(eng.stats.rows_per_depth) > 0


@pytest.mark.parametrize("field,value,error", [
    ("prompt_token_ids", [1.7, 2.2], TypeError), ("prompt_token_ids", "123", TypeError),
    ("prompt_token_ids", [True], TypeError), ("prompt_token_ids", [-1], ValueError),
    ("prompt_token_ids", {3, 1, 2}, TypeError), ("prompt_token_ids", {3: 0, 1: 0}, TypeError),   # no order
    ("max_tokens", 2.5, TypeError), ("max_tokens", True, TypeError), ("max_tokens", 0, ValueError),
    ("min_loops", 1.5, TypeError), ("max_loops", "4", TypeError), ("exit_threshold", "0.5", ValueError),
    ("exit_threshold", float("nan"), ValueError), ("ignore_eos", "no", TypeError), ("request_id", None, TypeError),
])
def test_request_fields_are_type_checked(field, value, error):
    kw = dict(request_id="x", prompt_token_ids=[1, 2], max_tokens=2)
    kw[field] = value
    with pytest.raises(error, match=field.replace("prompt_token_ids", "prompt token id|prompt_token_ids")):
        Request(**kw)


@pytest.mark.parametrize("field,value", [("num_blocks", 0), ("num_blocks", 2.5), ("prefix_tiles", "yes"),
                                         ("eos_token_id", -1), ("max_num_seqs", True),
                                         ("prefill_gemm_rows", 0), ("prefill_gemm_rows", 2.5),
                                         ("prefill_stream", "on")])
def test_engine_config_fields_are_type_checked(field, value):
    with pytest.raises((TypeError, ValueError), match=f"EngineConfig.{field}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("on, device, backend, beside", [
    (True, "cuda", "triton", True), (False, "cuda", "triton", False), (True, "cpu", "triton", False),
    (True, "cpu", "torch", False),
    (True, "cuda", "torch", False),     # its native fill rewrites a slot-0 cell: a lost write beside a prefill
])
def test_prefill_runs_beside_decode_only_on_cuda_with_triton(on, device, backend, beside):
    from loopbench.runtime.runner import prefill_beside_decode
    cfg = EngineConfig(prefill_stream=on, attention_backend=backend)
    assert prefill_beside_decode(cfg, torch.device(device)) is beside


def test_prefill_gemm_rows_follow_max_model_len_unless_given():
    assert EngineConfig(max_model_len=1024).prefill_call_rows == 256
    assert EngineConfig(max_model_len=1025).prefill_call_rows == 1024, "long prompts get larger prefill calls"
    assert EngineConfig(max_model_len=4096, prefill_gemm_rows=64).prefill_call_rows == 64


def test_max_model_len_beyond_rotary_positions_is_refused(tiny_ckpt):
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_model_len=2048 exceeds the model's 1024 rotary positions"):
        LoopEngine(model, EngineConfig(max_model_len=2048))


def test_eos_token_id_outside_the_vocabulary_is_refused(model64):
    """An EOS id the model can never sample would let every ignore_eos=False request run to max_tokens."""
    with pytest.raises(ValueError, match="eos_token_id=256 is outside the model's vocabulary"):
        LoopEngine(model64, EngineConfig(max_model_len=64, eos_token_id=256))
    LoopEngine(model64, EngineConfig(max_model_len=64, eos_token_id=255))


def test_triton_backend_refuses_a_float64_model_at_construction(model64):
    """The Triton decode kernel takes fp32/bf16/fp16: an fp64 engine must fail before it admits anything, not at
    its first decode step after every prefill loop has run."""
    with pytest.raises(ValueError, match="attention_backend='triton' needs a float32, bfloat16 or float16 model, "
                                         "got torch.float64"):
        LoopEngine(model64, EngineConfig(max_model_len=64, attention_backend="triton"))


def test_stats_minus_subtracts_counters_and_keeps_peaks():
    from loopbench.runtime.api import EngineStats, GraphCounters
    before = EngineStats(rows_per_depth=[1, 2], steps=3, peak_kv_blocks=5, decode_graphs=GraphCounters(1, 2, 0))
    after = EngineStats(rows_per_depth=[4, 6], steps=10, peak_kv_blocks=7, decode_graphs=GraphCounters(2, 9, 1),
                        prefill_graphs=GraphCounters(3, 0, 0))
    run = after.minus(before)
    assert run.rows_per_depth == [3, 4] and run.steps == 7 and run.peak_kv_blocks == 7
    assert run.decode_graphs == GraphCounters(1, 7, 1) and run.prefill_graphs == GraphCounters(3, 0, 0)
    snap = after.copy()
    after.rows_per_depth[0] += 1
    after.decode_graphs.replays += 1
    assert snap.rows_per_depth == [4, 6] and snap.decode_graphs.replays == 9, "a snapshot must not move"


def test_first_difference_names_position_wanted_and_got():
    from loopbench.runtime.schedule import first_difference
    assert first_difference([1, 2, 3], (1, 2, 3)) is None
    assert first_difference([1, 9, 3], [1, 2, 3]) == (1, 2, 9)
    assert first_difference([1, 2], [1, 2, 3]) == (2, 3, "<end>")
    assert first_difference([1, 2, 3], [1, 2]) == (2, "<end>", 3)


def test_numpy_scalars_are_kept_as_plain_numbers_so_a_capture_serialises(model64):
    """numpy integers and floats pass the type checks (they are numbers) but must not be stored as such: a
    schedule captured from them has to serialise to JSON, and replay them, like plain ones."""
    import numpy as np
    req = Request("x", np.array([1, 2]), np.int64(3), min_loops=np.int32(2), max_loops=np.int64(4),
                  exit_threshold=np.float32(0.3))
    assert [type(getattr(req, f)) for f in ("max_tokens", "min_loops", "max_loops", "exit_threshold")] == \
        [int, int, int, float]
    cfg = EngineConfig(max_num_seqs=np.int64(2), block_size=np.int32(4), max_model_len=np.int64(64),
                       num_blocks=np.int64(40), tile_size=np.int64(8), prefill_gemm_rows=np.int64(16),
                       eos_token_id=np.int64(3))
    for f in ("max_num_seqs", "block_size", "max_model_len", "num_blocks", "tile_size", "prefill_gemm_rows",
              "eos_token_id"):
        assert type(getattr(cfg, f)) is int, f
    eng, outs = run_engine(model64, [req], **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    sched = Schedule.from_json(eng.capture_schedule().to_json())
    _, replayed = run_engine(model64, [req], max_num_seqs=2, block_size=4, max_model_len=64, exit_policy="replay",
                             schedule=sched)
    sched.verify(replayed)


def test_an_engine_over_no_model_is_a_type_error():
    with pytest.raises(TypeError, match="LoopEngine needs an OuroModel, got str 'x'"):
        LoopEngine("x", EngineConfig())


def test_a_schedule_that_is_no_schedule_is_a_type_error():
    with pytest.raises(TypeError, match="EngineConfig.schedule must be a Schedule or None, got str"):
        EngineConfig(exit_policy="replay", schedule="x")


def test_prefetch_next_is_checked_and_cuts_whole_lines_of_every_row(tiny_ckpt):
    from loopbench.runtime.model import OuroModel, check_prefetch_next
    assert check_prefetch_next(None) == {}
    for bad, match in (({"lm_head": 0.5}, "unknown target 'lm_head'"), ({"down": 0}, r"prefetch_next\['down'\]"),
                       ({"down": True}, r"prefetch_next\['down'\]"), ({"qkv": 1.01}, "fraction in")):
        with pytest.raises(ValueError, match=match):
            OuroModel.from_tensors(*tiny_ckpt, prefetch_next=bad)
    with pytest.raises(TypeError, match="must map a target"):
        check_prefetch_next(0.5)
    model = OuroModel.from_tensors(*tiny_ckpt, prefetch_next={"gate_up": 0.5, "down": 1.0})
    w = torch.zeros(10, 256)
    assert model._prefetch_region("gate_up", w).shape == (10, 128)
    assert model._prefetch_region("down", w).data_ptr() == w.data_ptr() and model._prefetch_region("down", w).shape == (10, 256)
    assert model._prefetch_region("qkv", w) is None
    assert model._prefetch_region("gate_up", torch.zeros(4, 64)).shape == (4, 64)     # at least one line a row


def test_prefetch_region_of_a_split_k_projection_takes_the_start_of_every_split(tiny_ckpt, monkeypatch):
    """Where the later weight's own GEMM configuration splits K into equal ranges, the region is the first fraction
    of each split's range (every program of that GEMM starts at its split's first K tile), as a [rows * split_k,
    cols] view of the weight; a K that the split does not cut into whole tiles keeps the plain first columns."""
    from loopbench.kernels import gemm
    from loopbench.runtime.model import OuroModel
    model = OuroModel.from_tensors(*tiny_ckpt, prefetch_next={"down": 0.25, "o_proj": 0.5})
    w = torch.arange(6 * 1024, dtype=torch.float32).reshape(6, 1024)
    monkeypatch.setitem(gemm.CONFIGS, (6, 1024), gemm.GemmConfig(block_k=128, split_k=4))
    region = model._prefetch_region("down", w)
    assert region.shape == (24, 64) and region.stride() == (256, 1) and region.data_ptr() == w.data_ptr()
    assert torch.equal(region, w.reshape(6, 4, 256)[:, :, :64].reshape(24, 64))
    monkeypatch.setitem(gemm.CONFIGS, (6, 1024), gemm.GemmConfig(block_k=128, split_k=3))   # 8 tiles in 3 splits
    assert model._prefetch_region("o_proj", w).shape == (6, 512)


@pytest.mark.parametrize("fused_paths", ["qkv_rope and swiglu", "plain gemms"])
def test_prefetch_next_gives_each_projection_the_next_ones_weight(tiny_ckpt, monkeypatch, fused_paths):
    """The wiring of OuroModel.prefetch_next, traced on the CPU with the GEMM launchers recorded: qkv (+ RoPE)
    prefetches o_proj's weight, o_proj gate_up's, gate_up (+ SwiGLU) down's, down the next layer's qkv, and the
    last layer's down layer 0's qkv (the next loop's first read)."""
    import torch.nn.functional as F
    from loopbench.kernels import fused_ops as fo
    from loopbench.kernels import gemm as gm
    from loopbench.runtime.model import PREFETCH_TARGETS
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.bfloat16, fused=True,
                                   prefetch_next=dict.fromkeys(PREFETCH_TARGETS, 1.0))
    names = {getattr(w, n).data_ptr(): f"{i}.{n}" for i, w in enumerate(model.layers) for n in ("qkv", "o", "gate_up", "down")}
    log = []

    def name(w):
        return None if w is None else names[w.data_ptr()]

    def config(configs, faster, w, x, rows):          # every projection on "our GEMM", fused where asked
        if fused_paths == "plain gemms" and configs is not gm.CONFIGS:
            return None
        return gm.GemmConfig()

    monkeypatch.setattr(model, "small_m_gemm", True)
    monkeypatch.setattr(model, "_fused_config", config)
    monkeypatch.setattr(gm, "gemm", lambda x, w, c, nw=None: log.append(("gemm", name(w), name(nw))) or F.linear(x, w))
    monkeypatch.setattr(gm, "gemm_swiglu", lambda x, w, c, nw=None:
                        log.append(("swiglu", name(w), name(nw))) or fo.silu_mul(F.linear(x, w)))

    class RopeWrite:
        def __call__(self, layer, qkv):
            pass

        def project(self, layer, x, w, c, next_weight=None):
            log.append(("qkv_rope", name(w), name(next_weight)))
            return F.linear(x, w)

    x = torch.randn(2, cfg.hidden_size, dtype=torch.bfloat16)
    model.run_loop(x, torch.zeros(2, dtype=torch.int32), lambda i, q, k, v: q, rope_write=RopeWrite())
    qkv_kernel, glu_kernel = ("qkv_rope", "swiglu") if fused_paths == "qkv_rope and swiglu" else ("gemm", "gemm")
    expected = []
    for i in range(cfg.num_hidden_layers):
        nxt = (i + 1) % cfg.num_hidden_layers
        expected += [(qkv_kernel, f"{i}.qkv", f"{i}.o"), ("gemm", f"{i}.o", f"{i}.gate_up"),
                     (glu_kernel, f"{i}.gate_up", f"{i}.down"), ("gemm", f"{i}.down", f"{nxt}.qkv")]
    assert log == expected


def _prefetch_roles():
    """(role, its configuration table, the Ouro-1.4B weight shape keying it, the target it prefetches) of every
    GEMM configuration the model reads (the throughput probe's --gemm-config roles); lm_head prefetches none."""
    from loopbench.kernels import gemm as gm
    from loopbench.kernels import qkv_rope
    return [("qkv", gm.CONFIGS, (6144, 2048), "o_proj"), ("qkv_rope", qkv_rope.CONFIGS, (6144, 2048), "o_proj"),
            ("o_proj", gm.CONFIGS, (2048, 2048), "gate_up"), ("gate_up", gm.CONFIGS, (11264, 2048), "down"),
            ("swiglu", gm.SWIGLU_CONFIGS, (11264, 2048), "down"), ("down", gm.CONFIGS, (2048, 5632), "qkv"),
            ("lm_head", gm.CONFIGS, (49152, 2048), None)]


def test_no_default_gemm_configuration_prefetches_without_a_plan():
    """The shipped tables ask for no extra prefetch programs, so every model runs them without prefetch_next."""
    from loopbench.runtime.model import PREFETCH_TARGETS, check_prefetch_programs
    for role, table, shape, _ in _prefetch_roles():
        assert table[shape].prefetch_programs == 0, f"{role}'s shipped configuration asks for extra programs"
    for cfg in PRESETS.values():
        for plan in (None, {}, dict.fromkeys(PREFETCH_TARGETS, 1.0)):
            check_prefetch_programs(cfg, plan)


@pytest.mark.parametrize("role", ["qkv", "qkv_rope", "o_proj", "gate_up", "swiglu", "down", "lm_head"])
def test_prefetch_programs_need_the_region_their_projection_prefetches(role, monkeypatch):
    """GemmConfig.prefetch_programs > 0 only launches programs that bring the next weight into L2: a projection's
    configuration with some needs prefetch_next's target for that projection (ValueError naming the role, the
    value, the table entry and the missing target); every other target does not stand in for it, and lm_head,
    which prefetches nothing, is refused with any plan."""
    from loopbench.runtime.model import PREFETCH_TARGETS, check_prefetch_programs
    cfg = PRESETS["ouro-1.4b"]
    _, table, shape, target = next(r for r in _prefetch_roles() if r[0] == role)
    monkeypatch.setitem(table, shape, dataclasses.replace(table[shape], prefetch_programs=44))
    others = {t: 1.0 for t in PREFETCH_TARGETS if t != target}
    for plan in (None, {}, others):
        with pytest.raises(ValueError) as e:
            check_prefetch_programs(cfg, plan)
        msg = str(e.value)
        assert msg.startswith(f"{role}'s GemmConfig.prefetch_programs=44 (") and f"[{shape}]" in msg, msg
        if target is None:
            assert "lm_head has no next weight to prefetch" in msg and "set prefetch_programs=0" in msg, msg
        else:
            assert f"prefetch_next has no {target!r}" in msg and f"add prefetch_next[{target!r}]" in msg, msg
    if target is None:
        with pytest.raises(ValueError, match="lm_head has no next weight"):
            check_prefetch_programs(cfg, dict.fromkeys(PREFETCH_TARGETS, 1.0))
    else:
        check_prefetch_programs(cfg, {target: 0.25})


def test_fused_loop_refuses_prefetch_programs_without_a_region_before_any_launch(tiny_ckpt, monkeypatch):
    """The fused loop checks the GEMM tables against prefetch_next at every call (both may change between runs, as
    the throughput probe's variants change them) and raises before its first kernel; given the region it runs."""
    from loopbench.kernels import fused_ops as fo
    from loopbench.kernels import gemm as gm
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.bfloat16, fused=True)
    x = torch.randn(3, cfg.hidden_size, dtype=torch.bfloat16)
    pos = torch.arange(3, dtype=torch.int32)
    want = model.run_loop(x, pos, lambda i, q, k, v: q)
    gate_up = tuple(model.layers[0].gate_up.shape)
    monkeypatch.setitem(gm.SWIGLU_CONFIGS, gate_up, gm.GemmConfig(block_n=64, block_k=64, prefetch_programs=44))
    launches = []
    norm = fo.rms_norm
    monkeypatch.setattr(fo, "rms_norm", lambda *a: launches.append(a) or norm(*a))      # the loop's first kernel
    with pytest.raises(ValueError, match=re.escape(f"swiglu's GemmConfig.prefetch_programs=44 (gemm.SWIGLU_CONFIGS"
                                                   f"[{gate_up}]) needs a next-weight region, but prefetch_next "
                                                   f"has no 'down'")):
        model.run_loop(x, pos, lambda i, q, k, v: q)
    assert launches == [], "the loop launched a kernel before refusing"
    model.prefetch_next = {"down": 1.0}
    got = model.run_loop(x, pos, lambda i, q, k, v: q)
    assert len(launches) == 1 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loop_runs_the_exit_gate_in_its_last_norm(tiny_ckpt, monkeypatch, dtype):
    """The fused loop's hazard comes from the last layer's norm kernel (fused_ops.add_rms_norm_gate, one launch
    instead of F.linear + cast + sigmoid), and is the torch gate's on the loop output up to the logit's last bit."""
    from loopbench.kernels import fused_ops as fo
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=dtype, fused=True)
    calls = []
    gate = fo.add_rms_norm_gate
    monkeypatch.setattr(fo, "add_rms_norm_gate", lambda *a: calls.append(a[3]) or gate(*a))
    monkeypatch.setattr(model, "hazard", lambda h: pytest.fail("the fused loop ran the torch gate"))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, cfg.hidden_size, generator=g).to(dtype)
    h, hazard = model.run_loop(x, torch.arange(5, dtype=torch.int32), lambda i, q, k, v: q)
    assert len(calls) == 1 and calls[0] is model.norm, "the gate must run once, in the final norm's pass"
    monkeypatch.undo()
    ref = model.hazard(h)
    assert hazard.dtype == ref.dtype == torch.float32 and hazard.shape == (5,)
    from tests.kernels.test_fused import assert_hazard
    assert_hazard(hazard, ref, dtype)


def test_fp64_fused_loop_keeps_the_torch_gate(tiny_ckpt, monkeypatch):
    """An fp64 model's hazard is fp64 (rope_dtype), which the fp32 gate kernel does not give: the torch gate."""
    from loopbench.kernels import fused_ops as fo
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.float64, fused=True)
    monkeypatch.setattr(fo, "add_rms_norm_gate", lambda *a: pytest.fail("fp64 took the fp32 gate kernel"))
    x = torch.randn(3, cfg.hidden_size, dtype=torch.float64)
    h, hazard = model.run_loop(x, torch.arange(3, dtype=torch.int32), lambda i, q, k, v: q)
    assert hazard.dtype == torch.float64 and torch.equal(hazard, model.hazard(h))


def test_norm_in_gemm_gives_the_loop_the_bits_of_the_separate_norm_kernels_on_the_interpreter(tiny_ckpt, monkeypatch):
    """OuroModel.norm_in_gemm: o_proj and down run their norm step in their own launch (kernels/gemm_norm.py);
    on the interpreter (the last program runs every row) the loop's output and hazard are bitwise those of the
    projection followed by the norm kernel, and the counters are left zero."""
    from loopbench.kernels import gemm as gm
    from loopbench.kernels import gemm_norm as gn
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.bfloat16, fused=True)
    split = gm.GemmConfig(block_n=64, block_k=16, split_k=4, num_stages=1)

    def config(configs, faster, w, x, rows):       # o_proj and down on a split-K pointer config, the rest unfused
        return split if configs is gm.CONFIGS and w.shape[0] == cfg.hidden_size else None

    monkeypatch.setattr(model, "small_m_gemm", True)
    monkeypatch.setattr(model, "_fused_config", config)
    launches = []
    fused = gn.gemm_add_rms_norm
    monkeypatch.setattr(gn, "gemm_add_rms_norm", lambda *a: launches.append(a[1].shape) or fused(*a))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, cfg.hidden_size, generator=g).to(torch.bfloat16)
    pos = torch.arange(3, dtype=torch.int32)
    want = model.run_loop(x, pos, lambda i, q, k, v: q)
    assert launches == []
    model.norm_in_gemm = True
    got = model.run_loop(x, pos, lambda i, q, k, v: q)
    assert len(launches) == 2 * cfg.num_hidden_layers, "o_proj and down of every layer take their norm step"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert model._norm_counters.tolist() == [0, 0]


def test_norm_gemm_config_falls_back_wherever_the_fused_launch_cannot_run(tiny_ckpt, monkeypatch):
    """OuroModel.norm_gemm_config, which _project_norm and the probe's record both ask: a split-K pointer config
    only with norm_in_gemm on, no L2 prefetch, rows <= programs and a grid that fits the GPU; else None."""
    from loopbench.kernels import gemm as gm
    from loopbench.kernels import gemm_norm as gn
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.bfloat16, fused=True)
    weight = model.layers[0].o
    programs = -(-weight.shape[0] // 64) * 4
    split = gm.GemmConfig(block_n=64, block_k=16, split_k=4, num_stages=1)
    chosen = {"config": split}
    monkeypatch.setattr(model, "small_m_gemm", True)
    monkeypatch.setattr(model, "_fused_config", lambda configs, faster, w, x, rows: chosen["config"])

    def rows(n):
        return torch.empty(n, weight.shape[1], dtype=torch.bfloat16, device="meta")

    assert model.norm_gemm_config(rows(programs), weight) is None                  # norm_in_gemm off
    model.norm_in_gemm = True
    assert model.norm_gemm_config(rows(programs), weight) is split
    assert model.norm_gemm_config(rows(programs + 1), weight) is None              # a row without its program
    assert model.norm_gemm_config(rows(1), weight, None, model.gate_w) is None       # an L2 prefetch asked for
    for other in (None, gm.GemmConfig(block_n=64, split_k=4, tma=True), gm.GemmConfig(block_n=64, split_k=1)):
        chosen["config"] = other                                                  # cuBLAS, TMA, no split
        assert model.norm_gemm_config(rows(1), weight) is None, other
    chosen["config"] = split
    monkeypatch.setattr(gn, "fits", lambda device, c, n: False)                    # more programs than SMs
    assert model.norm_gemm_config(rows(1), weight) is None


def test_ring_config_runs_the_persistent_half_only_where_it_can(tiny_ckpt, monkeypatch):
    """OuroModel.ring_config, which the fused loop and the settings' ``mlp_ring`` ask: kernels/mlp_ring.py's
    configuration for this layer shape only with its table holding that shape (empty by default), our small-M GEMM
    on, bf16 weights, rows in one call, at most mlp_ring.MAX_M rows and no L2 prefetch of a projection it runs or of
    the next qkv; else None. The runner then keeps prefill loops off a second stream."""
    from loopbench.kernels import mlp_ring as mr
    from loopbench.runtime.runner import Runner
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.bfloat16, fused=True)
    hd = cfg.num_attention_heads * cfg.head_dim

    def rows(n):
        return torch.empty(n, hd, dtype=torch.bfloat16, device="meta")

    monkeypatch.setattr(model, "small_m_gemm", True)
    assert mr.CONFIGS == {} and model.ring_config(rows(1)) is None and not model.ring_on()    # off by default
    ring = mr.RingConfig()
    monkeypatch.setitem(mr.CONFIGS, (cfg.hidden_size, cfg.intermediate_size), ring)
    assert model.ring_on() and model.settings()["mlp_ring"] is True
    assert model.ring_config(rows(mr.MAX_M)) is ring
    assert model.ring_config(rows(mr.MAX_M + 1)) is None                          # too many rows
    assert model.ring_config(rows(1), gemm_rows=16) is None                       # rows in fixed-size calls
    for target in ("o_proj", "gate_up", "down", "qkv"):
        monkeypatch.setattr(model, "prefetch_next", {target: 0.5})
        assert model.ring_config(rows(1)) is None, target                         # an L2 prefetch asked for
    monkeypatch.setattr(model, "prefetch_next", {})
    monkeypatch.setattr(model, "small_m_gemm", False)
    assert model.ring_config(rows(1)) is None and not model.ring_on()             # cuBLAS: no ring
    monkeypatch.setattr(model, "small_m_gemm", True)
    monkeypatch.setattr(model, "dtype", torch.float32)
    assert model.ring_config(rows(1)) is None                                     # bf16 only
    monkeypatch.setattr(model, "dtype", torch.bfloat16)
    runner = Runner.__new__(Runner)
    runner.model, runner._prefill_stream = model, object()
    assert not runner.prefill_on_own_stream                                       # a persistent launch needs every SM
    monkeypatch.delitem(mr.CONFIGS, (cfg.hidden_size, cfg.intermediate_size))
    assert runner.prefill_on_own_stream


def test_the_fused_loop_hands_the_ring_each_layers_half_in_order(tiny_ckpt, monkeypatch):
    """Where ring_config gives a configuration, every layer's o_proj .. norm step goes to kernels/mlp_ring.py in one
    call, with that layer's weights and norms, the next layer's input norm (the final norm after the last layer) and
    the exit gate on the last layer only. A stand-in for the Gluon kernel (no interpreter) runs the loop's own
    unfused steps, so the loop's output and hazard are bitwise those of the loop without the ring."""
    from loopbench.kernels import fused_ops as fo
    from loopbench.kernels import mlp_ring as mr
    from loopbench.runtime.model import linear
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.bfloat16, fused=True)
    monkeypatch.setattr(model, "small_m_gemm", True)
    monkeypatch.setattr(model, "_fused_config", lambda configs, faster, w, x, rows: None)   # unfused projections
    calls = []

    def stand_in(a, x, w_o, gate_up, down, ln_in2, ln_post, ln_post2, ln_next, eps, config, counters, gate=None):
        calls.append((w_o, ln_next, gate))
        x1, h1 = fo.add_rms_norm(x, linear(a, w_o, None), ln_in2, ln_post, eps)
        y = linear(fo.silu_mul(linear(h1, gate_up, None)), down, None)
        return fo.add_rms_norm(x1, y, ln_post2, ln_next, eps) if gate is None else \
            fo.add_rms_norm_gate(x1, y, ln_post2, ln_next, eps, *gate)
    monkeypatch.setattr(mr, "mlp_ring", stand_in)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, cfg.hidden_size, generator=g).to(torch.bfloat16)
    pos = torch.arange(3, dtype=torch.int32)
    want = model.run_loop(x, pos, lambda i, q, k, v: q)
    assert calls == []
    monkeypatch.setitem(mr.CONFIGS, (cfg.hidden_size, cfg.intermediate_size), mr.RingConfig())
    got = model.run_loop(x, pos, lambda i, q, k, v: q)
    assert [c[0] is w.o for c, w in zip(calls, model.layers)] == [True] * cfg.num_hidden_layers
    nexts = [w.ln_in for w in model.layers[1:]] + [model.norm]
    assert all(c[1] is n for c, n in zip(calls, nexts)) and len(calls) == cfg.num_hidden_layers
    assert [c[2] is not None for c in calls] == [False] * (cfg.num_hidden_layers - 1) + [True]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
