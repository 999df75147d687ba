"""What each measured run ran with (format 9): every raw record's ``engine_settings``, its engine's own report of
what it resolved and ran with (audit/FORMAT.md, "Runtime settings").

A record of a format-9 bundle holds ``engine_settings``: an object whose every value is a JSON scalar
(``documents.record.engine_settings_values``; a number finite), or null for an engine without ``settings()``.
The runs of one arm at one point and track (replay, or its own exits: a natural comparison) in one session
ran the same code on the same model, so they hold equal settings: a run that differs is named with the key,
against that group's first run (by job and seq). Values compare as JSON (``true`` is not ``1``). A replayed run
whose settings name a ``schedule_sha256`` must name its point's frozen reference (the plan's ``reference.sha256``),
and a setting named like an ``arm_config`` key (but ``engine``) or ``max_num_seqs`` must equal the record's. Records of
earlier formats have no ``engine_settings``; one that has it is named. The report's Runtime settings section is
rendered here from the records (:func:`report_lines`).
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


def _check_against_record(ctx: Audit, rec: dict) -> None:
    """Settings that name what the record itself says (an ``arm_config`` key but ``engine``, ``max_num_seqs``)
    must say the same, compared as JSON: a run whose engine ran another arm or batch than its record claims is
    named. Keys an engine does not report are not held to anything."""
    settings = rec["engine_settings"] or {}
    claimed = {**{k: v for k, v in rec["arm_config"].items() if k != "engine"}, "max_num_seqs": rec["max_num_seqs"]}
    for key, want in sorted(claimed.items()):
        if key in settings and _text(settings[key]) != _text(want):
            ctx.fail("engine_settings", f"{_at(rec)}: engine_settings.{key} is {_text(settings[key])}, where the "
                                        f"record says {_text(want)}")


def _check_schedule(ctx: Audit, rec: dict, reference_sha256: str | None) -> None:
    """A replayed run that names its schedule (``engine_settings.schedule_sha256``, the sha256 of the schedule's
    JSON, which is the bytes of ``references/<point>.schedule.json``) replayed its point's frozen reference: the
    plan's ``reference.sha256``. An engine that names none (no key, or null) is not held to it here; the
    reference check holds its tokens and exits to the reference either way."""
    got = (rec["engine_settings"] or {}).get("schedule_sha256")
    if got is not None and got != reference_sha256:
        ctx.fail("engine_settings", f"{_at(rec)}: engine_settings.schedule_sha256 is {got}, not the sha256 of its "
                                    f"point's frozen reference ({reference_sha256})")


def check(ctx: Audit, plan: dict, records: list[dict]) -> None:
    """Format 9: each record's ``engine_settings``, and equal settings within an arm's runs at one point and
    track in one session; before format 9: none."""
    if ctx.version < SINCE:
        for rec in records:
            if "engine_settings" in rec:
                ctx.fail("engine_settings", f"{_at(rec)} holds engine_settings, format {SINCE} content in a format "
                                            f"{ctx.version} bundle")
        return
    references = {pt["key"]: pt["reference"]["sha256"] for pt in plan["points"] if pt.get("reference")}
    groups: dict[tuple, list[dict]] = {}
    for rec in sorted(records, key=lambda r: (r["job"], r["seq"])):
        problem = _problem(rec)
        if problem is not None:
            ctx.fail("engine_settings", f"{_at(rec)} {problem}")
            continue
        ctx.count("engine_settings")
        track = "natural" if check_natural.is_natural(plan, rec) else "replay"
        _check_against_record(ctx, rec)
        if track == "replay":
            _check_schedule(ctx, rec, references.get(rec["point"]))
        groups.setdefault((rec.get("session", rec["job"]), rec["point"], track, rec["arm"]), []).append(rec)
    for runs in groups.values():
        first = runs[0]
        for rec in runs[1:]:
            for key, got, want in _differences(rec["engine_settings"], first["engine_settings"]):
                ctx.fail("engine_settings", f"{_at(rec)}: {key} is {got}, where seq {first['seq']}, a run of the same "
                                            f"arm at the same point and track in the same session, holds {want}")


# ------------------------------------------------------------------------------------------ report

def _shown(value) -> str:
    """A setting as the report shows it (``report.runtime_settings.about``): a non-empty string itself, else its
    JSON (``""``, ``true``, ``null``, ``16``)."""
    return json.dumps(value) if value == "" or not isinstance(value, str) else value


def section(w: dict, plan: dict, records: list[dict]) -> list[str]:
    """The Runtime settings section of ``records`` in the wording ``w`` (render.wording of the bundle's format),
    by ``report.runtime_settings.about``: an arm's value of a setting is its runs' values, each once, in run
    order (plan point, job, seq; n/a where a run lacks it); the settings whose value differs between arms as
    rows, one column per arm, then the line of those every arm shares; the "none" line when no run's engine
    reported any; no section without runs."""
    from .render import _table

    spec, na = w["runtime_settings"], w["words"]["na"]
    points = [p["key"] for p in plan["points"]]
    runs = sorted(records, key=lambda r: (points.index(r["point"]) if r["point"] in points else len(points),
                                          r["job"], r["seq"]))
    if not runs:
        return []
    values = [{k: _shown(v) for k, v in (r.get("engine_settings") or {}).items()} for r in runs]
    lines = ["", w["headings"]["runtime_settings"], ""]
    names = sorted(set().union(*values))
    if not names:
        return lines + [spec["none"]]
    arms = sorted({r["arm"] for r in runs})
    shared, rows = [], []
    for name in names:
        cells = []
        for arm in arms:
            seen: list[str] = []
            for rec, held in zip(runs, values):
                text = held.get(name, na)
                if rec["arm"] == arm and text not in seen:
                    seen.append(text)
            cells.append(spec["value_separator"].join(seen))
        if all(cell == cells[0] for cell in cells):
            shared.append(spec["setting"].format(key=name, value=cells[0]))
        else:
            rows.append(spec["row"].format(setting=name, cells=spec["cell_separator"].join(cells)))
    lines += [spec["text"], ""]
    if rows:
        lines += _table(w, [spec["column"], *arms], rows) + [""]
    return lines + [spec["shared"].format(settings=spec["setting_separator"].join(shared) or spec["shared_none"])]


def report_lines(ctx: Audit, plan: dict, records: list[dict]) -> list[str]:
    """The Runtime settings section of a format-9 bundle (none before format 9)."""
    if ctx.version < SINCE:
        return []
    from .render import wording

    return section(wording(contract.FORMAT["report"], ctx.version), plan, records)
