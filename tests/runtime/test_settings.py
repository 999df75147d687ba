"""What an engine says it ran with: ``LoopEngine.settings()`` and ``OuroModel.settings()`` on the tiny CPU model
(and the 1.4B shape on the meta device): every EngineConfig field, the resolved prefill stream and the model's
switches, each a plain JSON scalar."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from loopbench.runtime.api import EngineConfig, KVLayout, Request, setting_value
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.model import PRESETS, PREFETCH_TARGETS, OuroModel, tensor_shapes

SCALARS = (str, int, float, bool, type(None))


@pytest.fixture
def model32(tiny_ckpt):
    return OuroModel.from_tensors(*tiny_ckpt, dtype=torch.float32)


def _scalars(settings: dict) -> None:
    assert all(isinstance(k, str) for k in settings)
    bad = {k: v for k, v in settings.items() if type(v) not in SCALARS}
    assert not bad, bad
    json.dumps(settings, allow_nan=False)


def test_engine_settings_hold_every_config_field_the_resolved_ones_and_the_models(model32):
    cfg = EngineConfig(max_num_seqs=3, max_model_len=64, kv_layout=KVLayout.ALIAS, prefix_tiles=True,
                       prefill_gemm_rows=16)
    got = LoopEngine(model32, cfg).settings()
    _scalars(got)
    for f in dataclasses.fields(EngineConfig):
        if f.name != "schedule":
            assert got[f.name] == getattr(cfg, f.name), f.name
    assert "schedule" not in got and got["schedule_sha256"] is None
    assert type(got["kv_layout"]) is str and got["kv_layout"] == "alias"      # the enum's value, not the enum
    assert got["num_blocks"] is None and got["kv_num_blocks"] == 3 * 4 * 4 + 1   # slots x planes x blocks + block 0
    assert got["prefill_gemm_rows"] == got["prefill_call_rows"] == 16
    assert got["prefill_on_own_stream"] is False and got["fused_kv_write"] is False   # a CPU, plain torch
    assert {k: v for k, v in got.items() if k.startswith("model_")} == {
        f"model_{k}": v for k, v in model32.settings().items()}
    assert LoopEngine(model32, EngineConfig(max_model_len=1024)).settings()["prefill_call_rows"] == 256


def test_a_replay_engine_names_its_schedule_by_its_sha256(model32):
    natural = LoopEngine(model32, EngineConfig(max_num_seqs=2, max_model_len=64, prefill_gemm_rows=16))
    natural.add_request(Request("r0", [1, 2, 3], 3, min_loops=2, max_loops=4, exit_threshold=0.5))
    natural.run()
    schedule = natural.capture_schedule()
    replay = LoopEngine(model32, EngineConfig(max_num_seqs=2, max_model_len=64, exit_policy="replay",
                                              schedule=schedule)).settings()
    assert replay["schedule_sha256"] == schedule.sha256 and replay["exit_policy"] == "replay"


def test_model_settings_name_its_switches_as_resolved_on_a_cpu(model32):
    got = model32.settings()
    _scalars(got)
    assert got == {"device_type": "cpu", "dtype": "float32", "fused": False, "small_m_gemm": False,
                   "wgmma_projections": "", "greedy_tiles": True, "norm_in_gemm": False, "mlp_ring": False,
                   "prefill_gemm": False, **{f"prefetch_next_{t}": None for t in PREFETCH_TARGETS}, "pdl": False, "pdl_trigger": None}
    model32.norm_in_gemm, model32.greedy_tiles = True, False          # switches are read when asked
    model32.prefetch_next = {"down": 0.5}
    assert {k: model32.settings()[k] for k in ("norm_in_gemm", "greedy_tiles", "prefetch_next_down",
                                               "prefetch_next_qkv")} == {
        "norm_in_gemm": True, "greedy_tiles": False, "prefetch_next_down": 0.5, "prefetch_next_qkv": None}
    model32.prefill_gemm = True                                       # asked for, but a CPU model has no fused loop
    assert model32.settings()["prefill_gemm"] is False


def test_the_wgmma_projections_are_those_both_tables_configure_for_the_models_shapes(monkeypatch):
    from loopbench.kernels import wgmma_gemm
    cfg = PRESETS["ouro-1.4b"]
    tensors = {n: torch.empty(s, device="meta", dtype=torch.bfloat16) for n, s in tensor_shapes(cfg).items()}
    model = OuroModel.from_tensors(cfg, tensors, device="meta", dtype=torch.bfloat16, rope_len=16)
    assert model.settings()["wgmma_projections"] == ""       # no small-M GEMM off an sm_90 GPU: neither runs
    model.small_m_gemm = True
    assert model.settings()["wgmma_projections"] == "o_proj,down"   # kernels/wgmma_gemm.py CONFIGS
    monkeypatch.setattr(wgmma_gemm, "CONFIGS", {})
    assert model.settings()["wgmma_projections"] == ""


def test_the_prefill_stream_is_not_used_while_norm_in_gemm_is_on(model32):
    eng = LoopEngine(model32, EngineConfig(max_model_len=64))
    eng.runner._prefill_stream = object()     # as prefill_beside_decode gives one on CUDA with Triton
    assert eng.settings()["prefill_on_own_stream"] is True
    model32.norm_in_gemm = True
    assert eng.settings()["prefill_on_own_stream"] is False


@pytest.mark.parametrize("value, plain", [("x", "x"), (KVLayout.ALIAS, "alias"), (np.int64(3), 3), (True, True),
                                          (0.25, 0.25), (np.float32(0.5), 0.5), (None, None)])
def test_a_setting_is_a_plain_json_scalar(value, plain):
    got = setting_value("s", value)
    assert got == plain and type(got) is type(plain)


@pytest.mark.parametrize("value, error", [([1], TypeError), ({"a": 1}, TypeError), (float("nan"), ValueError),
                                          (torch.tensor(1), TypeError)])
def test_a_setting_that_is_no_json_scalar_is_refused_by_name(value, error):
    with pytest.raises(error, match="setting 'bad'"):
        setting_value("bad", value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stream", [True, False])
def test_settings_on_a_gpu_name_what_ran_there(tiny_ckpt, stream):
    """On CUDA with the Triton backend: the fused loop, the fused KV write, PDL as the device allows, and the
    prefill stream exactly as asked; a run changes none of it."""
    model = OuroModel.from_tensors(*tiny_ckpt, device="cuda", dtype=torch.bfloat16)
    eng = LoopEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64, attention_backend="triton",
                                         cuda_graphs=True, prefill_stream=stream))
    before = eng.settings()
    eng.add_request(Request("r0", [1, 2, 3], 3, min_loops=2, max_loops=4, exit_threshold=0.5))
    eng.run()
    got = eng.settings()
    _scalars(got)
    sm90 = torch.cuda.get_device_capability() >= (9, 0)
    assert got == before
    assert (got["model_device_type"], got["model_dtype"], got["model_fused"], got["fused_kv_write"]) == (
        "cuda", "bfloat16", True, True)
    assert got["prefill_on_own_stream"] is stream and got["model_pdl"] is sm90
