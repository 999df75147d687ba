"""HF-layout Ouro checkpoints: a strict loader and a content hash.

A checkpoint is a directory holding ``config.json`` and one or more ``.safetensors`` files, optionally
with ``model.safetensors.index.json`` (``weight_map``: tensor name -> file name) when sharded; this is
the layout of the official Ouro-1.4B upload (tensor names: ``model.tensor_shapes``). The loader checks
everything the runtime relies on and raises :class:`CheckpointError` (a ``ValueError``) naming the bad
key, tensor or file; it reads safetensors only and never unpickles anything (``.bin``/``.pt`` refused).
Releases may store a few tensors in another dtype (fp32 norms and exit gate in a bf16 checkpoint): with
a requested ``dtype`` the loader casts them, and ``stored_dtypes`` / ``dtype_record`` say what was stored
(the controller writes that record into the plan); without one, mixed dtypes are refused by name.

Seeded synthetic checkpoints in the same layout are test and benchmark fixtures: ``loopbench.harness.fixtures``.

This module knows nothing about the model's math or the engine: it moves named tensors and a config.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import SafetensorError, safe_open

from .model import OuroConfig, tensor_shapes

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
# Pickle-based weight formats: loading them can execute arbitrary code, so they are refused outright.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# safetensors header dtype -> torch dtype, for the floating dtypes the runtime accepts.
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
}
# HF ``torch_dtype`` strings <-> torch dtypes.
HF_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
}
DTYPE_HF_NAMES = {v: k for k, v in HF_DTYPE_NAMES.items()}


class CheckpointError(ValueError):
    """A checkpoint directory, config, index or tensor does not match what the runtime expects."""


# ----------------------------------------------------------------------------------------------- config

def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _is_token_id(v: Any) -> bool:
    return v is None or is_int(v) or (isinstance(v, list) and all(is_int(t) for t in v))


# HF config keys the runtime does not use. Each is accepted only with a value that cannot change the
# math this runtime implements (e.g. ``hidden_act`` must be silu; sliding windows and rope scaling off).
_HARMLESS_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "architectures": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of str"),
    "auto_map": (lambda v: isinstance(v, dict), "an object"),
    "model_type": (lambda v: v == "ouro", "'ouro'"),
    "torch_dtype": (lambda v: v is None or (isinstance(v, str) and v in HF_DTYPE_NAMES),
                    f"one of {sorted(HF_DTYPE_NAMES)} or null"),
    "dtype": (lambda v: v is None or (isinstance(v, str) and v in HF_DTYPE_NAMES),
              f"one of {sorted(HF_DTYPE_NAMES)} or null"),
    "bos_token_id": (_is_token_id, "an int, a list of int or null"),
    "eos_token_id": (_is_token_id, "an int, a list of int or null"),
    "pad_token_id": (_is_token_id, "an int, a list of int or null"),
    "hidden_act": (lambda v: v == "silu", "'silu'"),
    "attention_bias": (lambda v: v is False, "false"),
    "mlp_bias": (lambda v: v is False, "false"),
    "attention_dropout": (is_number, "a number (unused at inference)"),
    "initializer_range": (is_number, "a number"),
    "use_cache": (lambda v: isinstance(v, bool), "true or false"),
    "transformers_version": (lambda v: isinstance(v, str), "a string"),
    "_name_or_path": (lambda v: isinstance(v, str), "a string"),
    "rope_scaling": (lambda v: v is None, "null (no rope scaling)"),
    "use_sliding_window": (lambda v: v is False, "false"),
    "sliding_window": (lambda v: v is None or is_int(v), "an int or null (unused: use_sliding_window is false)"),
    "max_window_layers": (is_int, "an int (unused: use_sliding_window is false)"),
    "layer_types": (lambda v: isinstance(v, list) and all(t == "full_attention" for t in v),
                    "a list of 'full_attention'"),
}


def _field_kind(f) -> str:
    # ``from __future__ import annotations`` in model.py makes field types strings.
    return f.type if isinstance(f.type, str) else f.type.__name__


def config_from_hf_dict(raw: Any, *, source: str = CONFIG_NAME) -> OuroConfig:
    """Validate an HF ``config.json`` dict and return the :class:`OuroConfig` the runtime uses.

    Every ``OuroConfig`` field must be present with its JSON type (int; number; bool); keys outside
    ``OuroConfig`` must be known HF keys with a value that leaves the math unchanged. Raises
    :class:`CheckpointError` naming ``source``, the key and the value.
    """
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    values: dict[str, Any] = {}
    for f in fields(OuroConfig):
        if f.name not in raw:
            raise CheckpointError(f"{source}: missing config key {f.name!r}")
        v, kind = raw[f.name], _field_kind(f)
        if kind == "int" and not is_int(v):
            raise CheckpointError(f"{source}: config key {f.name!r} must be an integer, got {v!r}")
        if kind == "float":
            if not is_number(v):
                raise CheckpointError(f"{source}: config key {f.name!r} must be a finite number, got {v!r}")
            v = float(v)
        if kind == "bool" and not isinstance(v, bool):
            raise CheckpointError(f"{source}: config key {f.name!r} must be true or false, got {v!r}")
        values[f.name] = v
    known = set(values)
    for key in sorted(set(raw) - known):
        if key not in _HARMLESS_KEYS:
            raise CheckpointError(f"{source}: unknown config key {key!r} (value {raw[key]!r})")
        check, wanted = _HARMLESS_KEYS[key]
        if not check(raw[key]):
            raise CheckpointError(f"{source}: config key {key!r} must be {wanted}, got {raw[key]!r}")
    if "layer_types" in raw and len(raw["layer_types"]) != values["num_hidden_layers"]:
        raise CheckpointError(f"{source}: config key 'layer_types' has {len(raw['layer_types'])} entries, "
                              f"expected num_hidden_layers={values['num_hidden_layers']}")
    try:
        return OuroConfig(**values)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


# ------------------------------------------------------------------------------------------ file layout

def _checkpoint_dir(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file():
        if p.name.endswith(PICKLE_SUFFIXES):
            raise CheckpointError(f"{p}: refusing a pickle-based weight file; only safetensors are loaded")
        raise CheckpointError(f"{p}: expected a checkpoint directory (config.json + *.safetensors), got a file")
    if not p.is_dir():
        raise CheckpointError(f"{p}: checkpoint directory does not exist")
    return p


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read JSON: {e}") from None


def _weight_layout(ckpt: Path) -> tuple[list[Path], dict[str, str] | None]:
    """(safetensors files to read, sorted by name; the index's weight_map or None when unindexed)."""
    index_file = ckpt / INDEX_NAME
    if index_file.is_file():
        index = _read_json(index_file)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{index_file}: 'weight_map' must be an object of tensor name -> file name")
        for name, file in weight_map.items():
            if not file.endswith(".safetensors"):
                raise CheckpointError(f"{index_file}: tensor {name!r} maps to {file!r}; refusing a "
                                      "non-safetensors (possibly pickle-based) weight file")
            if Path(file).name != file:
                raise CheckpointError(f"{index_file}: tensor {name!r} maps to {file!r}, which is not a "
                                      "plain file name inside the checkpoint directory")
        files = sorted({ckpt / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index_file}: names weight file {f.name!r}, which does not exist in {ckpt}")
        return files, weight_map
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        pickled = sorted(f.name for f in ckpt.iterdir() if f.name.endswith(PICKLE_SUFFIXES + (".bin.index.json",)))
        if pickled:
            raise CheckpointError(f"{ckpt}: holds only pickle-based weights {pickled}; refusing to unpickle, "
                                  "convert them to safetensors")
        raise CheckpointError(f"{ckpt}: no *.safetensors weight files")
    return files, None


def checkpoint_files(path: str | Path) -> list[Path]:
    """The files whose bytes define a checkpoint: config.json, the index if any, the safetensors files."""
    ckpt = _checkpoint_dir(path)
    config = ckpt / CONFIG_NAME
    if not config.is_file():
        raise CheckpointError(f"{ckpt}: missing {CONFIG_NAME}")
    weights, weight_map = _weight_layout(ckpt)
    index = [ckpt / INDEX_NAME] if weight_map is not None else []
    return sorted([config, *index, *weights], key=lambda f: f.name)


def checkpoint_sha256(path: str | Path, *, chunk_bytes: int = 16 << 20) -> str:
    """Hex sha256 identifying a checkpoint's contents, for plan hashing.

    Covers ``checkpoint_files(path)`` in sorted-name order; each contributes its name, its size in bytes
    and its bytes (read in ``chunk_bytes`` chunks), so file boundaries are unambiguous. Independent of the
    directory's location; any byte change in the config, the index or a weight file changes the hash.
    """
    h = hashlib.sha256()
    for f in checkpoint_files(path):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with f.open("rb") as fh:
            while chunk := fh.read(chunk_bytes):
                h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- loading

def read_config(path: str | Path) -> OuroConfig:
    """The :class:`OuroConfig` of the checkpoint directory ``path`` without reading any weight. Raises
    :class:`CheckpointError` naming the directory, the file or the key."""
    return _read_config(_checkpoint_dir(path))[0]


def _read_config(ckpt: Path) -> tuple[OuroConfig, dict[str, Any]]:
    config_file = ckpt / CONFIG_NAME
    if not config_file.is_file():
        raise CheckpointError(f"{ckpt}: missing {CONFIG_NAME}")
    raw = _read_json(config_file)
    return config_from_hf_dict(raw, source=str(config_file)), raw


def _read_headers(ckpt: Path, expected: dict[str, tuple[int, ...]], files: list[Path],
                  weight_map: dict[str, str] | None) -> dict[str, torch.dtype]:
    """Stored dtype of every expected tensor (in ``expected`` order), from the safetensors headers only.

    Checks names (no duplicate, none unexpected, none missing, each in the file the index names), shapes
    and that every dtype is floating; whether the dtypes agree is left to the caller.
    """
    where: dict[str, Path] = {}
    stored: dict[str, torch.dtype] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as fh:
                for name in fh.keys():
                    if name in where:
                        raise CheckpointError(f"tensor {name!r} is stored twice: in {where[name].name} and {file.name}")
                    if weight_map is not None and name not in weight_map:
                        raise CheckpointError(f"{file}: holds tensor {name!r}, which {INDEX_NAME} does not list")
                    if weight_map is not None and weight_map[name] != file.name:
                        raise CheckpointError(f"{file}: holds tensor {name!r}, which {INDEX_NAME} "
                                              f"places in {weight_map[name]!r}")
                    where[name] = file
                    if name not in expected:
                        raise CheckpointError(f"{file.name}: unexpected tensor {name!r}")
                    sl = fh.get_slice(name)
                    shape, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
                    if shape != expected[name]:
                        raise CheckpointError(f"{file.name}: tensor {name!r} has shape {shape}, "
                                              f"expected {expected[name]}")
                    if st_dtype not in _SAFETENSORS_DTYPES:
                        raise CheckpointError(f"{file.name}: tensor {name!r} has dtype {st_dtype}, expected a "
                                              f"floating dtype in {sorted(_SAFETENSORS_DTYPES)}")
                    stored[name] = _SAFETENSORS_DTYPES[st_dtype]
        except SafetensorError as e:
            raise CheckpointError(f"{file}: truncated or corrupt safetensors file: {e}") from None
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in where:
                raise CheckpointError(f"{INDEX_NAME} places tensor {name!r} in {file!r}, which does not hold it")
    missing = [n for n in expected if n not in where]
    if missing:
        raise CheckpointError(f"{ckpt}: missing tensor {missing[0]!r} (expected shape {expected[missing[0]]})"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return {name: stored[name] for name in expected}


_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)")


def dtype_record(stored: Mapping[str, torch.dtype]) -> dict[str, list[str]]:
    """A compact, deterministic record of which tensors are stored in which dtype.

    ``stored``: tensor name -> torch floating dtype (e.g. ``stored_dtypes(path)``). Returns HF dtype name
    (``"bfloat16"``, ``"float32"``, ...) -> sorted tensor names, keys sorted. A per-layer tensor stored in
    one dtype in every layer that ``stored`` holds it for is written once as ``model.layers.*.<rest>``;
    otherwise each layer's name is listed (so pass the map of the whole checkpoint: ``*`` means every
    layer of what is passed). An Ouro-1.4B release with fp32 norms and gate gives 16 entries in all, not
    ~270. Raises ValueError naming a tensor whose dtype is not a floating dtype of the table.
    """
    layers_of: dict[str, set[int]] = {}       # per-layer suffix -> every layer that holds it
    per_dtype: dict[str, dict[str, set[int]]] = {}
    out: dict[str, set[str]] = {}
    for name, dt in stored.items():
        if dt not in DTYPE_HF_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dt} is not a floating dtype in {sorted(HF_DTYPE_NAMES)}")
        key = DTYPE_HF_NAMES[dt]
        out.setdefault(key, set())
        m = _LAYER_TENSOR.fullmatch(name)
        if m is None:
            out[key].add(name)
            continue
        layer, rest = int(m[1]), m[2]
        layers_of.setdefault(rest, set()).add(layer)
        per_dtype.setdefault(key, {}).setdefault(rest, set()).add(layer)
    for key, suffixes in per_dtype.items():
        for rest, layers in suffixes.items():
            if layers == layers_of[rest]:
                out[key].add(f"model.layers.*.{rest}")
            else:
                out[key].update(f"model.layers.{i}.{rest}" for i in layers)
    return {key: sorted(out[key]) for key in sorted(out)}


def stored_dtypes(path: str | Path) -> dict[str, torch.dtype]:
    """Tensor name -> stored dtype of a checkpoint, validated from its config and headers (no data read).

    Applies every rule of ``load_checkpoint`` (config, index, files, tensor names and shapes, floating
    dtypes) except that the dtypes may differ from each other and from the config's ``torch_dtype``:
    that is allowed whenever the caller loads with a ``dtype``. Names in ``tensor_shapes(cfg)`` order.
    Raises :class:`CheckpointError` like ``load_checkpoint``.
    """
    ckpt = _checkpoint_dir(path)
    cfg, _ = _read_config(ckpt)
    files, weight_map = _weight_layout(ckpt)
    return _read_headers(ckpt, tensor_shapes(cfg), files, weight_map)


def _check_one_dtype(ckpt: Path, stored: dict[str, torch.dtype], raw_config: dict[str, Any]) -> None:
    """Without a requested dtype every tensor must be stored in one dtype: the config's ``torch_dtype``
    when it names one, else the dtype most tensors have (ties: the first in ``tensor_shapes`` order)."""
    config_name = raw_config.get("torch_dtype") or raw_config.get("dtype")
    if config_name:
        want, why = HF_DTYPE_NAMES[config_name], "config torch_dtype"
    else:
        want, why = Counter(stored.values()).most_common(1)[0][0], "the dtype of most tensors"
    off = {name: dt for name, dt in stored.items() if dt != want}
    if len(off) == len(stored) and len(set(off.values())) == 1:
        raise CheckpointError(f"{ckpt}: every tensor is stored in {DTYPE_HF_NAMES[next(iter(off.values()))]}, "
                              f"but config torch_dtype says {config_name}. Pass a dtype to load_checkpoint "
                              "to cast every tensor to it")
    if off:
        # the record of every tensor, so that ``model.layers.*`` means every layer of the checkpoint
        listed = "; ".join(f"{key}: {', '.join(map(repr, names))}" for key, names in dtype_record(stored).items()
                           if key != DTYPE_HF_NAMES[want])
        raise CheckpointError(f"{ckpt}: {len(off)} of {len(stored)} tensors are not stored in "
                              f"{DTYPE_HF_NAMES[want]} ({why}): {listed}. Pass a dtype to load_checkpoint "
                              "to cast every tensor to it")


def load_checkpoint(path: str | Path, *, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> tuple[OuroConfig, dict[str, torch.Tensor]]:
    """Load and validate an HF-layout Ouro checkpoint directory.

    Args:
        path: directory with ``config.json`` and ``*.safetensors`` (plus ``model.safetensors.index.json``
            when sharded; then only the files it names are read).
        dtype: cast every tensor to this floating dtype after validation. With a dtype, the stored dtypes
            may be mixed (e.g. a bf16 release with fp32 norms and exit gate) and need not match the
            config's ``torch_dtype``; ``stored_dtypes`` / ``dtype_record`` say what was stored. None keeps
            the stored dtype, which must then be one dtype for every tensor (see Raises).
        device: where the tensors are materialised.

    Returns:
        ``(cfg, tensors)``; ``tensors`` maps every name of ``tensor_shapes(cfg)`` (in that order) to a
        tensor of that shape, all of one floating dtype (the stored one, or ``dtype``), on ``device``.
        Values are the stored values cast with ``Tensor.to(dtype)`` (round to nearest even).

    Raises:
        ValueError: ``dtype`` is not a floating dtype of the table.
        CheckpointError: naming the bad config key, index entry, file (missing, truncated, corrupt,
            pickle-based) or tensor (missing, unexpected, duplicated, wrong shape, non-floating dtype;
            and, when ``dtype`` is None, every tensor not stored in the config's ``torch_dtype`` - or
            in the majority dtype when the config names none - with its dtype).
    """
    if dtype is not None and dtype not in DTYPE_HF_NAMES:
        raise ValueError(f"dtype must be a floating dtype in {sorted(HF_DTYPE_NAMES)}, got {dtype}")
    ckpt = _checkpoint_dir(path)
    cfg, raw = _read_config(ckpt)
    expected = tensor_shapes(cfg)
    files, weight_map = _weight_layout(ckpt)

    # Pass 1: headers only (names, shapes, dtypes) -- cheap, and fails before any data is read.
    stored = _read_headers(ckpt, expected, files, weight_map)
    if dtype is None:
        _check_one_dtype(ckpt, stored, raw)

    # Pass 2: data, one file open at a time, each tensor cast as it arrives.
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device=str(device)) as fh:
                for name in fh.keys():
                    t = fh.get_tensor(name)
                    loaded[name] = t if dtype is None else t.to(dtype)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: truncated or corrupt safetensors file: {e}") from None
    return cfg, {name: loaded[name] for name in expected}
