"""Checkpoint loader, content hash and synthetic checkpoints (runtime/checkpoint.py).

Everything runs on the tiny preset in a few seconds on 2 CPU cores; the 1.4B shape is checked on the
meta device and through the shard planner only.
"""
import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopbench.harness.fixtures import (GATE_SIGMA, gate_bias_for_mix, gate_bias_for_observed_mix, hf_config_dict,
                                        plan_shards, three_loop_fraction, write_synthetic_checkpoint)
from loopbench.runtime.checkpoint import (CONFIG_NAME, INDEX_NAME, CheckpointError, checkpoint_sha256,
                                          config_from_hf_dict, load_checkpoint)
from loopbench.runtime.model import PRESETS, parameter_count, tensor_shapes

TINY = PRESETS["tiny"]
SHARD_BYTES = 30_000  # splits the tiny bf16 model (~0.2 MB) into ~10 files


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ck") / "single", "tiny", seed=0)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ck") / "sharded", "tiny", seed=0,
                                      max_shard_bytes=SHARD_BYTES)


@pytest.fixture
def single_copy(single, tmp_path):
    return shutil.copytree(single, tmp_path / "copy")


@pytest.fixture
def sharded_copy(sharded, tmp_path):
    return shutil.copytree(sharded, tmp_path / "copy")


def edit_config(ckpt, edit):
    raw = json.loads((ckpt / CONFIG_NAME).read_text())
    edit(raw)
    (ckpt / CONFIG_NAME).write_text(json.dumps(raw))


def edit_tensors(ckpt, edit):
    file = ckpt / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------ round trips

def test_single_file_round_trip(single):
    assert sorted(p.name for p in single.iterdir()) == ["config.json", "model.safetensors"]
    cfg, tensors = load_checkpoint(single)
    assert cfg == TINY
    assert list(tensors) == list(tensor_shapes(TINY))
    raw = load_file(single / "model.safetensors")
    for name, shape in tensor_shapes(TINY).items():
        assert tensors[name].shape == shape and tensors[name].dtype == torch.bfloat16
        assert torch.equal(tensors[name], raw[name])
    hf = json.loads((single / CONFIG_NAME).read_text())
    assert hf["architectures"] == ["OuroForCausalLM"]
    assert hf["model_type"] == "ouro" and hf["torch_dtype"] == "bfloat16"


def test_sharded_round_trip_matches_single_file(single, sharded):
    index = json.loads((sharded / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (sharded / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == 2 * parameter_count(TINY)
    cfg_a, a = load_checkpoint(single)
    cfg_b, b = load_checkpoint(sharded)
    assert cfg_a == cfg_b == TINY
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_same_seed_same_bytes_other_seed_other_values(single, tmp_path):
    # Several rewrites: file bytes must not depend on hash-map order or anything else run-to-run.
    for k in range(4):
        again = write_synthetic_checkpoint(tmp_path / f"again{k}", "tiny", seed=0)
        assert checkpoint_sha256(again) == checkpoint_sha256(single)
    other = write_synthetic_checkpoint(tmp_path / "other", TINY, seed=1)
    assert checkpoint_sha256(other) != checkpoint_sha256(single)
    _, a = load_checkpoint(single)
    _, b = load_checkpoint(other)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(a["model.early_exit_gate.bias"], b["model.early_exit_gate.bias"])  # bias is seed-free


def test_dtype_and_device_options(single, tmp_path):
    _, bf16 = load_checkpoint(single)
    _, f32 = load_checkpoint(single, dtype=torch.float32, device="cpu")
    assert all(t.dtype == torch.float32 for t in f32.values())
    assert all(torch.equal(f32[n], bf16[n].float()) for n in bf16)
    cfg, f64 = load_checkpoint(write_synthetic_checkpoint(tmp_path / "f64", "tiny", dtype=torch.float64))
    assert all(t.dtype == torch.float64 for t in f64.values())
    with pytest.raises(ValueError, match="int8"):
        load_checkpoint(single, dtype=torch.int8)


def test_sha256_covers_config_and_weights(single_copy):
    before = checkpoint_sha256(single_copy)
    weights = single_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    flipped = checkpoint_sha256(single_copy)
    assert flipped != before
    edit_config(single_copy, lambda raw: raw.update(rms_norm_eps=1e-5))
    assert checkpoint_sha256(single_copy) not in (before, flipped)


# --------------------------------------------------------------------------------------- tensor errors

def test_missing_tensor(single_copy):
    edit_tensors(single_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'.*\(128, 64\)"):
        load_checkpoint(single_copy)


def test_unexpected_tensor(single_copy):
    edit_tensors(single_copy, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_checkpoint(single_copy)


def test_wrong_shape(single_copy):
    edit_tensors(single_copy, lambda t: t.update({"lm_head.weight": torch.zeros(256, 65, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' has shape \(256, 65\), expected \(256, 64\)"):
        load_checkpoint(single_copy)


def test_one_tensor_in_another_dtype_refused_without_a_dtype(single_copy):
    name = "model.layers.0.input_layernorm.weight"
    edit_tensors(single_copy, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointError, match=rf"1 of 27 tensors are not stored in bfloat16 \(config torch_dtype\): "
                                              rf"float32: '{name}'\. Pass a dtype"):
        load_checkpoint(single_copy)


def test_integer_tensor_refused_even_with_a_dtype(single_copy):
    name = "model.layers.0.input_layernorm.weight"
    edit_tensors(single_copy, lambda t: t.update({name: t[name].to(torch.int32)}))
    for dtype in (None, torch.bfloat16):
        with pytest.raises(CheckpointError, match=rf"'{name}' has dtype I32, expected a floating dtype"):
            load_checkpoint(single_copy, dtype=dtype)


def test_dtype_must_match_config_torch_dtype(single_copy):
    edit_config(single_copy, lambda raw: raw.update(torch_dtype="float16"))
    with pytest.raises(CheckpointError, match=r"every tensor is stored in bfloat16, but config torch_dtype says float16"):
        load_checkpoint(single_copy)


def test_inconsistent_dtypes_without_torch_dtype(single_copy):
    edit_config(single_copy, lambda raw: raw.pop("torch_dtype"))
    load_checkpoint(single_copy)  # a uniform checkpoint needs no torch_dtype
    edit_tensors(single_copy, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].half()}))
    with pytest.raises(CheckpointError, match=r"not stored in bfloat16 \(the dtype of most tensors\): float16: 'model\.norm\.weight'"):
        load_checkpoint(single_copy)


# --------------------------------------------------------------------------------------- config errors

def test_unknown_config_key(single_copy):
    edit_config(single_copy, lambda raw: raw.update(num_experts=8))
    with pytest.raises(CheckpointError, match=r"unknown config key 'num_experts'"):
        load_checkpoint(single_copy)


@pytest.mark.parametrize("key", ["head_dim", "total_ut_steps", "rope_theta", "tie_word_embeddings"])
def test_missing_config_key(single_copy, key):
    edit_config(single_copy, lambda raw: raw.pop(key))
    with pytest.raises(CheckpointError, match=rf"missing config key '{key}'"):
        load_checkpoint(single_copy)


@pytest.mark.parametrize("key, value", [
    ("hidden_size", "64"), ("hidden_size", 64.0), ("num_hidden_layers", True), ("rope_theta", "1e4"),
    ("rms_norm_eps", None), ("tie_word_embeddings", 0), ("early_exit_threshold", [1.0]),
])
def test_wrong_typed_config_value(single_copy, key, value):
    edit_config(single_copy, lambda raw: raw.update({key: value}))
    with pytest.raises(CheckpointError, match=rf"'{key}' must be .*got {value!r}".replace("[", r"\[").replace("]", r"\]")):
        load_checkpoint(single_copy)


@pytest.mark.parametrize("key, value", [
    ("hidden_act", "gelu"), ("attention_bias", True), ("rope_scaling", {"type": "linear", "factor": 2.0}),
    ("use_sliding_window", True), ("model_type", "qwen2"), ("layer_types", ["sliding_attention"] * 2),
])
def test_harmless_keys_must_keep_the_math(single_copy, key, value):
    edit_config(single_copy, lambda raw: raw.update({key: value}))
    with pytest.raises(CheckpointError, match=rf"config key '{key}' must be"):
        load_checkpoint(single_copy)


def test_invalid_value_rejected_by_config_and_integer_rope_theta_accepted():
    raw = hf_config_dict(TINY)
    assert config_from_hf_dict({**raw, "rope_theta": 10000}) == TINY
    with pytest.raises(CheckpointError, match="num_attention_heads"):
        config_from_hf_dict({**raw, "num_key_value_heads": 3})
    with pytest.raises(CheckpointError, match="hidden_size.*-64"):
        config_from_hf_dict({**raw, "hidden_size": -64})


# ----------------------------------------------------------------------------------------- file errors

@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_truncated_or_corrupt_safetensors(sharded_copy, damage):
    victim = sharded_copy / "model-00003-of-00010.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(CheckpointError, match=r"model-00003-of-00010\.safetensors.*truncated or corrupt"):
        load_checkpoint(sharded_copy)


def test_index_names_missing_file(sharded_copy):
    (sharded_copy / "model-00002-of-00010.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"names weight file 'model-00002-of-00010\.safetensors', which does not exist"):
        load_checkpoint(sharded_copy)
    with pytest.raises(CheckpointError, match="model-00002-of-00010"):
        checkpoint_sha256(sharded_copy)


def test_index_places_tensor_in_wrong_file(sharded_copy):
    index = json.loads((sharded_copy / INDEX_NAME).read_text())
    name = "model.layers.0.self_attn.q_proj.weight"  # shares its file with other tensors
    assert index["weight_map"][name] != "model-00010-of-00010.safetensors"
    index["weight_map"][name] = "model-00010-of-00010.safetensors"
    (sharded_copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"'{name}'.*places in 'model-00010-of-00010\.safetensors'"):
        load_checkpoint(sharded_copy)


def test_index_lists_tensor_no_file_holds(sharded_copy):
    index = json.loads((sharded_copy / INDEX_NAME).read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00010.safetensors"
    (sharded_copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.9\.mlp\.up_proj\.weight' in 'model-00001-of-00010\.safetensors', which does not hold it"):
        load_checkpoint(sharded_copy)


def test_missing_config_json(single_copy):
    (single_copy / CONFIG_NAME).unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_checkpoint(single_copy)


# ------------------------------------------------------------------------------------------- no pickle

def test_pickle_weights_refused(single_copy, tmp_path, monkeypatch):
    cfg, tensors = load_checkpoint(single_copy)
    only_pickle = tmp_path / "pickled"
    only_pickle.mkdir()
    shutil.copy(single_copy / CONFIG_NAME, only_pickle / CONFIG_NAME)
    torch.save(tensors, only_pickle / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(only_pickle)
    with pytest.raises(CheckpointError, match="refusing a pickle-based weight file"):
        load_checkpoint(only_pickle / "pytorch_model.bin")

    # A stray pickle beside valid safetensors is never opened.
    shutil.copy(only_pickle / "pytorch_model.bin", single_copy / "pytorch_model.bin")

    def forbidden(*args, **kwargs):
        raise AssertionError("the loader must never unpickle")
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    cfg2, tensors2 = load_checkpoint(single_copy)
    assert cfg2 == cfg and all(torch.equal(tensors[n], tensors2[n]) for n in tensors)


def test_index_naming_pickle_file_refused(sharded_copy):
    index = json.loads((sharded_copy / INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = "pytorch_model-00001-of-00001.bin"
    (sharded_copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' maps to 'pytorch_model-00001-of-00001\.bin'"):
        load_checkpoint(sharded_copy)


def test_index_file_outside_directory_refused(sharded_copy):
    index = json.loads((sharded_copy / INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    (sharded_copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        load_checkpoint(sharded_copy)


# ------------------------------------------------------------------------------------ writer arguments

def test_writer_argument_errors(single, tmp_path):
    with pytest.raises(ValueError, match="refusing to overwrite"):
        write_synthetic_checkpoint(single, "tiny")
    with pytest.raises(ValueError, match="'ouro-7b'"):
        write_synthetic_checkpoint(tmp_path / "a", "ouro-7b")
    with pytest.raises(ValueError, match="int8"):
        write_synthetic_checkpoint(tmp_path / "b", "tiny", dtype=torch.int8)
    with pytest.raises(ValueError, match="max_shard_bytes.*0"):
        write_synthetic_checkpoint(tmp_path / "c", "tiny", max_shard_bytes=0)


def test_ouro_1_4b_shape_on_meta_and_shard_plan():
    cfg = PRESETS["ouro-1.4b"]
    params = [torch.empty(shape, device="meta", dtype=torch.bfloat16) for shape in tensor_shapes(cfg).values()]
    assert sum(p.numel() for p in params) == parameter_count(cfg) == 1_434_652_673
    shards = plan_shards(cfg, torch.bfloat16, 1 << 30)
    assert [n for s in shards for n in s] == list(tensor_shapes(cfg))
    assert len(shards) == 3
    # the biggest tensor (embed_tokens, 201 MB) fits; every shard stays under the limit
    for s in shards:
        assert sum(2 * torch.Size(tensor_shapes(cfg)[n]).numel() for n in s) <= 1 << 30


# -------------------------------------------------------------------------------- init and exit gate

def test_init_scales(single):
    _, t = load_checkpoint(single, dtype=torch.float32)
    h = TINY.hidden_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, h, generator=g)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # normed states, RMS 1
    q = x @ t["model.layers.0.self_attn.q_proj.weight"].T
    assert 0.8 < q.std().item() < 1.25  # projections keep unit scale
    logits = x @ t["lm_head.weight"].T
    assert 1.5 < logits.std().item() < 2.5  # O(1..few)
    assert logits.argmax(-1).unique().numel() > TINY.vocab_size // 2  # greedy tokens vary
    norm = t["model.layers.1.post_attention_layernorm_2.weight"]
    assert (norm - 1).abs().max().item() < 0.1 and norm.std().item() > 0
    assert torch.allclose(t["model.early_exit_gate.weight"].norm(), torch.tensor(GATE_SIGMA), rtol=1e-2)
    assert t["model.early_exit_gate.bias"].item() == pytest.approx(gate_bias_for_mix(), abs=1e-2)


@pytest.mark.parametrize("target, sigma", [(0.75, GATE_SIGMA), (0.75, 1.0), (0.25, 0.5), (0.9, 2.0)])
def test_gate_bias_gives_the_mix_under_its_assumption(target, sigma):
    """Monte Carlo of the stated model: z_1, z_2 iid N(b, sigma^2); depth 3 iff (1-h_1)(1-h_2) <= 0.5."""
    b = gate_bias_for_mix(target, sigma)
    assert three_loop_fraction(b, sigma) == pytest.approx(target, abs=1e-8)
    g = torch.Generator().manual_seed(1234)
    z = torch.randn(2, 1_000_000, generator=g, dtype=torch.float64) * sigma + b
    survival = torch.sigmoid(-z).prod(0)
    measured = (survival <= 0.5).double().mean().item()
    assert measured == pytest.approx(target, abs=0.003), (b, measured)


def test_gate_bias_default_value_and_monotone():
    assert gate_bias_for_mix() == pytest.approx(-0.6827, abs=1e-3)
    assert gate_bias_for_mix(0.5) < gate_bias_for_mix(0.75) < gate_bias_for_mix(0.9)
    with pytest.raises(ValueError, match="1.0"):
        gate_bias_for_mix(1.0)
    with pytest.raises(ValueError, match="sigma"):
        gate_bias_for_mix(0.75, 0.0)


def test_observed_mix_calibration_agrees_with_the_model_and_is_exact_on_its_sample(tmp_path):
    g = torch.Generator().manual_seed(7)
    u = torch.randn(2, 200_000, generator=g, dtype=torch.float64) * GATE_SIGMA
    b = gate_bias_for_observed_mix(u[0], u[1], 0.75)
    assert b == pytest.approx(gate_bias_for_mix(0.75, GATE_SIGMA), abs=0.01)  # iid normal: same answer
    correlated = torch.randn(3000, generator=g, dtype=torch.float64) * GATE_SIGMA
    b = gate_bias_for_observed_mix(correlated, correlated, 0.75)
    share = (torch.sigmoid(-(correlated + b)) ** 2 <= 0.5).double().mean().item()
    assert share == pytest.approx(0.75, abs=1 / 3000)
    ck = write_synthetic_checkpoint(tmp_path / "calibrated", "tiny", gate_bias=b)
    _, t = load_checkpoint(ck, dtype=torch.float64)
    assert t["model.early_exit_gate.bias"].item() == pytest.approx(b, abs=1e-2)  # bf16 rounding
    with pytest.raises(ValueError, match="equal-length"):
        gate_bias_for_observed_mix(u[0], u[1, :10])


# ------------------------------------------------------------------------ mixed stored dtypes (issue 8)
