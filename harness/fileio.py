"""Small file helpers every harness process shares: atomic writes, the canonical JSON, sha256s, locks, and the
bundle format contract read once.

Atomic means: a temporary dot-named ``*.tmp`` file in the same folder, fsync, rename; a crash leaves
either the old file or the new one, and at worst that temporary file (``evidence.remove_stale_temp_files``
sweeps it). This module imports only the standard library, so the session child can write its records
without loading the bundle writer (pandas, pyarrow) that :mod:`evidence` needs.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def canonical_json(data: Any) -> str:
    """The one JSON spelling that hashes are taken over: sorted keys, compact, UTF-8."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, sort_keys=True, indent=1, allow_nan=False) + "\n")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def try_lock(path: Path, *, shared: bool = False, wait_s: float = 0.0) -> int | None:
    """An advisory ``flock`` on the file or folder ``path``, held until the returned descriptor is closed
    or the process ends (however it ends); None when another process holds a conflicting lock for more
    than ``wait_s`` seconds. The controller holds its bundle folder exclusively, each child ``jobs/``
    shared, so ``finish`` and a resume can tell that nothing of the bundle still runs."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.1)


@functools.cache
def bundle_format() -> dict:
    """The bundle format contract, ``loopbench/bundle_format.json`` (shared with the auditor, STYLE rule 10), read
    once per process; every module of the harness reads its part of this one dict, which nobody changes."""
    from importlib import resources

    return json.loads(resources.files("loopbench").joinpath("bundle_format.json").read_text())
