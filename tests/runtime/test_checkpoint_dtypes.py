"""Checkpoints stored in mixed dtypes (fp32 norms and gate beside bf16 weights): cast on request,
recorded by name, refused without a requested dtype (runtime/checkpoint.py)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from loopbench.harness.fixtures import hf_config_dict, write_synthetic_checkpoint
from loopbench.runtime.checkpoint import (CONFIG_NAME, INDEX_NAME, CheckpointError, checkpoint_sha256, dtype_record,
                                          load_checkpoint, stored_dtypes)
from loopbench.runtime.model import PRESETS, tensor_shapes

from . import test_checkpoint

TINY = PRESETS["tiny"]


# What a bf16 release with fp32 norms and exit gate stores, written out independently of the code.
MIXED_RECORD = {
    "bfloat16": ["lm_head.weight", "model.embed_tokens.weight", "model.layers.*.mlp.down_proj.weight",
                 "model.layers.*.mlp.gate_proj.weight", "model.layers.*.mlp.up_proj.weight",
                 "model.layers.*.self_attn.k_proj.weight", "model.layers.*.self_attn.o_proj.weight",
                 "model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.v_proj.weight"],
    "float32": ["model.early_exit_gate.bias", "model.early_exit_gate.weight",
                "model.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm_2.weight",
                "model.layers.*.post_attention_layernorm.weight", "model.layers.*.post_attention_layernorm_2.weight",
                "model.norm.weight"],
}


def _kept_in_fp32(name):
    return "norm" in name.split(".")[-2] or name.startswith("model.early_exit_gate.")


def _write_tensors(out, tensors, *, sharded):
    """tensors as one model.safetensors, or as three shards (each mixing dtypes) plus the index."""
    out.mkdir()
    (out / CONFIG_NAME).write_text(json.dumps(hf_config_dict(TINY, torch.bfloat16)))
    if not sharded:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out
    names, weight_map = list(tensors), {}
    for k in range(3):
        file = f"model-{k + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in names[k::3]}, out / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in names[k::3]})
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.fixture(scope="module")
def mixed_stored(tmp_path_factory):
    """name -> tensor as a mixed release stores it: fp32 norms and gate (values off the bf16 grid), bf16 rest."""
    src = write_synthetic_checkpoint(tmp_path_factory.mktemp("ck") / "fp32", "tiny", seed=0, dtype=torch.float32)
    _, fp32 = load_checkpoint(src)
    return {n: t if _kept_in_fp32(n) else t.to(torch.bfloat16) for n, t in fp32.items()}


@pytest.fixture(scope="module", params=["single", "sharded"])
def mixed(request, mixed_stored, tmp_path_factory):
    return _write_tensors(tmp_path_factory.mktemp("ck") / "mixed", mixed_stored, sharded=request.param == "sharded")


@pytest.fixture
def mixed_copy(mixed, tmp_path):
    return shutil.copytree(mixed, tmp_path / "copy")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_mixed_dtypes_are_cast_to_the_requested_dtype_and_recorded(mixed, mixed_stored, dtype):
    cfg, tensors = load_checkpoint(mixed, dtype=dtype)
    assert cfg == TINY and list(tensors) == list(tensor_shapes(TINY))
    for name, stored in mixed_stored.items():
        assert tensors[name].dtype == dtype and torch.equal(tensors[name], stored.to(dtype)), name
    if dtype == torch.bfloat16:  # the fp32 norms really were rounded, not passed through
        norm = mixed_stored["model.norm.weight"]
        assert not torch.equal(tensors["model.norm.weight"].float(), norm)
    assert stored_dtypes(mixed) == {n: t.dtype for n, t in mixed_stored.items()}
    assert dtype_record(stored_dtypes(mixed)) == MIXED_RECORD


def test_mixed_dtypes_refused_without_a_dtype_naming_tensors_and_dtypes(mixed_copy):
    listed = ", ".join(repr(n) for n in MIXED_RECORD["float32"])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(mixed_copy)
    assert f"11 of 27 tensors are not stored in bfloat16 (config torch_dtype): float32: {listed}. Pass a dtype" \
        in str(err.value)
    test_checkpoint.edit_config(mixed_copy, lambda raw: raw.pop("torch_dtype"))
    with pytest.raises(CheckpointError, match=r"not stored in bfloat16 \(the dtype of most tensors\): float32: "
                                              r"'model\.early_exit_gate\.bias'"):
        load_checkpoint(mixed_copy)


def test_dtype_record_names_each_layer_when_layers_differ():
    names = ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    stored = dict.fromkeys(names, torch.bfloat16) | {"model.layers.1.input_layernorm.weight": torch.float32}
    assert dtype_record(stored) == {
        "bfloat16": ["model.layers.*.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"],
        "float32": ["model.layers.1.input_layernorm.weight"]}
    assert list(dtype_record(dict(reversed(stored.items())))) == ["bfloat16", "float32"]  # order-free
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*torch\.int32"):
        dtype_record({"model.norm.weight": torch.int32})


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(2)}), r"unexpected tensor 'model\.layers\.2"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(65)}), r"'model\.norm\.weight' has shape \(65,\), expected \(64,\)"),
])
def test_a_requested_dtype_does_not_excuse_bad_tensors(mixed_stored, tmp_path, damage, message):
    tensors = dict(mixed_stored)
    damage(tensors)
    for sharded in (False, True):
        ckpt = _write_tensors(tmp_path / f"damaged-{sharded}", tensors, sharded=sharded)
        for check in (lambda: load_checkpoint(ckpt, dtype=torch.bfloat16), lambda: stored_dtypes(ckpt)):
            with pytest.raises(CheckpointError, match=message):
                check()


def test_a_requested_dtype_does_not_excuse_pickle_files(mixed_stored, tmp_path):
    only_pickle = tmp_path / "pickled"
    only_pickle.mkdir()
    (only_pickle / CONFIG_NAME).write_text(json.dumps(hf_config_dict(TINY, torch.bfloat16)))
    torch.save(mixed_stored, only_pickle / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(only_pickle, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match="refusing a pickle-based weight file"):
        load_checkpoint(only_pickle / "pytorch_model.bin", dtype=torch.bfloat16)


def test_sha256_hashes_the_stored_bytes_not_the_cast_tensors(mixed, mixed_stored, tmp_path):
    import hashlib

    # the documented recipe, over the files as stored: name, size, bytes, in sorted-name order
    h = hashlib.sha256()
    for f in sorted((p for p in mixed.iterdir()), key=lambda p: p.name):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode() + f.read_bytes())
    before = checkpoint_sha256(mixed)
    assert before == h.hexdigest()
    _, cast = load_checkpoint(mixed, dtype=torch.bfloat16)
    assert checkpoint_sha256(mixed) == before  # loading (and casting) leaves the files alone
    # a checkpoint that stores the cast tensors loads to the same values but is another checkpoint
    uniform = _write_tensors(tmp_path / "uniform", cast, sharded=(mixed / INDEX_NAME).exists())
    _, again = load_checkpoint(uniform, dtype=torch.bfloat16)
    assert all(torch.equal(again[n], cast[n]) for n in cast)
    assert checkpoint_sha256(uniform) != before


def test_controller_records_stored_dtypes_in_the_plan_checkpoint_entry(mixed, tmp_path):
    from loopbench.harness import conf, controller

    plain = conf.validate(conf.compose("cpu-smoke", [f"model.checkpoint={mixed}", f"cache_dir={tmp_path}"]))
    entry = controller.prepare_checkpoint(plain, tmp_path)
    assert entry["stored_dtypes"] == MIXED_RECORD
    assert entry["sha256"] == checkpoint_sha256(mixed) and entry["source"] == "path"
    json.dumps(entry)  # lands in plan.json as it is
