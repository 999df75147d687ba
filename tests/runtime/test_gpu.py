"""GPU runtime checks (marker ``gpu``; skipped without CUDA): GPU vs CPU reference, bitwise arms with
graphs on/off and both descriptor modes, aborts and slot reuse, a descriptor-bank lifetime probe, and
CUDA-graph captures on a cold Triton cache (in a child process, tests/runtime/gpu_capture_child.py)."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loopbench.harness.fixtures import write_synthetic_checkpoint
from loopbench.runtime.checkpoint import load_checkpoint
from loopbench.runtime.api import EngineConfig, Request
from loopbench.runtime.descriptors import DESC_ROWS, DescriptorBanks
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.model import OuroModel
from loopbench.runtime.reference import NaiveOuro

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_synthetic_checkpoint(path, "tiny", seed=0, dtype=torch.float32)
    return load_checkpoint(path)


def requests(n, max_tokens, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Request(f"r{i}", torch.randint(0, 256, (lens[i % len(lens)],), generator=g).tolist(), max_tokens,
                    min_loops=2, max_loops=4, exit_threshold=0.5) for i in range(n)]


def run(model, reqs, **cfg):
    eng = LoopEngine(model, EngineConfig(max_model_len=128, poison_kv=True, **cfg))
    for r in reqs:
        eng.add_request(r)
    return eng, eng.run()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_fp32_matches_cpu_reference(ckpt, backend):
    cfg, tensors = ckpt
    model = OuroModel.from_tensors(cfg, tensors, device="cuda", dtype=torch.float32)
    naive = NaiveOuro(cfg, tensors, dtype=torch.float64)
    reqs = requests(6, 8, [1, 16, 17, 33, 34, 64])
    _, outs = run(model, reqs, max_num_seqs=4, exit_policy="ouro_delayed", attention_backend=backend)
    for r in reqs:
        tokens, exits = naive.generate(list(r.prompt_token_ids), 8, policy="ouro_delayed", min_loops=2,
                                       max_loops=4, threshold=0.5)
        assert (list(outs[r.request_id].token_ids), list(outs[r.request_id].exit_depths)) == (tokens, exits)


ARMS = {"native": dict(kv_layout="native"), "alias": dict(kv_layout="alias"),
        "alias_prefix": dict(kv_layout="alias", prefix_tiles=True)}


@pytest.mark.parametrize("max_num_seqs", [1, 4, 16, 32, 64, 128])
def test_arms_bitwise_equal_graphs_and_descriptor_modes(ckpt, max_num_seqs):
    cfg, tensors = ckpt
    model = OuroModel.from_tensors(cfg, tensors, device="cuda", dtype=torch.bfloat16)
    reqs = requests(min(2 * max_num_seqs, 48) + 1, 10, [33, 34])
    base, _ = run(model, reqs, max_num_seqs=max_num_seqs, exit_policy="ouro_delayed",
                  attention_backend="triton", cuda_graphs=True)
    sched = base.capture_schedule()
    results = {}
    for graphs in (False, True):
        for mode in ("h2d", "mapped"):
            for name, arm in ARMS.items():
                eng, outs = run(model, reqs, max_num_seqs=max_num_seqs, exit_policy="replay", schedule=sched,
                                attention_backend="triton", cuda_graphs=graphs, descriptor_mode=mode,
                                keep_logits=True, **arm)
                results[(graphs, mode, name)] = (outs, eng.logits_log)
                if graphs:
                    assert eng.stats.decode_graphs.fallbacks == 0 and eng.stats.decode_graphs.replays > 0
    # graphs on/off may differ in padding; within each graph setting every arm and mode is bitwise equal
    for graphs in (False, True):
        ref_outs, ref_logits = results[(graphs, "h2d", "native")]
        for (g, mode, name), (outs, logits) in results.items():
            if g != graphs:
                continue
            assert outs == ref_outs, f"graphs={g} {mode} {name}: tokens/exits differ"
            for rid, rows in ref_logits.items():
                assert all(torch.equal(a, b) for a, b in zip(rows, logits[rid])), f"graphs={g} {mode} {name} {rid}"
    sched.verify(results[(True, "h2d", "alias_prefix")][0], None)


def test_gpu_abort_and_slot_reuse(ckpt):
    cfg, tensors = ckpt
    model = OuroModel.from_tensors(cfg, tensors, device="cuda", dtype=torch.bfloat16)
    reqs = requests(3, 12, [33, 34, 20], seed=4)
    late = [dataclasses.replace(r, request_id=f"late{i}") for i, r in enumerate(requests(2, 12, [31, 33], seed=5))]
    kw = dict(max_num_seqs=2, exit_policy="ouro_delayed", attention_backend="triton", cuda_graphs=True,
              kv_layout="alias", prefix_tiles=True)
    eng = LoopEngine(model, EngineConfig(max_model_len=128, poison_kv=True, **kw))
    eng.add_request(reqs[0])
    eng.add_request(reqs[1])
    eng.step()
    eng.abort("r0")
    eng.add_request(late[0])
    for _ in range(12):
        eng.step()
    eng.abort("r1")
    eng.add_request(late[1])
    outs = eng.run()
    for r in late:
        _, fresh = run(model, [r], **kw)
        assert outs[r.request_id] == fresh[r.request_id]


@pytest.mark.parametrize("mode", ["h2d", "mapped"])
def test_descriptor_bank_is_not_rewritten_while_the_gpu_may_read_it(mode):
    """Probe: the GPU is held busy, so its read of bank 0 is still queued when the host wants bank 0
    again. Without the event wait the host would overwrite it and the device would read the new value."""
    banks = DescriptorBanks(8, torch.device("cuda"), mode, num_banks=1)
    dst = torch.zeros((DESC_ROWS, 8), dtype=torch.int32, device="cuda")
    banks.publish(banks.acquire(8), into=dst)      # warm: kernel/module loads and first event creation
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    banks.waits = 0
    bank = banks.acquire(8)
    bank.fill_(7)
    torch.cuda._sleep(200_000_000)            # ~0.1 s of GPU spin ahead of the read
    banks.publish(bank, into=dst)
    bank2 = banks.acquire(8)                  # must wait for the read above
    bank2.fill_(9)
    torch.cuda.synchronize()
    assert torch.all(dst == 7), "the device read a bank the host had already rewritten"
    assert banks.waits == 1


# ------------------------------------------------------- CUDA-graph captures with a cold kernel cache
REPO = Path(__file__).resolve().parents[2]


def run_capture_child(scenario: str, tmp_path: Path, timeout_s: int) -> dict:
    """Run tests/runtime/gpu_capture_child.py in a fresh process whose Triton cache is an empty directory (a cold
    machine: every kernel is compiled in that process first); returns its JSON report."""
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / f"{scenario}.json"
    proc = subprocess.run([sys.executable, "-m", "tests.runtime.gpu_capture_child", scenario, str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0 and out.exists(), (
        f"capture child '{scenario}' exited {proc.returncode}; stderr tail:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def test_cold_kernel_cache_captures_every_policy_layout_and_bucket(tmp_path):
    """Fresh TRITON_CACHE_DIR, collector on, one fresh engine per run: every capture of every policy x
    layout succeeds (no compile inside a capture, or GraphCaptureError names it), decode buckets 8/4/2/1 and
    the packed-prefill buckets are captured, nothing falls back, and the layouts give the same tokens."""
    report = run_capture_child("workload", tmp_path, timeout_s=240)
    runs = report["runs"]
    for r in runs:
        assert "error" not in r, f"{r['policy']} {r['arm']} failed after {r['seconds']}s:\n{r['error']}"
    assert len(runs) == 12, f"expected 4 policies x 3 layouts, got {[(r['policy'], r['arm']) for r in runs]}"
    by_policy = {}
    for r in runs:
        what, s = f"{r['policy']} {r['arm']}", r["stats"]
        dec, pre = s["decode_graphs"], s["prefill_graphs"]
        assert dec["captures"] == len(r["decode_buckets"]) >= 3, f"{what}: decode buckets {r['decode_buckets']}"
        # 7 prompts (143 rows) packed for loops 1-3 (bucket 192), the 4-loop ones (54 rows) for loop 4 (64)
        assert pre["captures"] == len(r["prefill_buckets"]) and r["prefill_buckets"] == [64, 192], \
            f"{what}: {r['prefill_buckets']}"
        assert dec["fallbacks"] == 0 and pre["fallbacks"] == 0, f"{what}: eager fallbacks {s}"
        assert dec["replays"] > 0, what
        by_policy.setdefault(r["policy"], {})[r["arm"]] = r["outputs"]
    for policy, arms in by_policy.items():
        for arm, outputs in arms.items():
            assert outputs == arms["native"], f"{policy}: {arm} tokens/exits differ from native"
    assert by_policy["replay"]["native"] == by_policy["ouro_delayed"]["native"], "replay differs from its capture"


def test_failed_capture_raises_clearly_and_leaves_the_process_usable(tmp_path):
    report = run_capture_child("failed-capture", tmp_path, timeout_s=120)
    assert report["error"] is not None, "a capture that launches a new Triton specialisation must fail"
    assert "graph bucket 4" in report["error"], report["error"]
    assert "_add_one_kernel" in report["error"] or "capturing" in report["error"], report["error"]
    assert report["cached_after_failure"] == [], "a failed capture must not be cached"
    assert report["after"] == [3.0] * 16 and report["matmul"] == 512.0, f"the process is not usable: {report}"


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("policy", ["ouro_delayed", "ouro"])
@pytest.mark.parametrize("max_num_seqs", [1, 4, 16])
def test_prefill_on_its_own_stream_changes_no_bit(ckpt, graphs, policy, max_num_seqs):
    """EngineConfig.prefill_stream runs a step's prefill loop beside its decode loop: the same tokens, exits and
    logits as one stream, natural policies included (ouro reads the step just launched; an EOS token makes the
    host read tokens, also a prefill's first one; a one-token request finishes at its prefill), with and
    without keep_logits (which joins the streams before the decode loop: without it they overlap)."""
    cfg, tensors = ckpt
    model = OuroModel.from_tensors(cfg, tensors, device="cuda", dtype=torch.bfloat16)
    reqs = requests(2 * max_num_seqs + 3, 10, [33, 1, 64, 17, 34])
    reqs[1] = dataclasses.replace(reqs[1], max_tokens=1)
    kw = dict(max_num_seqs=max_num_seqs, exit_policy=policy, attention_backend="triton", cuda_graphs=graphs,
              eos_token_id=7 if policy == "ouro" else None)
    base, base_outs = run(model, reqs, keep_logits=True, **kw)
    for keep in (True, False):
        eng, outs = run(model, reqs, keep_logits=keep, prefill_stream=True, **kw)
        assert outs == base_outs, f"keep_logits={keep}: tokens, exits or finish reasons differ"
        if keep:
            for rid, rows in base.logits_log.items():
                assert len(rows) == len(eng.logits_log[rid])
                assert all(torch.equal(a, b) for a, b in zip(rows, eng.logits_log[rid])), rid
    assert any(o.finish_reason == "length" for o in base_outs.values())


def test_the_norm_step_in_gemm_keeps_prefill_on_the_decode_stream(ckpt, monkeypatch):
    """model.norm_in_gemm counts arrivals in one buffer per model and needs every program resident, so two of its
    GEMMs must never run at once: with it, prefill loops stay on the current stream (a non-batch-invariant engine's
    prefill packs take that path too). No launch of a norm-in-GEMM kernel happens here: the stream is checked."""
    from loopbench.runtime import runner as runner_mod
    cfg, tensors = ckpt
    model = OuroModel.from_tensors(cfg, tensors, device="cuda", dtype=torch.bfloat16)
    eng = LoopEngine(model, EngineConfig(max_model_len=128, max_num_seqs=2, attention_backend="triton"))
    streams = []
    monkeypatch.setattr(runner_mod.Runner, "_prefill",
                        lambda self, loops: streams.append(torch.cuda.current_stream()) or None)
    plan_loops = [object()]
    for norm_in_gemm in (False, True):
        model.norm_in_gemm = norm_in_gemm
        eng.runner._prefill_x[0] = torch.zeros(1, device="cuda")
        plan_loops[0] = type("Loop", (), {"slot": 0})()
        eng.runner.prefill(plan_loops)
        eng.runner.join_prefill()
    model.norm_in_gemm = False
    assert streams[0] == eng.runner._prefill_stream and streams[1] == torch.cuda.current_stream()


@pytest.mark.parametrize("prefill_stream", [False, True])
@pytest.mark.parametrize("policy", ["replay", "ouro_delayed", "fixed"])
@pytest.mark.parametrize("layout", [dict(kv_layout="native"), dict(kv_layout="alias", prefix_tiles=True)])
def test_measured_steps_never_synchronise(ckpt, policy, layout, prefill_stream):
    """After the warmup, every step of a run (admissions, block growth, packed prefill, decode, exits,
    finishes) runs under torch's sync debug mode "error": any synchronising call raises. ouro_delayed
    waits only on the previous step's event (DescriptorBanks and the gate read-back use events, which
    the debug mode does not count: they wait for work already queued, not for the step just launched)."""
    cfg, tensors = ckpt
    model = OuroModel.from_tensors(cfg, tensors, device="cuda", dtype=torch.bfloat16)
    reqs = requests(12, 10, [5, 17, 33, 64, 20])
    kw = dict(max_num_seqs=4, max_model_len=128, attention_backend="triton", cuda_graphs=True,
              prefill_stream=prefill_stream, **layout)
    natural = LoopEngine(model, EngineConfig(exit_policy="ouro_delayed" if policy == "replay" else policy, **kw))
    for r in reqs:
        natural.add_request(r)
    natural.run()
    eng = natural
    if policy == "replay":                  # its warmup (graph captures synchronise) runs unchecked
        eng = LoopEngine(model, EngineConfig(exit_policy="replay", schedule=natural.capture_schedule(), **kw))
        for r in reqs:
            eng.add_request(r)
        eng.run()
    expected = eng.outputs()
    eng.reset_run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for r in reqs:
            eng.add_request(r)
        while eng.has_unfinished():
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert eng.outputs() == expected
    assert eng.stats.decode_graphs.fallbacks == 0 and eng.stats.prefill_graphs.fallbacks == 0
