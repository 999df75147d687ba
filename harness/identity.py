"""Which code ran: the git commit and dirty flag where they can be known, and a hash of the sources.

The plan records :func:`code_identity`; a resume must find the same, and the reference cache keys on
``code_sha256``, so that a change to the runtime or the harness never reuses a stale frozen schedule.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

from .executors import REPO_ROOT

GIT_SHA_ENV = "LOOPBENCH_GIT_SHA"
SOURCE_FOLDERS = ("runtime", "harness", "kernels")   # the project folders code_sha256 hashes (engines leaves them out)
CONTRACT = "loopbench/bundle_format.json"   # what the writer writes (format version, tables, wording) follows it
_HEX_SHA = re.compile(r"[0-9a-f]{7,64}")


def _git(root: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def own_git_repo(root: Path) -> bool:
    """Whether ``root`` is the top of its own git work tree (a clone or a ``git worktree``), symlinks resolved.

    A project tree copied into a folder of some other repository has no ``.git`` of its own; git would
    still answer from the enclosing repository, whose SHA and dirty flag say nothing about this tree.
    """
    top = _git(root, "rev-parse", "--show-toplevel")
    return top is not None and Path(top).resolve() == Path(root).resolve()


def _env_git_sha() -> str | None:
    """``LOOPBENCH_GIT_SHA`` lower-cased, or None when unset; ValueError when it is no hex SHA."""
    value = os.environ.get(GIT_SHA_ENV)
    if value is None:
        return None
    if not _HEX_SHA.fullmatch(value.strip().lower()):
        raise ValueError(f"{GIT_SHA_ENV} = {value!r} is not a git commit SHA (7 to 64 hex digits)")
    return value.strip().lower()


def hash_files(h, files) -> None:
    """Feed ``h`` (a hashlib object) each of ``files`` ((path, name) pairs, in the order given) as its name, a NUL,
    its size in bytes, a NUL and its bytes: the layout of ``code_sha256`` and of an external engine's sources
    (engines.source_sha256). Raises OSError (its ``filename`` set) for a file that cannot be read."""
    for path, name in files:
        data = Path(path).read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)


def code_identity(root: Path = REPO_ROOT) -> dict:
    """Which code ran: {git_sha, git_dirty, git_sha_source, code_sha256} (+ git_head_observed, git_dirty_observed).

    ``git_sha``/``git_dirty`` (tracked files) come from git only when ``root`` is its own repository's
    top level (:func:`own_git_repo`); otherwise from ``LOOPBENCH_GIT_SHA`` (a copied tree, e.g. on a lent
    GPU host: the caller names the commit it copied, and the dirty flag is unknowable, None), else both
    None ("unknown"). A ``LOOPBENCH_GIT_SHA`` that disagrees with the project's own HEAD wins too: a copy
    may carry a stale ``.git`` (seen on the lent GPU host, whose copy's HEAD was the session's first
    commit), and the operator's explicit statement outranks it; git's HEAD and dirty flag are then kept as
    ``git_head_observed``/``git_dirty_observed`` so nothing is hidden. ``code_sha256`` hashes the runtime
    sources (runtime, harness, kernels) and the bundle format contract their writer follows
    (loopbench/bundle_format.json), and is what ties the run to its source in every case. Raises ValueError
    when ``LOOPBENCH_GIT_SHA`` is set and no hex SHA.
    """
    root = Path(root)
    h = hashlib.sha256()
    sources = [p for folder in SOURCE_FOLDERS for p in sorted((root / folder).rglob("*.py"))]
    files = sources + [p for p in [root / CONTRACT] if p.is_file()]   # a copy of the sources alone has none
    hash_files(h, ((p, p.relative_to(root).as_posix()) for p in files))
    env_sha = _env_git_sha()
    sha = _git(root, "rev-parse", "HEAD") if own_git_repo(root) else None
    dirty = None
    if sha is not None:
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        dirty = bool(status) if status is not None else None
    if sha is not None and (env_sha is None or sha.startswith(env_sha)):
        return {"git_sha": sha, "git_dirty": dirty, "git_sha_source": "git", "code_sha256": h.hexdigest()}
    ident = {"git_sha": env_sha, "git_dirty": None, "git_sha_source": GIT_SHA_ENV if env_sha else None,
             "code_sha256": h.hexdigest()}
    if sha is not None:
        ident.update(git_head_observed=sha, git_dirty_observed=dirty)
    return ident
