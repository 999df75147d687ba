"""The configuration rules a type cannot express, checked on the composed config's plain data.

Hydra rejects a misspelt key or a wrong type at composition; these rules catch the rest (a comparison
naming an unknown arm, ``min_loops > max_loops``, an engine path that names no factory...) and raise a
``ValueError`` naming the key and the value. :func:`check` works on a private copy that ``conf.validate``
made; it fills each comparison's default name in that copy and changes nothing else.

A key the schema does not have is worded by :func:`unknown_key` alone, wherever it was written (an override,
a preset's YAML, a ``+key=`` append): its dotted path and the closest key ("did you mean exit.threshold?").
An override into a node that is null where it applies (``online.num_requests=3`` under ``online: null``) is
worded by :func:`null_node` alone, and a deletion of a key the schema needs (``~pairs``) by :func:`undeletable`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from pathlib import Path
from typing import Any

from .engines import check_engine
from .online import config as online_config


def positive_int(key: str, value: Any) -> None:
    """ValueError naming ``key`` unless ``value`` is an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")


def seed(key: str, value: Any) -> None:
    """A seed is a non-negative integer: numpy's default_rng (the bootstrap) takes no other, and the contract's
    SHA-256 rules (the order, the prompts, the online trace) spell one in decimal; fail here, not in a child or the
    summary."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer seed, got {value!r}")


def unknown_key(path: str, valid: typing.Iterable[str], bad: int = -1, where: str = "") -> ValueError:
    """The one message for a key the schema does not have, whichever part found it (an override, a preset's
    YAML, the composed config): ``path`` as the user wrote it (``arms.native.kv_layot``; a list item by its
    index, ``comparisons.0.candidat``, however it was written: see :func:`dotted`), ``bad`` the index of its
    unknown part, ``valid`` the keys of that level. It suggests the closest key (difflib), else lists the
    level's keys; schema class names never reach the user."""
    parts = path.split(".")
    bad %= len(parts)
    close = difflib.get_close_matches(parts[bad], sorted(valid), n=1)
    if close:
        hint = f"did you mean {'.'.join([*parts[:bad], close[0], *parts[bad + 1:]])}?"
    else:
        hint = f"{'.'.join(parts[:bad]) or 'the top level'} has {', '.join(sorted(valid))}"
    return ValueError(f"unknown config key {path}{where}; {hint}")


def dotted(path: str) -> str:
    """``path`` with each list index written as Hydra's override grammar takes it: ``comparisons[0].candidate``
    (as our value messages and Python write it) -> ``comparisons.0.candidate``."""
    return re.sub(r"\[(\d+)\]", r".\1", path)


def list_index(override: str, node: str, index: int, length: int) -> ValueError:
    """The one message for ``override`` naming item ``index`` of the list ``node``, which has ``length`` items where
    it applies: an override changes an item that is there, and a list grows only by being set whole."""
    have = f"items 0-{length - 1}" if length > 1 else ("item 0" if length else "no items")
    return ValueError(f"cannot apply {override}: {node} has {have}, not {index}; to add items, set it whole "
                      f"({node}=[...])")


def null_node(override: str, node: str, where: str, schema: Any, presets: typing.Sequence[str] = ()) -> ValueError:
    """The one message for ``override`` writing into ``node``, which is null ``where`` it applies ("in preset
    cpu-smoke"): OmegaConf fails there with an assertion that names nothing. ``schema`` is the node's type hint.
    A null list or dict takes a whole value (``executor.gpus=[0,1]``); a null section (a structured node,
    ``online``) takes none at all, neither its keys one by one nor ``online={...}`` (OmegaConf 2.3 cannot merge
    into it), so the message names the ``presets`` that set it."""
    hint = _node(schema)
    if dataclasses.is_dataclass(hint):
        named = f" (--config-name {' or '.join(presets)})" if presets else ""
        fix = (f"an override cannot fill a null section, not {node}={{...}} either; use a preset that sets {node}"
               f"{named} or one of your own in configs/")
    else:
        whole = "[...]" if typing.get_origin(hint) in (list, typing.List) else "{...}"
        fix = f"set it whole ({node}={whole})"
    return ValueError(f"cannot apply {override}: {node} is null {where}; {fix}")


def undeletable(override: str, path: str, parent: Any, hint: Any) -> ValueError:
    """The one message for ``~path`` (``override``) where the schema cannot lose ``path``: a key of a section
    (``~pairs``, ``~exit``; ``parent`` a structured-config dataclass), which a run cannot do without, or a list item
    (``~comparisons.2``), which Hydra cannot delete. ``hint`` is the type hint at ``path``. A dict entry (an arm,
    ``~arms.alias``) is no such key and may go."""
    if not dataclasses.is_dataclass(parent):
        return ValueError(f"cannot apply {override}: an override cannot delete a list item; set the list whole "
                          f"({path.rsplit('.', 1)[0]}=[...]) without it")
    if typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint):
        fix = f"set it to null ({path}=null) or to a value"
    elif dataclasses.is_dataclass(_node(hint)):
        fix = f"set its keys ({path}.<key>=...) instead"
    else:
        fix = f"set it ({path}=...) instead"
    return ValueError(f"cannot apply {override}: {path} is a key of the schema, which a run cannot do without; {fix}")


def schema_at(path: str, schema: Any) -> Any:
    """The type hint at dotted ``path`` below ``schema``, without ``Optional`` (``online`` -> OnlineConf,
    ``executor.gpus`` -> List[int], ``points.0`` -> PointConf); None where the path leaves the schema."""
    hint = _node(schema)
    for part in path.split("."):
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            hint = typing.get_type_hints(hint).get(part)
        elif origin in (dict, typing.Dict):
            hint = args[1]
        elif origin in (list, typing.List) and part.isdigit():
            hint = args[0]
        else:
            return None
        hint = _node(hint)
    return hint


def _node(hint: Any) -> Any:
    """``hint`` without ``Optional[...]`` (``online: Optional[OnlineConf]`` has OnlineConf's keys)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _children(data: Any, schema: Any) -> list[tuple[str, Any, Any]]:
    """(name, value, its schema) for each child of ``data`` that ``schema`` (a structured-config dataclass, or a type
    hint of one: ``Dict[str, ArmConf]``, ``List[PointConf]``, ``Optional[...]``) describes as a container: a
    dataclass's keys (schema None for a key it does not have), a dict's values, a list's items (named by index), in
    ``data``'s order; [] for anything else. The one walk of :func:`check_keys` and :func:`check_bools`."""
    schema = _node(schema)
    origin, args = typing.get_origin(schema), typing.get_args(schema)
    if dataclasses.is_dataclass(schema) and isinstance(data, dict):
        hints = typing.get_type_hints(schema)
        return [(str(key), value, hints.get(key)) for key, value in data.items()]
    if origin in (dict, typing.Dict) and isinstance(data, dict):
        return [(str(name), item, args[1]) for name, item in data.items()]
    if origin in (list, typing.List) and isinstance(data, list):
        return [(str(i), item, args[0]) for i, item in enumerate(data)]
    return []


def check_keys(data: Any, schema: Any, prefix: str = "", where: str = "") -> None:
    """ValueError (:func:`unknown_key`) for the first key of ``data`` that ``schema`` (a structured-config
    dataclass, or a type hint of one: ``Dict[str, ArmConf]``, ``List[PointConf]``, ``Optional[...]``) does
    not have. Checks what Hydra lets through (a ``+key=`` append lifts its struct flag) and locates what it
    refuses; ``prefix`` is the dotted path of ``data`` (list items by index, ``points.0.``), ``where`` says
    where it was written (`` in configs/cpu-smoke.yaml``)."""
    for name, value, hint in _children(data, schema):
        if hint is None:
            raise unknown_key(f"{prefix}{name}", typing.get_type_hints(_node(schema)), where=where)
        check_keys(value, hint, f"{prefix}{name}.", where)


def check_bools(data: Any, schema: Any, path: str = "", where: str = "") -> None:
    """ValueError naming the first switch (a ``bool`` key of ``schema``) in ``data`` whose value is not ``true`` or
    ``false``. OmegaConf takes any int (``warmup=2``, ``0``) and strings such as ``yes`` / ``off`` for a bool and turns
    them into one without a word, so a typo or a count written where a switch belongs ran silently with the switch
    on; this is checked on what the user wrote (an override's parsed value, a preset's YAML) before composition
    converts it. ``path`` is the dotted path of ``data`` (list items by index), ``where`` where it was written
    (`` in configs/cpu-smoke.yaml``); null (where the schema allows it, else OmegaConf refuses it) and an
    interpolation (``${...}``, resolved later) pass."""
    if _node(schema) is bool:
        if data is not None and not isinstance(data, bool) and not (isinstance(data, str) and "${" in data):
            raise ValueError(f"{path or 'the value'}{where} must be true or false, got {data!r}")
        return
    for name, value, hint in _children(data, schema):
        if hint is not None:   # a key the schema lacks is check_keys' to name
            check_bools(value, hint, f"{path}.{name}" if path else name, where)


def check_shapes(data: Any, schema: Any, path: str = "", where: str = "") -> None:
    """ValueError naming the first value of ``data`` that is not the container ``schema`` describes there: a mapping
    or a scalar where a list belongs (``points: {max_num_seqs: 3, num_requests: 5}``), a list or a scalar where a
    section or a map does (``exit: 5``). Hydra refuses these while it merges a preset, in words whose key is empty
    (``Cannot merge DictConfig with ListConfig full_key:``) and that name no file. ``path`` and ``where`` as for
    :func:`check_bools`; null and an interpolation pass (OmegaConf decides those)."""
    if data is None or (isinstance(data, str) and ("${" in data or data == "???")):   # ???: OmegaConf's MISSING
        return
    hint = _node(schema)
    origin = typing.get_origin(hint)
    if origin in (list, typing.List) and not isinstance(data, list):
        raise ValueError(f"{path or 'the value'}{where} must be a list, got {data!r}")
    if (dataclasses.is_dataclass(hint) or origin in (dict, typing.Dict)) and not isinstance(data, dict):
        raise ValueError(f"{path or 'the value'}{where} must be a mapping of keys, got {data!r}")
    for name, value, child in _children(data, schema):
        if child is not None:   # a key the schema lacks is check_keys' to name
            check_shapes(value, child, f"{path}.{name}" if path else name, where)


def check_key_path(path: str, value: Any, schema: type) -> None:
    """An override's dotted key (``exit.treshold``, ``points.0.max_num_seqs``) walked down ``schema``, then
    the keys of its ``value`` (``exit={treshold: 0.6}``); ValueError (:func:`unknown_key`) at the first
    part that is not a key. A path that goes on below a value (``pairs.x``) is a type error, left to Hydra."""
    hint, parts = schema, path.split(".")
    for i, part in enumerate(parts):
        hint = _node(hint)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            hints = typing.get_type_hints(hint)
            if part not in hints:
                raise unknown_key(path, hints, bad=i)
            hint = hints[part]
        elif origin in (dict, typing.Dict):
            hint = args[1]
        elif origin in (list, typing.List) and part.isdigit():
            hint = args[0]
        else:
            return
    check_keys(value, hint, f"{path}.")


def check(plain: dict) -> None:
    """Every rule, section by section; ValueError names the first offending key and its value."""
    if not plain["name"] or any(c in plain["name"] for c in "/\\ "):
        raise ValueError(f"name must be a non-empty token without '/', '\\' or spaces, got {plain['name']!r}")
    seed("model.seed", plain["model"]["seed"])
    seed("workload.prompt_seed", plain["workload"]["prompt_seed"])
    seed("order_seed", plain["order_seed"])
    seed("verdict.bootstrap_seed", plain["verdict"]["bootstrap_seed"])
    positive_int("workload.output_len", plain["workload"]["output_len"])
    check_prompt_lengths(plain["workload"])
    check_points(plain["points"], plain["workload"]["output_len"])
    check_point_workloads(plain["points"], plain["workload"])
    check_exit(plain["exit"])
    check_arms(plain["arms"])
    check_comparisons(plain)
    check_natural(plain)
    positive_int("pairs", plain["pairs"])
    positive_int("sessions", plain["sessions"])
    check_evidence(plain["evidence"])
    check_verdict(plain["verdict"])
    check_sample_size(plain)
    if not (math.isfinite(plain["telemetry"]["sample_hz"]) and plain["telemetry"]["sample_hz"] >= 10):
        raise ValueError(f"telemetry.sample_hz must be >= 10 (issue 12: at least 10 Hz), got {plain['telemetry']['sample_hz']!r}")
    check_executor(plain["executor"])
    if plain["resume"] is not None and not Path(plain["resume"]).expanduser().is_dir():
        raise ValueError(f"resume = {plain['resume']!r} is not a bundle directory")
    kill = plain["fault"]["kill_after_arms"]
    if kill is not None and (isinstance(kill, bool) or kill < 0):
        raise ValueError(f"fault.kill_after_arms must be >= 0 or null, got {kill!r}")
    online_config.check(plain)


def check_folder(key: str, raw: str, path: Path) -> None:
    """ValueError naming ``key`` (written ``raw``) when folder ``path`` cannot be had: it, or the nearest part of it
    that exists, is a file (``results_dir=notes.txt``, ``cache_dir=notes.txt/cache``). Checked before anything is
    written, where the first ``mkdir`` would otherwise fail with a traceback once a bundle folder exists. So is a
    folder that cannot be written: ``path``, or the nearest part of it that exists, without write permission."""
    for part in (path, *path.parents):
        if part.is_dir():
            if not os.access(part, os.W_OK | os.X_OK):
                where = "is a folder" if part == path else f"is below {part}, a folder"
                raise ValueError(f"{key} = {raw!r} {where} this user cannot write; name a folder you can write "
                                 "(it is made where missing)")
            return
        if part.exists():
            where = "is a file" if part == path else f"is below {part}, which is a file"
            raise ValueError(f"{key} = {raw!r} {where}, not a folder; name a folder (it is made where missing)")


def check_prompt_lengths(wl: dict) -> None:
    """Exactly one source of prompt lengths: ``prompts_file``, ``prompt_lens`` or ``prompt_len``."""
    if wl["prompts_file"] is not None:
        if wl["prompt_lens"] is not None:
            raise ValueError(f"workload.prompts_file={wl['prompts_file']!r} and workload.prompt_lens="
                             f"{wl['prompt_lens']} are both set; a file's prompts keep their own lengths, so set "
                             "workload.prompt_lens=null")
        path = Path(wl["prompts_file"]).expanduser()
        if not path.is_file():
            raise ValueError(f"workload.prompts_file {wl['prompts_file']!r} "
                             + ("is a folder, not a file" if path.is_dir() else "does not exist"))
        return
    if wl["prompt_lens"] is None:
        if wl["prompt_len"] is None:
            raise ValueError("workload.prompt_len is null: set workload.prompt_len, workload.prompt_lens or "
                             "workload.prompts_file")
        positive_int("workload.prompt_len", wl["prompt_len"])
        return
    if wl["prompt_len"] is not None:
        raise ValueError(f"workload.prompt_len={wl['prompt_len']} and workload.prompt_lens={wl['prompt_lens']} "
                         "are both set; set one and the other to null (e.g. workload.prompt_lens=null "
                         "for prompts of one length)")
    if not wl["prompt_lens"]:
        raise ValueError("workload.prompt_lens must list at least one length, got []")
    for i, n in enumerate(wl["prompt_lens"]):
        positive_int(f"workload.prompt_lens[{i}]", n)


def _point_label(pt: dict) -> str:
    """B/C and the P / D a point writes itself: ``B16/C32``, ``B3/C4/P9``."""
    own = "".join(f"/{n}{pt[k]}" for n, k in (("P", "prompt_len"), ("D", "output_len")) if pt.get(k) is not None)
    return f"B{pt['max_num_seqs']}/C{pt['num_requests']}{own}"


def check_points(points: list, output_len: int) -> None:
    """Each point's B and C positive, and no two points the same requests. A point's own output_len equal to
    the workload's (``output_len``) changes its key but not its work (its prompts are the workload's), so it
    counts as the point without it; its own prompt_len does not, since that draws a block of prompts of its own
    (harness/workloads.py)."""
    if not points:
        raise ValueError("points must list at least one (max_num_seqs, num_requests) point")
    seen: dict[tuple, int] = {}
    for i, pt in enumerate(points):
        positive_int(f"points[{i}].max_num_seqs", pt["max_num_seqs"])
        positive_int(f"points[{i}].num_requests", pt["num_requests"])
        d = pt.get("output_len")
        key = (pt["max_num_seqs"], pt["num_requests"], pt.get("prompt_len"), output_len if d is None else d)
        if key in seen:
            first = points[seen[key]]
            if _point_label(first) == _point_label(pt):
                raise ValueError(f"points[{i}] = {_point_label(pt)} is listed twice")
            raise ValueError(f"points[{i}] = {_point_label(pt)} runs the same requests as points[{seen[key]}] = "
                             f"{_point_label(first)} (workload.output_len is {output_len}); drop one of them")
        seen[key] = i


def check_point_workloads(points: list, wl: dict) -> None:
    """A point's own prompt_len / output_len (harness/workloads.py): positive; prompt_len draws seeded
    prompts, so it cannot go with a prompts_file."""
    for i, pt in enumerate(points):
        for key in ("prompt_len", "output_len"):
            if pt.get(key) is not None:
                positive_int(f"points[{i}].{key}", pt[key])
        if pt.get("prompt_len") is not None and wl["prompts_file"] is not None:
            raise ValueError(f"points[{i}].prompt_len={pt['prompt_len']} needs seeded prompts, but workload.prompts_file="
                             f"{wl['prompts_file']!r} is set; drop one of the two")


def check_exit(ex: dict) -> None:
    positive_int("exit.min_loops", ex["min_loops"])
    positive_int("exit.max_loops", ex["max_loops"])
    if ex["min_loops"] > ex["max_loops"]:
        raise ValueError(f"exit.min_loops={ex['min_loops']} exceeds exit.max_loops={ex['max_loops']}")
    if not (0.0 < ex["threshold"] <= 1.0):
        raise ValueError(f"exit.threshold must be in (0, 1], got {ex['threshold']!r}")


def plain_token(text) -> bool:
    """Whether ``text`` can name an arm or a comparison: a non-empty string without '/' or '\\' (a comparison's
    name is part of raw record file names) and without '|' or whitespace (line breaks among it), which would add
    cells or lines to report.md's tables (bundle_format.json report.free_text) and fail the audit after the run."""
    return isinstance(text, str) and bool(text) and not any(c in "/\\|" or c.isspace() for c in text)


def check_arms(arms: dict) -> None:
    if not arms:
        raise ValueError("arms must name at least one arm")
    for name, arm in arms.items():
        if not plain_token(name):
            raise ValueError(f"arms: {name!r} is not a plain token (an arm's name holds no '/', '\\', '|' or "
                             "whitespace)")
        for key in ("block_size", "tile_size", "graph_cache_size"):
            positive_int(f"arms.{name}.{key}", arm[key])
        if arm["prefix_tiles"] and arm["kv_layout"] != "alias":
            raise ValueError(f"arms.{name}.prefix_tiles needs kv_layout=alias, got {arm['kv_layout']!r}")
        check_engine(name, arm["engine"])


def check_comparisons(plain: dict) -> None:
    """Arms named exist; each comparison's name (default ``<baseline>_vs_<candidate>``) is unique."""
    if not plain["comparisons"]:
        raise ValueError("comparisons must list at least one (baseline, candidate) comparison")
    arms, names = plain["arms"], set()
    for i, comp in enumerate(plain["comparisons"]):
        for role in ("baseline", "candidate"):
            if comp[role] not in arms:
                raise ValueError(f"comparisons[{i}].{role} = {comp[role]!r} is not an arm; arms are {sorted(arms)}")
        comp["name"] = comp["name"] or f"{comp['baseline']}_vs_{comp['candidate']}"
        if comp["name"] in names or not plain_token(comp["name"]):
            raise ValueError(f"comparisons[{i}].name = {comp['name']!r} is repeated or not a plain token "
                             "(no '/', '\\', '|' or whitespace)")
        names.add(comp["name"])
    ref = plain["reference_arm"]
    if ref is not None and ref not in arms:
        raise ValueError(f"reference_arm = {ref!r} is not an arm; arms are {sorted(arms)}")


def check_natural(plain: dict) -> None:
    """The natural track's epsilons are > 0 and finite; its ``floor`` names a natural A/A comparison."""
    nat = plain.get("natural") or {}
    for key in ("gate_epsilon", "logit_epsilon"):
        if key in nat and not (math.isfinite(nat[key]) and nat[key] > 0):
            raise ValueError(f"natural.{key} must be > 0, got {nat[key]!r}")
    floors = [c["name"] for c in plain["comparisons"]
              if c.get("track") == "natural" and c["baseline"] == c["candidate"]]
    if nat.get("floor") is not None and nat["floor"] not in floors:
        raise ValueError(f"natural.floor = {nat['floor']!r} is not a natural A/A comparison; those are {floors}")


def check_verdict(vd: dict) -> None:
    if not (0.0 < vd["confidence"] < 1.0):
        raise ValueError(f"verdict.confidence must be in (0, 1), got {vd['confidence']!r}")
    if not (math.isfinite(vd["min_effect"]) and vd["min_effect"] >= 0):
        raise ValueError(f"verdict.min_effect must be >= 0, got {vd['min_effect']!r}")
    positive_int("verdict.n_resamples", vd["n_resamples"])
    positive_int("verdict.min_pairs", vd["min_pairs"])
    tol = vd["eager_fraction_tolerance"]
    if not (math.isfinite(tol) and 0.0 <= tol < 1.0):
        raise ValueError(f"verdict.eager_fraction_tolerance must be in [0, 1), got {tol!r}")


# The most pairs one comparison may have on one device (pairs x sessions), and the most values the bootstrap may hold
# at once (verdict.n_resamples x those pairs). Both bound what happens after everything is measured: the publisher
# computes per result (point, comparison, device) the exact signed-rank p of its log ratios, and the auditor again,
# whose cost grows about as n^3 (2 cores, scipy 1.17: 0.8 s at 1,000 pairs, 4 s at 2,000, 146 s at 5,000, so hours
# to days beyond), and the bootstrap draws every resample at once (8 bytes a value, twice). Past these a run measured
# for days and then could not publish its bundle. 1,000 pairs is also far past what a verdict needs: the detectable
# effect shrinks as 1 / sqrt(n), to about 0.2% at a 2% pair noise.
MAX_PAIRS_PER_COMPARISON = 1000
MAX_RESAMPLED_VALUES = 10**8


def check_sample_size(plain: dict) -> None:
    """ValueError naming ``pairs`` / ``sessions`` when one comparison would have more pairs per device than
    :data:`MAX_PAIRS_PER_COMPARISON`, and ``verdict.n_resamples`` when its bootstrap would hold more than
    :data:`MAX_RESAMPLED_VALUES` values."""
    pairs, sessions = plain["pairs"], plain["sessions"]
    n = pairs * sessions
    if n > MAX_PAIRS_PER_COMPARISON:
        raise ValueError(f"pairs x sessions = {pairs} x {sessions} = {n} pairs per comparison and device, more than "
                         f"the {MAX_PAIRS_PER_COMPARISON} whose statistics can be published (the exact signed-rank p "
                         "of every result, computed by the publisher and again by the auditor, takes minutes at "
                         "5,000 pairs and days at 100,000); lower pairs or sessions")
    resamples = plain["verdict"]["n_resamples"]
    if resamples * n > MAX_RESAMPLED_VALUES:
        raise ValueError(f"verdict.n_resamples = {resamples} resamples of {n} pairs per comparison hold "
                         f"{resamples * n:,} values at once, more than {MAX_RESAMPLED_VALUES:,} (the bootstrap's "
                         f"memory, {8 * MAX_RESAMPLED_VALUES / 1e9:.1f} GB, in the publisher and again in the "
                         f"auditor); at most {MAX_RESAMPLED_VALUES // n:,} resamples here")


def check_evidence(ev: dict) -> None:
    """Levels in (0, 1); a noise SD > 0; a noise bundle that exists (its A/A ratios are read by plan.py)."""
    for key in ("alpha", "power"):
        if not 0.0 < ev[key] < 1.0:
            raise ValueError(f"evidence.{key} must be in (0, 1), got {ev[key]!r}")
    if ev["noise_sigma"] is not None and not (math.isfinite(ev["noise_sigma"]) and ev["noise_sigma"] > 0):
        raise ValueError(f"evidence.noise_sigma must be > 0 or null, got {ev['noise_sigma']!r}")
    if ev["noise_bundle"] is not None and not (Path(ev["noise_bundle"]).expanduser() / "summary.json").is_file():
        raise ValueError(f"evidence.noise_bundle = {ev['noise_bundle']!r} is not a bundle (no summary.json)")


def check_executor(exe: dict) -> None:
    for key in ("session_timeout_s", "reference_timeout_s", "poll_s", "stop_grace_s"):
        if not (math.isfinite(exe[key]) and exe[key] > 0):    # an infinite wait overflows time.sleep
            raise ValueError(f"executor.{key} must be a finite number > 0, got {exe[key]!r}")
    for key in ("reference_timeout_s", "session_timeout_s"):
        if exe["poll_s"] >= exe[key]:   # poll_s=1e9 waited that long after the reference child had ended
            raise ValueError(f"executor.poll_s = {exe['poll_s']:g} s must be below executor.{key} = {exe[key]:g} s: "
                             "the controller sees a child's end, and its timeout, once per poll")
    if exe["gpus"] is not None:
        if len(set(exe["gpus"])) != len(exe["gpus"]):
            raise ValueError(f"executor.gpus lists a GPU twice: {exe['gpus']}")
        if any(g < 0 for g in exe["gpus"]):
            raise ValueError(f"executor.gpus lists a negative GPU index: {exe['gpus']}")
        if exe["device"] == "cpu":
            raise ValueError(f"executor.gpus = {exe['gpus']} names GPUs, but executor.device = cpu runs on the CPU; "
                             "leave executor.gpus null there")
        if exe["kind"] == "slurm":     # SLURM allocates a job's GPUs itself
            raise ValueError(f"executor.gpus = {exe['gpus']} picks local GPUs, but executor.kind = slurm; leave it "
                             "null and set executor.slurm.gpus_per_task")
    check_slurm(exe["slurm"])
    positive_int("executor.cpu_threads", exe["cpu_threads"])
    positive_int("executor.cpu_devices", exe["cpu_devices"])
    if exe["cpu_devices"] > 1 and (exe["device"] != "cpu" or exe["kind"] != "local"):
        raise ValueError(f"executor.cpu_devices = {exe['cpu_devices']} simulates devices on CPU: it needs "
                         f"executor.device=cpu and executor.kind=local, got device={exe['device']}, kind={exe['kind']}")


def check_slurm(slurm: dict) -> None:
    """``executor.slurm``: counts and limits positive; ``cluster`` one submitit knows."""
    if slurm["cluster"] not in (None, "slurm", "local", "debug"):
        raise ValueError(f"executor.slurm.cluster must be null (SLURM), slurm, local or debug, got {slurm['cluster']!r}")
    for key in ("jobs", "cpus_per_task"):
        positive_int(f"executor.slurm.{key}", slurm[key])
    for key in ("time_limit_min", "mem_gb"):
        if slurm[key] is not None:
            positive_int(f"executor.slurm.{key}", slurm[key])
    if slurm["gpus_per_task"] < 0:
        raise ValueError(f"executor.slurm.gpus_per_task must be >= 0, got {slurm['gpus_per_task']!r}")
