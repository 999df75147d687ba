"""HF-layout Ouro checkpoints: a strict loader, a content hash, and seeded synthetic checkpoints.

A checkpoint is a directory holding ``config.json`` and one or more ``.safetensors`` files, optionally
with ``model.safetensors.index.json`` (``weight_map``: tensor name -> file name) when sharded; this is
the layout of the official Ouro-1.4B upload (tensor names: ``model.tensor_shapes``). The loader checks
everything the runtime relies on and raises :class:`CheckpointError` (a ``ValueError``) naming the bad
key, tensor or file; it reads safetensors only and never unpickles anything (``.bin``/``.pt`` refused).
Releases may store a few tensors in another dtype (fp32 norms and exit gate in a bf16 checkpoint): with
a requested ``dtype`` the loader casts them, and ``stored_dtypes`` / ``dtype_record`` say what was stored
(the controller writes that record into the plan); without one, mixed dtypes are refused by name.

Synthetic checkpoints stand in for real weights wherever none are present (BRIEF section 4): they have
the exact HF layout, are a pure function of (config, seed, dtype), and are initialised so that a
forward pass stays O(1) and the exit gate gives a chosen three-/four-loop mix (``gate_bias_for_mix``).

This module knows nothing about the model's math or the engine: it moves named tensors and a config.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from loopbench.harness.model import PRESETS, OuroConfig, tensor_shapes

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
# Pickle-based weight formats: loading them can execute arbitrary code, so they are refused outright.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# Synthetic-checkpoint defaults (see ``write_synthetic_checkpoint``).
GATE_SIGMA = 0.5              # std of the gate logit w.x over tokens, x = normed state (RMS ~ 1)
THREE_LOOP_FRACTION = 0.75    # target share of 3-loop tokens under ouro_delayed 0.5/min2/max4
NORM_NOISE_STD = 0.02         # norm weights = 1 + N(0, NORM_NOISE_STD^2)
LOGIT_STD = 2.0               # lm_head scaled so greedy logits are ~N(0, LOGIT_STD^2)

# safetensors header dtype -> torch dtype, for the floating dtypes the runtime accepts.
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
}
# HF ``torch_dtype`` strings <-> torch dtypes.
_HF_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
}
_DTYPE_HF_NAMES = {v: k for k, v in _HF_DTYPE_NAMES.items()}


class CheckpointError(ValueError):
    """A checkpoint directory, config, index or tensor does not match what the runtime expects."""


# ----------------------------------------------------------------------------------------------- config

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _is_token_id(v: Any) -> bool:
    return v is None or _is_int(v) or (isinstance(v, list) and all(_is_int(t) for t in v))


# HF config keys the runtime does not use. Each is accepted only with a value that cannot change the
# math this runtime implements (e.g. ``hidden_act`` must be silu; sliding windows and rope scaling off).
_HARMLESS_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "architectures": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of str"),
    "auto_map": (lambda v: isinstance(v, dict), "an object"),
    "model_type": (lambda v: v == "ouro", "'ouro'"),
    "torch_dtype": (lambda v: v is None or (isinstance(v, str) and v in _HF_DTYPE_NAMES),
                    f"one of {sorted(_HF_DTYPE_NAMES)} or null"),
    "dtype": (lambda v: v is None or (isinstance(v, str) and v in _HF_DTYPE_NAMES),
              f"one of {sorted(_HF_DTYPE_NAMES)} or null"),
    "bos_token_id": (_is_token_id, "an int, a list of int or null"),
    "eos_token_id": (_is_token_id, "an int, a list of int or null"),
    "pad_token_id": (_is_token_id, "an int, a list of int or null"),
    "hidden_act": (lambda v: v == "silu", "'silu'"),
    "attention_bias": (lambda v: v is False, "false"),
    "mlp_bias": (lambda v: v is False, "false"),
    "attention_dropout": (_is_number, "a number (unused at inference)"),
    "initializer_range": (_is_number, "a number"),
    "use_cache": (lambda v: isinstance(v, bool), "true or false"),
    "transformers_version": (lambda v: isinstance(v, str), "a string"),
    "_name_or_path": (lambda v: isinstance(v, str), "a string"),
    "rope_scaling": (lambda v: v is None, "null (no rope scaling)"),
    "use_sliding_window": (lambda v: v is False, "false"),
    "sliding_window": (lambda v: v is None or _is_int(v), "an int or null (unused: use_sliding_window is false)"),
    "max_window_layers": (_is_int, "an int (unused: use_sliding_window is false)"),
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
        if kind == "int" and not _is_int(v):
            raise CheckpointError(f"{source}: config key {f.name!r} must be an integer, got {v!r}")
        if kind == "float":
            if not _is_number(v):
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


def hf_config_dict(cfg: OuroConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The ``config.json`` contents for ``cfg`` in the official Ouro layout (``torch_dtype`` = ``dtype``)."""
    if dtype not in _DTYPE_HF_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_HF_DTYPE_NAMES)}, got {dtype}")
    return {
        **cfg.to_dict(),
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "torch_dtype": _DTYPE_HF_NAMES[dtype],
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_hidden_layers,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
    }


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
        if dt not in _DTYPE_HF_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dt} is not a floating dtype in {sorted(_HF_DTYPE_NAMES)}")
        key = _DTYPE_HF_NAMES[dt]
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
        want, why = _HF_DTYPE_NAMES[config_name], "config torch_dtype"
    else:
        want, why = Counter(stored.values()).most_common(1)[0][0], "the dtype of most tensors"
    off = {name: dt for name, dt in stored.items() if dt != want}
    if len(off) == len(stored) and len(set(off.values())) == 1:
        raise CheckpointError(f"{ckpt}: every tensor is stored in {_DTYPE_HF_NAMES[next(iter(off.values()))]}, "
                              f"but config torch_dtype says {config_name}. Pass a dtype to load_checkpoint "
                              "to cast every tensor to it")
    if off:
        # the record of every tensor, so that ``model.layers.*`` means every layer of the checkpoint
        listed = "; ".join(f"{key}: {', '.join(map(repr, names))}" for key, names in dtype_record(stored).items()
                           if key != _DTYPE_HF_NAMES[want])
        raise CheckpointError(f"{ckpt}: {len(off)} of {len(stored)} tensors are not stored in "
                              f"{_DTYPE_HF_NAMES[want]} ({why}): {listed}. Pass a dtype to load_checkpoint "
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
    if dtype is not None and dtype not in _DTYPE_HF_NAMES:
        raise ValueError(f"dtype must be a floating dtype in {sorted(_HF_DTYPE_NAMES)}, got {dtype}")
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


# ----------------------------------------------------------------------------------- exit-gate calibration

def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def three_loop_fraction(bias: float, sigma: float = GATE_SIGMA, *, exit_threshold: float = 0.5,
                        grid_points: int = 1201) -> float:
    """P[exit depth 3] under ouro_delayed (threshold ``exit_threshold``, min 2, max 4) for gate logits
    z_1, z_2 iid N(bias, sigma^2): ``P[(1 - sigmoid(z_1)) (1 - sigmoid(z_2)) <= 1 - exit_threshold]``.

    Derivation in ``gate_bias_for_mix``; evaluated as a 1-D integral over z_1 (trapezoid on
    bias +- 12 sigma, ``grid_points`` nodes; converged to ~1e-12 already at 201 nodes).
    """
    if not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"sigma must be a positive finite number, got {sigma!r}")
    if not 0.0 < exit_threshold < 1.0:
        raise ValueError(f"exit_threshold must be in (0, 1), got {exit_threshold!r}")
    q = 1.0 - exit_threshold
    lo, hi = bias - 12.0 * sigma, bias + 12.0 * sigma
    step = (hi - lo) / (grid_points - 1)
    total = 0.0
    for k in range(grid_points):
        z1 = lo + k * step
        s1 = 1.0 / (1.0 + math.exp(z1)) if z1 < 700 else 0.0   # 1 - h_1 = sigmoid(-z_1)
        if s1 <= q:
            p2 = 1.0                                             # triggers whatever h_2 is
        else:
            c = math.log((s1 - q) / q)                           # need z_2 >= c
            p2 = _normal_cdf((bias - c) / sigma)
        weight = 0.5 if k in (0, grid_points - 1) else 1.0
        total += weight * p2 * math.exp(-0.5 * ((z1 - bias) / sigma) ** 2)
    return total * step / (sigma * math.sqrt(2.0 * math.pi))


@functools.lru_cache(maxsize=64)
def gate_bias_for_mix(target_three_loop_fraction: float = THREE_LOOP_FRACTION, sigma: float = GATE_SIGMA,
                      *, exit_threshold: float = 0.5) -> float:
    """Exit-gate bias b giving a target share of 3-loop tokens under ``ouro_delayed`` 0.5 / min 2 / max 4.

    Rule (BRIEF section 1): hazard h_r = sigmoid(w . x_r + b) after loop r, survival
    S_r = prod_{i<=r} (1 - h_i). With min_loops 2 the first possible trigger is r = 2; it fires iff
    1 - S_2 >= threshold, and ouro_delayed then exits one loop later, at depth 3. Otherwise any later
    trigger (r = 3) or the cap (r = 4 = max_loops) exits at depth 4. Hence
    ``P[depth 3] = P[(1 - h_1)(1 - h_2) <= 1 - threshold]``; every token runs 3 or 4 loops.

    Model of the logits: x_r is the final-normed state (RMS ~ 1, so |x_r| ~ sqrt(hidden)) and the
    synthetic gate weight has norm exactly ``sigma`` (w = sigma u / |u|, u ~ N(0, I)), so over tokens
    z_r = w . x_r + b ~ N(b, sigma^2); z_1 and z_2 are *assumed independent* (loops decorrelate the
    state; the true correlation is for the runtime to measure, then re-target with this function).

    Solving: condition on z_1 and put s_1 = 1 - h_1 = sigmoid(-z_1), q = 1 - threshold. If s_1 <= q the
    test passes for any z_2. Otherwise it needs sigmoid(-z_2) <= q / s_1, i.e.
    z_2 >= c(z_1) = log((s_1 - q) / q), with probability Phi((b - c) / sigma). So
    ``P3(b) = E_{z_1 ~ N(b, sigma^2)}[Phi((b - c(z_1)) / sigma)]`` (``three_loop_fraction``), strictly
    increasing in b; b is found by bisection on [-40, 40] to 1e-10.

    With the defaults (sigma = 0.5, target 0.75, threshold 0.5): b ~= -0.6827 (``GATE_SIGMA``,
    ``THREE_LOOP_FRACTION``). For reference, fully correlated logits (z_1 = z_2) would need
    b = logit(1 - sqrt(q)) + sigma Phi^-1(target) ~= -0.54 instead.
    """
    if not 0.0 < target_three_loop_fraction < 1.0:
        raise ValueError(f"target_three_loop_fraction must be in (0, 1), got {target_three_loop_fraction!r}")
    lo, hi = -40.0, 40.0
    while hi - lo > 1e-10:
        mid = 0.5 * (lo + hi)
        if three_loop_fraction(mid, sigma, exit_threshold=exit_threshold) < target_three_loop_fraction:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def gate_bias_for_observed_mix(gate_dot_loop1: torch.Tensor, gate_dot_loop2: torch.Tensor,
                               target_three_loop_fraction: float = THREE_LOOP_FRACTION, *,
                               exit_threshold: float = 0.5) -> float:
    """Re-calibration from measured states: the bias b giving the target 3-loop share on these tokens.

    gate_dot_loop1, gate_dot_loop2: [N] float, ``w . x_r`` (the gate logit *without* its bias) of the
    same N tokens after loops 1 and 2. Drops the independence and N(0, sigma^2) assumptions of
    ``gate_bias_for_mix``: the share of tokens with ``(1 - sigmoid(u_1 + b))(1 - sigmoid(u_2 + b)) <=
    1 - exit_threshold`` is non-decreasing in b; bisection on [-40, 40] returns (to 1e-9) the smallest b
    whose share reaches the target (granularity 1/N).
    """
    u1, u2 = gate_dot_loop1.detach().double().flatten(), gate_dot_loop2.detach().double().flatten()
    if u1.shape != u2.shape or u1.numel() == 0:
        raise ValueError(f"need two equal-length non-empty logit vectors, got {tuple(u1.shape)} and {tuple(u2.shape)}")
    if not 0.0 < target_three_loop_fraction < 1.0:
        raise ValueError(f"target_three_loop_fraction must be in (0, 1), got {target_three_loop_fraction!r}")
    log_q = math.log(1.0 - exit_threshold)

    def share(b: float) -> float:
        log_survival = F.logsigmoid(-(u1 + b)) + F.logsigmoid(-(u2 + b))
        return (log_survival <= log_q).double().mean().item()

    lo, hi = -40.0, 40.0
    while hi - lo > 1e-9:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if share(mid) < target_three_loop_fraction else (lo, mid)
    return hi


# ------------------------------------------------------------------------------- synthetic checkpoints

def _tensor_seed(seed: int, name: str) -> int:
    # One generator per tensor, keyed by (seed, name): values do not depend on order or sharding.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _synthetic_tensor(name: str, shape: tuple[int, ...], seed: int, gate_bias: float,
                      gate_sigma: float) -> torch.Tensor:
    """One fp32 CPU tensor of the synthetic init (see ``write_synthetic_checkpoint``)."""
    g = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
    if name == "model.early_exit_gate.bias":
        return torch.full(shape, gate_bias, dtype=torch.float32)
    t = torch.randn(shape, generator=g, dtype=torch.float32)
    if "norm" in name.split(".")[-2]:   # input_/post_attention_layernorm(_2), model.norm
        return t.mul_(NORM_NOISE_STD).add_(1.0)
    if name == "model.embed_tokens.weight":
        return t
    if name == "model.early_exit_gate.weight":
        return t.mul_(gate_sigma / t.norm())
    if name == "lm_head.weight":
        return t.mul_(LOGIT_STD / math.sqrt(shape[1]))
    return t.mul_(1.0 / math.sqrt(shape[1]))   # projections: [out, in], std 1/sqrt(fan_in)


def plan_shards(cfg: OuroConfig, dtype: torch.dtype, max_shard_bytes: int | None) -> list[list[str]]:
    """Tensor names per output file, in ``tensor_shapes`` order, greedily packed to <= max_shard_bytes
    (a tensor larger than the limit gets a file of its own); one file when ``max_shard_bytes`` is None."""
    shapes = tensor_shapes(cfg)
    if max_shard_bytes is None:
        return [list(shapes)]
    if not _is_int(max_shard_bytes) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive integer or None, got {max_shard_bytes!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def write_synthetic_checkpoint(path: str | Path, preset_or_config: str | OuroConfig, *, seed: int = 0,
                               dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int | None = None,
                               three_loop_fraction_target: float = THREE_LOOP_FRACTION,
                               gate_sigma: float = GATE_SIGMA, gate_bias: float | None = None) -> Path:
    """Write a seeded synthetic Ouro checkpoint in the exact HF layout; returns the directory.

    Layout: ``config.json`` (``hf_config_dict``: the OuroConfig keys plus architectures
    ["OuroForCausalLM"], model_type "ouro", torch_dtype, ...), and either one ``model.safetensors`` or,
    with ``max_shard_bytes``, ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
    Every tensor of ``tensor_shapes(cfg)``, in ``dtype``.

    Determinism: tensor ``name`` is drawn from its own CPU ``torch.Generator`` seeded by
    sha256(f"{seed}:{name}"), in fp32, then cast; so the values depend only on (config, seed, dtype),
    not on sharding. Tensors are generated one at a time and each file is written as soon as its tensors
    exist, so peak extra memory is about one output file (the whole model when unsharded: ~2.9 GB for
    ouro-1.4b in bf16).

    Init (keeps a forward pass O(1); the sandwich norms renormalise every sublayer output anyway):
      * projections [out, in] ~ N(0, 1/in): unit-RMS inputs give unit-variance outputs;
      * every norm weight = 1 + N(0, NORM_NOISE_STD^2);
      * embed_tokens ~ N(0, 1);
      * lm_head ~ N(0, LOGIT_STD^2 / hidden): logits of a normed state ~ N(0, LOGIT_STD^2), so greedy
        tokens vary with the state;
      * early_exit_gate.weight = gate_sigma u / |u| (u ~ N(0, I)), bias = ``gate_bias_for_mix(
        three_loop_fraction_target, gate_sigma)``: ~3/4 three-loop tokens under ouro_delayed 0.5/2/4
        if the loop logits are independent (see ``gate_bias_for_mix``); ``gate_bias`` overrides it with a
        value calibrated on measured states (``gate_bias_for_observed_mix``).

    Raises ValueError for an unknown preset, a non-floating dtype, a bad shard size, or a ``path`` that
    exists and is not an empty directory.
    """
    if isinstance(preset_or_config, str):
        if preset_or_config not in PRESETS:
            raise ValueError(f"unknown preset {preset_or_config!r}; known: {sorted(PRESETS)}")
        cfg = PRESETS[preset_or_config]
    elif isinstance(preset_or_config, OuroConfig):
        cfg = preset_or_config
    else:
        raise TypeError(f"preset_or_config must be a preset name or an OuroConfig, got {preset_or_config!r}")
    if dtype not in _DTYPE_HF_NAMES:
        raise ValueError(f"dtype must be a floating dtype in {sorted(_HF_DTYPE_NAMES)}, got {dtype}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory; refusing to overwrite")
    shards = plan_shards(cfg, dtype, max_shard_bytes)
    if gate_bias is None:
        gate_bias = gate_bias_for_mix(three_loop_fraction_target, gate_sigma)
    elif not _is_number(gate_bias):
        raise ValueError(f"gate_bias must be a finite number or None, got {gate_bias!r}")
    shapes = tensor_shapes(cfg)
    out.mkdir(parents=True, exist_ok=True)

    # One metadata key only: safetensors keeps metadata in a hash map, so with several keys the header
    # order (and the file bytes) would vary from run to run.
    metadata = {"format": "pt"}
    n = len(shards)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for k, names in enumerate(shards, start=1):
        file_name = SINGLE_FILE_NAME if n == 1 and max_shard_bytes is None else f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for name in names:
            tensors[name] = _synthetic_tensor(name, shapes[name], seed, gate_bias, gate_sigma).to(dtype)
            total_bytes += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = file_name
        save_file(tensors, out / file_name, metadata=metadata)
        del tensors
    if max_shard_bytes is not None:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # config.json last: an interrupted write leaves a directory the loader refuses ("missing config.json").
    (out / CONFIG_NAME).write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2, sort_keys=True) + "\n",
                                   encoding="utf-8")
    return out
