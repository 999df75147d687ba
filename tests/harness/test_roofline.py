"""Roofline accounting (harness/roofline.py, harness/loop_timing.py): the byte formula against a hand count
for a tiny config, the engine's decode loops as the formula counts them (one recurrent-core loop and one
lm_head per decode step, the contexts the rows really read), the loop timer and the copy ceiling on the
CPU, and the CUDA-event timer on a GPU without a synchronisation inside the measured steps."""
import math

import pytest
import torch

from loopbench.harness import loop_timing, roofline
from loopbench.runtime.api import EngineConfig, Request
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.model import PRESETS, tensor_shapes

# A config small enough to count by hand: h=4, 1 layer, 2 heads / 1 KV head of dim 2, I=3, V=5.
HAND = {"hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
        "intermediate_size": 3, "vocab_size": 5, "total_ut_steps": 4}


def _record(kv_layout: str, routed: int = 0, fill: int = 0) -> dict:
    # one request, prompt of 3 tokens; output tokens 0 (prefill), 1 (exit depth 2), 2 (exit depth 4)
    return {"job": "cpu0", "seq": 0, "session": "cpu0", "device": {"label": "cpu"}, "point": "B1C1", "arm": kv_layout,
            "arm_config": {"kv_layout": kv_layout}, "coverage": {"routed_reads": routed, "fill_token_planes": fill},
            "measured": {"work": {"decode_steps": 6}, "outputs": {"r0": {"token_ids": [1, 2, 3], "exit_depths": [4, 2, 4]}}},
            "decode_timing": {"method": "wall_clock", "loop_s": [0.001] * 6}}


def test_loop_weight_bytes_by_hand_and_against_the_model(model64):
    # per layer: qkv 4*(4+2+2)=32, o 4*4=16, gate_up 6*4=24, down 4*3=12, norms 16 -> 100; + final norm + gate 8
    assert roofline.loop_weight_bytes(HAND, 2) == 2 * (100 + 8)
    assert roofline.loop_weight_bytes(model64.cfg.to_dict(), 8) == model64.weight_bytes
    cfg = PRESETS["ouro-1.4b"]
    layer_params = sum(math.prod(s) for name, s in tensor_shapes(cfg).items() if name.startswith("model.layers."))
    assert roofline.loop_weight_bytes(cfg.to_dict(), 2) == 2 * (layer_params + 2 * cfg.hidden_size)   # ~2.47 GB


def test_run_bytes_hand_count_native_and_alias():
    lens = {"r0": 3}
    # token 1: 2 loops x 4 keys; token 2: 4 loops x 5 keys -> 6 rows, 28 keys; one token's K+V in a layer: 2*1*2*2 = 8 B
    native = roofline.run_bytes(HAND, 2, 4, _record("native", fill=2), lens)
    assert native == {"decode_loops": 6, "decode_rows": 6, "context_keys": 28, "weight_bytes": 6 * 216,
                      "lm_head_bytes": 6 * 5 * 4 * 2,
                      "kv_read_bytes": 8 * (28 + 1),          # + the fill reads token 1 (exit 2 < 4) once
                      "kv_write_bytes": 8 * (6 + 2)}          # each row's K/V + the fill's two planes
    alias = roofline.run_bytes(HAND, 2, 4, _record("alias", routed=10), lens)
    assert alias["kv_read_bytes"] == 8 * 28 + 4 * 10          # + 10 int32 exit-map reads in the one layer
    assert alias["kv_write_bytes"] == 8 * 6 + 4 * 2           # + one exit-map entry per decode token


def test_derived_row_divides_by_loops_and_the_ceiling():
    plan = {"checkpoint": {"model_config": HAND}, "config": {"model": {"dtype": "bfloat16"}, "exit": {"max_loops": 4}},
            "points": [{"key": "B1C1", "requests": [{"request_id": "r0", "prompt_index": 0}]}]}
    ceiling = {"bytes_per_copy": 2000, "times_s": [2e-6, 1e-6]}                  # 2 GB/s at best
    row = roofline.derive(plan, [[7, 7, 7]], [_record("native", fill=2)], {"cpu0": ceiling})[0]
    total = 6 * 216 + 6 * 40 + 8 * 29 + 8 * 8
    assert row["decode_gpu_s"] == pytest.approx(0.006) and row["ms_per_loop"] == pytest.approx(1.0)
    assert row["mb_per_loop"] == pytest.approx(total / 6 / 1e6)
    assert row["achieved_gb_per_s"] == pytest.approx(total / 0.006 / 1e9)
    assert row["ceiling_gb_per_s"] == pytest.approx(2.0)
    assert row["ceiling_fraction"] == pytest.approx(total / 0.006 / 1e9 / 2.0)
    short = _record("native")
    short["decode_timing"]["loop_s"].pop()                                       # not one entry per loop
    assert roofline.derive(plan, [[7, 7, 7]], [short], {})[0]["ms_per_loop"] is None


class _CountingTimer:
    def __init__(self):
        self.starts = self.stops = 0

    def start(self):
        self.starts += 1

    def stop(self):
        self.stops += 1


def test_a_decode_step_is_one_loop_and_one_lm_head_over_the_rows_the_formula_counts(model64):
    """The engine as the formula sees it: per decode step one run_loop and one lm_head call, the timer
    around it, and the rows' contexts (position + 1 keys) summing to the formula's context_keys."""
    eng = LoopEngine(model64, EngineConfig(max_num_seqs=2, max_model_len=64, exit_policy="ouro", poison_kv=True))
    calls, per_step, keys = [], [], []
    real_decode = eng.runner.decode

    def decode(plan):
        keys.append(sum(r.pos + 1 for r in plan.decode))
        n = len(calls)
        out = real_decode(plan)
        per_step.append(sorted(calls[n:]))
        return out

    def counted(name):
        real = getattr(model64, name)
        return lambda *a, **k: (calls.append(name), real(*a, **k))[1]

    eng.runner.decode = decode
    timer = _CountingTimer()
    eng.decode_timer = timer
    prompts = {"r0": [5, 6, 7], "r1": list(range(11)), "r2": [9] * 6}
    for rid, p in prompts.items():
        eng.add_request(Request(rid, p, 5, min_loops=1, max_loops=4, exit_threshold=0.5))
    try:
        model64.run_loop, model64.logits = counted("run_loop"), counted("logits")   # instance attributes
        outs = eng.run()
    finally:
        del model64.run_loop, model64.logits
    steps = eng.stats.decode_steps
    assert timer.starts == timer.stops == steps == len(keys) > 0
    assert per_step == [["logits", "run_loop"]] * steps, "one recurrent-core loop and one lm_head per decode step"
    outputs = {rid: {"exit_depths": list(o.exit_depths)} for rid, o in outs.items()}
    rows, ctx = roofline.decode_rows_and_keys(outputs, {rid: len(p) for rid, p in prompts.items()})
    assert rows == sum(eng.stats.rows_per_depth) and ctx == sum(keys)


def test_wall_clock_timer_and_cpu_copy_ceiling():
    timer = loop_timing.DecodeLoopTimer("cpu")
    for _ in range(3):
        timer.start()
        timer.stop()
    rec = timer.record()
    assert rec["method"] == "wall_clock" and len(rec["loop_s"]) == 3 and all(t >= 0 for t in rec["loop_s"])
    timer.start()
    with pytest.raises(RuntimeError, match="started but not stopped"):
        timer.loop_s()
    with pytest.raises(ValueError, match="device_kind"):
        loop_timing.DecodeLoopTimer("tpu")
    c = loop_timing.copy_ceiling({"kind": "cpu", "torch": "cpu"}, buffer_bytes=1 << 20, repeats=3)
    assert c["buffer_bytes"] == 1 << 20 and c["bytes_per_copy"] == 2 << 20 and len(c["times_s"]) == 3
    assert all(t > 0 for t in c["times_s"]) and "wall_clock" in c["method"]
    with pytest.raises(ValueError, match="positive"):
        loop_timing.copy_ceiling({"kind": "cpu", "torch": "cpu"}, buffer_bytes=0)


@pytest.mark.gpu
def test_cuda_event_timer_never_synchronises_inside_measured_steps(tiny_ckpt):
    """The measured steps of a graph arm run under sync debug mode "error" with the timer installed; the
    events are read after the run, one per decode loop, each positive; the copy ceiling is a real rate."""
    from loopbench.runtime.model import OuroModel

    model = OuroModel.from_tensors(*tiny_ckpt, device="cuda", dtype=torch.bfloat16)
    eng = LoopEngine(model, EngineConfig(max_num_seqs=4, max_model_len=128, exit_policy="fixed",
                                         attention_backend="triton", cuda_graphs=True))
    reqs = [Request(f"r{i}", list(range(3, 20 + i)), 6, min_loops=2, max_loops=4, exit_threshold=1.0) for i in range(4)]
    for r in reqs:
        eng.add_request(r)
    eng.run()                                  # warmup: graph captures synchronise
    eng.reset_run()
    before = eng.stats.decode_steps
    timer = loop_timing.DecodeLoopTimer("cuda")
    eng.decode_timer = timer
    for r in reqs:
        eng.add_request(r)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while eng.has_unfinished():
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    eng.outputs()
    loop_s = timer.record()["loop_s"]
    assert len(loop_s) == eng.stats.decode_steps - before > 0 and all(t > 0 for t in loop_s)
    c = loop_timing.copy_ceiling({"kind": "cuda", "torch": "cuda"}, buffer_bytes=256 << 20, repeats=3)
    assert c["bytes_per_copy"] / min(c["times_s"]) > 1e11    # > 100 GB/s on any datacenter GPU
