"""Which engine an arm runs: an import path ``"package.module:factory"`` resolved to its factory.

The session drives every engine only through the ``Engine`` protocol (runtime/api.py); an arm's
``engine`` key names the factory that builds one, ``factory(model, config: EngineConfig) -> Engine``.
Ours is the default (``loopbench.runtime.engine:LoopEngine``); the naive reference generator behind the
same protocol is ``loopbench.runtime.reference:make_engine``. :func:`check_engine` runs at config time,
so a bad path fails naming the arm and the value before anything is written or measured;
:func:`engine_settings` reads what an engine says it ran with.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import os
from pathlib import Path
from typing import Callable

from .identity import SOURCE_FOLDERS, hash_files


def load_factory(path: str) -> Callable:
    """The callable named by ``"package.module:attribute"``; ValueError saying what is wrong with it."""
    module_name, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path of the form 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:     # a module may fail on import in any way (SyntaxError, RuntimeError, ...)
        raise ValueError(f"{path!r}: module {module_name!r} cannot be imported "
                         f"({type(exc).__name__}: {exc})") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{path!r}: module {module_name!r} has no callable {attr!r}")
    try:
        inspect.signature(factory).bind(None, None)
    except TypeError as exc:
        raise ValueError(f"{path!r}: {attr!r} cannot be called as factory(model, config) ({exc})") from None
    except ValueError:           # no signature to inspect (some builtins): the session's call will tell
        pass
    return factory


def source_sha256(path: str) -> str | None:
    """sha256 of the Python sources an engine factory path comes from, where they are not ours: every ``*.py`` file of
    the top-level package of its module (relative path, size and bytes, in sorted order: identity.hash_files, as
    ``code_sha256`` hashes ours), or the module's own file for a top-level module. None for a factory in the folders that
    ``code_sha256`` covers (``loopbench.runtime``, ``.harness``, ``.kernels``; another folder of a source checkout,
    such as ``loopbench.tests``, is hashed like an external package) and for a module with no source file to read
    (a builtin or an extension module).

    A plan records it (``code.engine_sources``), so a resume of a bundle whose external engine changed is refused
    like any plan difference, and the frozen reference of an external reference-arm engine is not reused after
    its sources change. Raises ValueError for a path that names no factory (load_factory's) and for a source file
    that cannot be read."""
    load_factory(path)
    if _covered_by_code_sha256(path):
        return None
    parts = path.partition(":")[0].split(".")
    # the unit hashed: the top-level package; below ``loopbench``, whose folders are packages of their own, the folder
    unit = ".".join(parts[:2]) if parts[0] == "loopbench" else parts[0]
    spec = importlib.util.find_spec(unit)
    roots = list(spec.submodule_search_locations or []) if spec is not None and unit != "loopbench" else []
    if roots:
        files = sorted((p, Path(root)) for root in roots for p in _package_files(Path(root)))
    elif spec is not None and spec.origin and spec.origin.endswith(".py"):
        files = [(Path(spec.origin), Path(spec.origin).parent)]
    else:
        return None
    h = hashlib.sha256()
    try:
        hash_files(h, ((file, file.relative_to(root).as_posix()) for file, root in files))
    except OSError as exc:
        raise ValueError(f"{path!r}: cannot read {exc.filename}, one of its sources ({exc.strerror or exc}), to hash "
                         "them into the plan") from None
    return h.hexdigest()


def check_sources(recorded: dict[str, str | None]) -> None:
    """ValueError unless each engine of ``recorded`` (plan.json ``code.engine_sources``: path -> :func:`source_sha256`)
    has, as this process imports it, the sources the controller hashed when it planned the run. The plan's hash is
    taken once; every child imports the engine afresh (each session, the reference child, each online server), and
    one started after an edit to it, or importing another copy (another ``sys.path``, a SLURM node's environment),
    would measure a version the plan does not name, in a bundle that mixes two."""
    for path, want in recorded.items():
        now = source_sha256(path)
        if now != want:
            module = importlib.import_module(path.partition(":")[0])
            raise ValueError(f"engine {path!r}: its sources hash {str(now)[:12]} in this process (it imports "
                             f"{getattr(module, '__file__', None)}), not {str(want)[:12]} as the plan's "
                             "code.engine_sources records: it was edited after the run was planned, or this process "
                             "imports another copy of it. A bundle measures one version of an engine, so this child "
                             "measures nothing; restore that version to resume the bundle, or start a new run")


def _covered_by_code_sha256(path: str) -> bool:
    """Whether the factory path names a module of the folders that identity.code_identity hashes."""
    parts = path.partition(":")[0].split(".")
    return parts[0] == "loopbench" and len(parts) > 1 and parts[1] in SOURCE_FOLDERS


def _package_files(root: Path) -> list[Path]:
    """Every ``*.py`` regular file under ``root``, through symlinked folders as Python imports through them (each real
    folder once, so a symlink loop ends); an editor's lock file (Emacs' ``.#engine.py``) is a dangling symlink, no
    regular file, and is left out."""
    files, seen = [], set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        files += [p for p in (Path(folder, n) for n in names if n.endswith(".py")) if p.is_file()]
    return files


def engine_sources(arms: dict) -> dict[str, str | None]:
    """{engine path: :func:`source_sha256`} for the arms' engines (``arms``: name -> a mapping or an object with
    ``engine``) that ``code_sha256`` does not cover; {} when every arm runs ours."""
    paths = sorted({a["engine"] if isinstance(a, dict) else a.engine for a in arms.values()})
    return {p: source_sha256(p) for p in paths if not _covered_by_code_sha256(p)}


def check_engine(arm_name: str, path: str) -> None:
    """ValueError naming ``arms.<arm_name>.engine`` and its value when ``path`` names no factory."""
    try:
        load_factory(path)
    except ValueError as exc:
        raise ValueError(f"arms.{arm_name}.engine = {path!r} names no engine factory: {exc}") from None


def build_engine(path: str, model, config):
    """``factory(model, config)`` for the factory at ``path``; TypeError when the result is no ``Engine``."""
    from loopbench.runtime.api import Engine

    engine = load_factory(path)(model, config)
    if not isinstance(engine, Engine):
        raise TypeError(f"engine factory {path!r} returned {type(engine).__name__}, which does not satisfy the "
                        "Engine protocol (runtime/api.py)")
    return engine


def engine_settings(engine) -> dict | None:
    """What ``engine`` says it resolved and ran with (its optional ``settings()``, runtime/api.py ``Engine``),
    checked to be a flat dict of JSON scalars (str, int, float, bool or None) keyed by strings; None for an
    engine without ``settings``. A raw record's ``engine_settings`` (bundle format 9). TypeError naming the
    engine's class and the offending key for anything else, ValueError for a key or string value that would break
    report.md (a line break or a '|'), before the record is written."""
    settings = getattr(engine, "settings", None)
    if not callable(settings):
        return None
    got = settings()
    where = f"{type(engine).__name__}.settings()"
    if not isinstance(got, dict):
        raise TypeError(f"{where} returned {type(got).__name__}, not a dict of JSON scalars")
    for key, value in got.items():
        if not isinstance(key, str):
            raise TypeError(f"{where} has the key {key!r}, not a string")
        if not (value is None or type(value) in (str, int, bool)
                or (type(value) is float and math.isfinite(value))):
            raise TypeError(f"{where}[{key!r}] is {value!r}, not a JSON scalar (str, int, finite float, bool or None)")
        for text in (key, value) if isinstance(value, str) else (key,):
            if not _report_cell(text):
                raise ValueError(f"{where}[{key!r}]: {text!r} holds a line break or a '|', which report.md's "
                                 "Runtime settings table cannot show (bundle_format.json report.free_text)")
    return dict(got)


def _report_cell(text: str) -> bool:
    """Whether ``text`` fits one cell of a report.md table: one line (no line boundary of any kind) and no '|'."""
    return "|" not in text and text.splitlines() in ([text], [])
