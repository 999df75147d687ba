"""What each measured run ran with (format 9): every raw record's ``engine_settings``, its engine's own report of
what it resolved and ran with (audit/FORMAT.md, "Runtime settings").

A record of a format-9 bundle holds ``engine_settings``: an object whose every value is a JSON scalar
(``documents.record.engine_settings_values``; a number finite), or null for an engine without ``settings()``.
The runs of one arm at one point and track (replay, or its own exits: a natural comparison) in one session
ran the same code on the same model, so they hold equal settings: a run that differs is named with the key,
against that group's first run (by job and seq). Values compare as JSON (``true`` is not ``1``). Records of
earlier formats have no ``engine_settings``; one that has it is named.
"""
from __future__ import annotations

import json
import math

from . import check_natural, contract
from .context import Audit

RECORD = contract.DOCS["record"]
SINCE = RECORD["engine_settings_since"]
ABSENT = contract.ABSENT


def _at(rec: dict) -> str:
    return f"record {rec['job']} seq {rec['seq']} ({rec['arm']}, {rec['point']}, session {rec.get('session', rec['job'])})"


def _problem(rec: dict) -> str | None:
    """Why a format-9 record's ``engine_settings`` is not an object of JSON scalars or null (its JSON type is
    the contract's ``object|null`` already: load.record_problem)."""
    if "engine_settings" not in rec:
        return "has no engine_settings"
    settings = rec["engine_settings"]
    for key, value in (settings or {}).items():
        if not contract.is_kind(value, RECORD["engine_settings_values"]) or (
                isinstance(value, float) and not math.isfinite(value)):
            return f"engine_settings.{key} is {value!r}, not a JSON scalar ({RECORD['engine_settings_values']})"
    return None


def _text(value) -> str:
    return "missing" if value is ABSENT else json.dumps(value)


def _differences(got: dict | None, want: dict | None) -> list[tuple[str, str, str]]:
    """(key, got, want) of each setting whose JSON value differs, in key order; ("engine_settings", ...) when one
    of the two is null and the other is not."""
    if (got is None) != (want is None):
        return [("engine_settings", "null" if got is None else "an object", "null" if want is None else "an object")]
    got, want = got or {}, want or {}
    return [(f"engine_settings.{k}", _text(got.get(k, ABSENT)), _text(want.get(k, ABSENT)))
            for k in sorted(set(got) | set(want)) if _text(got.get(k, ABSENT)) != _text(want.get(k, ABSENT))]


def check(ctx: Audit, plan: dict, records: list[dict]) -> None:
    """Format 9: each record's ``engine_settings``, and equal settings within an arm's runs at one point and
    track in one session; before format 9: none."""
    if ctx.version < SINCE:
        for rec in records:
            if "engine_settings" in rec:
                ctx.fail("engine_settings", f"{_at(rec)} holds engine_settings, format {SINCE} content in a format "
                                            f"{ctx.version} bundle")
        return
    groups: dict[tuple, list[dict]] = {}
    for rec in sorted(records, key=lambda r: (r["job"], r["seq"])):
        problem = _problem(rec)
        if problem is not None:
            ctx.fail("engine_settings", f"{_at(rec)} {problem}")
            continue
        ctx.count("engine_settings")
        track = "natural" if check_natural.is_natural(plan, rec) else "replay"
        groups.setdefault((rec.get("session", rec["job"]), rec["point"], track, rec["arm"]), []).append(rec)
    for runs in groups.values():
        first = runs[0]
        for rec in runs[1:]:
            for key, got, want in _differences(rec["engine_settings"], first["engine_settings"]):
                ctx.fail("engine_settings", f"{_at(rec)}: {key} is {got}, where seq {first['seq']}, a run of the same "
                                            f"arm at the same point and track in the same session, holds {want}")
