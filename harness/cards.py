"""Card claims: a local run holds an exclusive lock on each GPU it measures on while its children run.

Hydra's default launcher (``basic``, the only one installed) runs a multirun's jobs one after another in
one process, and a job's controller returns only once every child it started has ended, so the jobs of
one multirun never share a card. A parallel launcher, or a second ``make bench`` on the same host, could:
the claim turns that into :class:`CardInUse`, naming the card and its holder, before the run writes
anything. The locks are ``flock`` s on files in :func:`lock_dir` (one folder per host), released however
the holding process ends. Only cards are claimed: CPU sessions share the host's cores by design, and a
simulated CPU device (``executor.cpu_devices``) is no card.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .fileio import try_lock

LOCK_DIR_ENV = "LOOPBENCH_LOCK_DIR"   # where the card locks live (default: <tmp>/loopbench-cards)


class CardInUse(RuntimeError):
    """Another process holds a card this run would measure on."""


def lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "loopbench-cards")


def _claim(device: dict) -> int:
    path = lock_dir() / f"gpu{device['gpu_index']}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(exist_ok=True)
    fd = try_lock(path)
    if fd is None:
        holder = path.read_text().strip() or "unknown"
        raise CardInUse(f"GPU {device['gpu_index']} ({device['label']}) is in use by another loopbench run "
                        f"({holder}): two sessions on one card would time each other; wait for it or pick "
                        "other cards with executor.gpus")
    path.write_text(f"pid {os.getpid()}\n")   # closing this other descriptor keeps the flock
    return fd


def claim(devices: list[dict]) -> list[int]:
    """Lock every local GPU of ``devices`` (``machine.planned_devices`` entries of kind cuda with a
    ``gpu_index``) exclusively; returns the descriptors for :func:`release`. :class:`CardInUse` naming the
    first card another process holds (those claimed before it are released). A Slurm job's GPU
    (``gpu_index`` None) is the scheduler's to share out."""
    fds: list[int] = []
    try:
        for d in devices:
            if d["kind"] == "cuda" and d["gpu_index"] is not None:
                fds.append(_claim(d))
    except CardInUse:
        release(fds)
        raise
    return fds


def release(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


@contextmanager
def claimed(devices: list[dict]) -> Iterator[None]:
    """:func:`claim` for the block."""
    fds = claim(devices)
    try:
        yield
    finally:
        release(fds)
