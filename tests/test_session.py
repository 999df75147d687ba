"""Sessions against the runtime: a captured reference replays exactly, twice on one engine."""
import json

import pytest
import torch

from loopbench.harness import session
from loopbench.harness.checkpoint import write_synthetic_checkpoint

CPU = {"kind": "cpu", "torch": "cpu", "gpu_index": None, "label": "cpu", "name": "cpu", "uuid": None}
EXIT = {"policy": "ouro_delayed", "threshold": 0.5, "min_loops": 2, "max_loops": 4}
ARM = {"kv_layout": "native", "prefix_tiles": False, "attention_backend": "torch", "cuda_graphs": False,
       "graph_cache_size": 16, "descriptor_mode": "h2d", "block_size": 16, "tile_size": 32}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0, dtype=torch.float32)
    return session.load_model(str(path), "float32", CPU, max_model_len=64)


def test_reference_replays_exactly_in_warmup_and_measured_runs(model):
    from loopbench.harness.engine import LoopEngine

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (5, 33), generator=g).tolist()
    reqs = session.build_requests(prompts, 5, 8, EXIT)
    assert [r.request_id for r in reqs] == ["r0000", "r0001", "r0002", "r0003", "r0004"]
    natural = LoopEngine(model, session.engine_config(ARM, 3, 64, "ouro_delayed"))
    ref = session.run_phase(natural, reqs, CPU)
    schedule = natural.capture_schedule()
    assert ref["elapsed_s"] > 0 and ref["memory"]["peak_allocated_bytes"] is None
    assert {len(o["token_ids"]) for o in ref["outputs"].values()} == {8}
    for arm in (ARM, {**ARM, "kv_layout": "alias"}, {**ARM, "kv_layout": "alias", "prefix_tiles": True}):
        eng = LoopEngine(model, session.engine_config(arm, 3, 64, "replay", schedule))
        warm = session.run_phase(eng, reqs, CPU)
        session.begin_repeat_run(eng)
        meas = session.run_phase(eng, reqs, CPU)
        for run in (warm, meas):
            assert run["outputs"] == ref["outputs"]
            assert run["work"] == ref["work"]           # per-run counters, not the engine's running totals
            assert run["trace_sha256"] == schedule.trace_sha256
            assert run["graphs"]["captures"] == run["graphs"]["replays"] == run["graphs"]["fallbacks"] == 0


def test_counter_delta_keeps_peaks_and_subtracts_lists():
    before = {"rows_per_depth": [1, 2], "steps": 3, "peak_kv_blocks": 5}
    after = {"rows_per_depth": [4, 6], "steps": 10, "peak_kv_blocks": 7, "graph_captures": 2}
    assert session._counter_delta(before, after) == {"rows_per_depth": [3, 4], "steps": 7, "peak_kv_blocks": 7,
                                                     "graph_captures": 2}


def test_cpu_device_and_thread_setting():
    threads = torch.get_num_threads()
    try:
        dev = session.resolve_device({"name": "cpu0", "device": {"kind": "cpu", "gpu_index": None, "cpu_threads": 1}})
        assert dev["label"] == "cpu" and dev["gpu_index"] is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_too_few_prompts_is_refused():
    with pytest.raises(ValueError, match="pool has 1 prompts, the point needs 2"):
        session.build_requests([[1, 2]], 2, 4, EXIT)


def test_reference_cache_key_depends_on_device_and_inputs():
    a = session.reference_cache_key({"x": 1}, CPU)
    assert a == session.reference_cache_key({"x": 1}, dict(CPU))
    assert a != session.reference_cache_key({"x": 2}, CPU)
    assert a != session.reference_cache_key({"x": 1}, {**CPU, "name": "H200"})
    json.dumps(a)
