"""Comparing values as data: hashes, plain Python out of parquet and numpy, equality to a tolerance, and
the differences between two JSON documents or two texts, each named by where it sits."""
from __future__ import annotations

import difflib
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .contract import ABSENT

REL_TOL = 1e-9


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def canonical(data: Any) -> bytes:
    """The JSON spelling hashes are taken over: sorted keys, compact, UTF-8."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def prompt_sha256(ids: list[int]) -> str:
    """The schedule format's prompt hash: sha256 of the JSON list of ints in json.dumps' default spelling."""
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()


def plain(value: Any) -> Any:
    """A parquet or JSON value as plain Python: numpy scalars and arrays unwrapped, NaN and NA as None."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def same(got: Any, want: Any) -> bool:
    """Equal as data: ints exactly, floats to REL_TOL, bools only to bools, lists and dicts item by item."""
    got, want = plain(got), plain(want)
    if isinstance(got, bool) or isinstance(want, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        if isinstance(got, int) and isinstance(want, int):
            return got == want
        return math.isclose(got, want, rel_tol=REL_TOL, abs_tol=0.0)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return set(got) == set(want) and all(same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def field_diffs(got: Any, want: Any, path: str) -> list[tuple[str, Any, Any]]:
    """(path, got, want) for every leaf where two JSON documents differ; ABSENT marks a missing key."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in list(want) + [k for k in got if k not in want]:
            out += field_diffs(got.get(key, ABSENT), want.get(key, ABSENT), f"{path}.{key}" if path else str(key))
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in field_diffs(g, w, f"{path}[{i}]")]
    if got is ABSENT or want is ABSENT or not same(got, want):
        return [(path, got, want)]
    return []


def line_diffs(got: list[str], want: list[str]):
    """(index in ``got``, got line or None, wanted line or None) for each line that differs."""
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=got, b=want, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        for k in range(max(i2 - i1, j2 - j1)):
            g = got[i1 + k] if i1 + k < i2 else None
            w = want[j1 + k] if j1 + k < j2 else None
            yield (i1 + k if g is not None else min(i2, len(got) - 1)), g, w


def where(keys: tuple, values: tuple) -> str:
    """A table row's key in words: 'cpu0 seq 3 measured request r0001 position 2'."""
    labels = {"seq": "seq ", "pair": "pair ", "request_id": "request ", "position": "position "}
    return " ".join(f"{labels.get(k, '')}{plain(v)}" for k, v in zip(keys, values))
