"""What each measured run ran with (format 9): every raw record's ``engine_settings``, its engine's own report of
what it resolved and ran with (audit/FORMAT.md, "Runtime settings"); and, from format 10, every online run's.

A record of a format-9 bundle holds ``engine_settings``: an object whose every value is a JSON scalar
(``documents.record.engine_settings_values``; a number finite), or null for an engine without ``settings()``.
The runs of one arm at one point and track (replay, or its own exits: a natural comparison) in one session
ran the same code on the same model, so they hold equal settings: a run that differs is named with the key,
against that group's first run (by job and seq). Values compare as JSON (``true`` is not ``1``). A replayed run
whose settings name a ``schedule_sha256`` must name its point's frozen reference (the plan's ``reference.sha256``; a
natural comparison's run names none),
and a setting named like an ``arm_config`` key (but ``engine``) or ``max_num_seqs`` must equal the record's. Records of
earlier formats have no ``engine_settings``; one that has it is named. The report's Runtime settings section is
rendered here from the records (:func:`report_lines`).

A raw online record of a format-10 bundle holds ``engine_settings`` of the same shape, what its server's engine
reported (:func:`check_online`): equal across the online runs of one arm in one session, its calibration run
included (each run's server is a fresh one of the same arm, batch and exit policy), and a setting named like an
``arm_config`` key (but ``engine``) or ``max_num_seqs`` says what the record's ``arm_config`` and plan.json
``online.max_num_seqs`` do, and ``exit_policy`` / ``max_model_len`` what every server ran with, plan.json
``config.exit.policy`` / ``max_model_len``; null (an engine without ``settings()``) only where the bundle's other
runs of the same engine are null too; and no ``schedule_sha256``, since a server runs its own exits (the plan's
exit policy). The Online section shows them laid out as the Runtime settings section (:func:`section`).
"""
from __future__ import annotations

import json
import math

from . import check_natural, contract
from .context import Audit

RECORD = contract.DOCS["record"]
SINCE = RECORD["engine_settings_since"]
ONLINE_SINCE = contract.FORMAT["online"]["engine_settings_since"]
ABSENT = contract.ABSENT


def _at(rec: dict) -> str:
    return f"record {rec['job']} seq {rec['seq']} ({rec['arm']}, {rec['point']}, session {rec.get('session', rec['job'])})"


def _online_at(rec: dict) -> str:
    return f"online record {rec['job']} seq {rec['seq']} ({rec['arm']}, {rec['kind']} run, session {rec['session']})"


def _problem(rec: dict) -> str | None:
    """Why a format-9 record's (or a format-10 online record's) ``engine_settings`` is not an object of JSON
    scalars or null (its JSON type is the contract's ``object|null`` already: load.record_problem,
    check_online.load_records)."""
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


def _check_claims(ctx: Audit, rec: dict, at: str, claims: dict[str, tuple[object, str]]) -> None:
    """Settings that name a value stated elsewhere (``claims``: key -> (value, where it is stated)) must say the
    same, compared as JSON. Keys an engine does not report are not held to anything."""
    settings = rec["engine_settings"] or {}
    for key, (want, stated) in sorted(claims.items()):
        if key in settings and _text(settings[key]) != _text(want):
            ctx.fail("engine_settings", f"{at}: engine_settings.{key} is {_text(settings[key])}, where {stated} "
                                        f"says {_text(want)}")


def _check_against_record(ctx: Audit, rec: dict, at: str, max_num_seqs: int) -> None:
    """Settings that name what the record itself says (an ``arm_config`` key but ``engine``, ``max_num_seqs``)
    must say the same: a run whose engine ran another arm or batch than its record claims is named."""
    claimed = {**{k: v for k, v in rec["arm_config"].items() if k != "engine"}, "max_num_seqs": max_num_seqs}
    _check_claims(ctx, rec, at, {key: (want, "the record") for key, want in claimed.items()})


def _online_planned(plan: dict) -> dict[str, tuple[object, str]]:
    """What every online server runs with by the plan (harness/online/arms.py ``server_spec``): its exit policy
    and its positions per request, as the settings its engine reports name them (``_check_claims``)."""
    return {"exit_policy": (plan["config"]["exit"]["policy"], "plan.json config.exit.policy"),
            "max_model_len": (plan["max_model_len"], "plan.json max_model_len")}


def _check_schedule(ctx: Audit, rec: dict, reference_sha256: str | None) -> None:
    """A replayed run that names its schedule (``engine_settings.schedule_sha256``, the sha256 of the schedule's
    JSON, which is the bytes of ``references/<point>.schedule.json``) replayed its point's frozen reference: the
    plan's ``reference.sha256``. An engine that names none (no key, or null) is not held to it here; the
    reference check holds its tokens and exits to the reference either way."""
    got = (rec["engine_settings"] or {}).get("schedule_sha256")
    if got is not None and got != reference_sha256:
        ctx.fail("engine_settings", f"{_at(rec)}: engine_settings.schedule_sha256 is {got}, not the sha256 of its "
                                    f"point's frozen reference ({reference_sha256})")


def _check_no_schedule(ctx: Audit, rec: dict, at: str, why: str) -> None:
    """A run that replays no schedule (a natural comparison's, an online one) names none: its
    ``engine_settings.schedule_sha256`` is absent or null (``why`` says why it replays none)."""
    replayed = (rec["engine_settings"] or {}).get("schedule_sha256")
    if replayed is not None:
        ctx.fail("engine_settings", f"{at}: engine_settings.schedule_sha256 is {replayed}, where {why}")


def _held(ctx: Audit, records: list[dict], since: int, at, counted: str) -> list[dict]:
    """The records whose ``engine_settings`` are well formed (by job and seq), each counted as ``counted``; the
    others named. Before format ``since`` none are held, and a record that has settings is named."""
    if ctx.version < since:
        for rec in records:
            if "engine_settings" in rec:
                ctx.fail("engine_settings", f"{at(rec)} holds engine_settings, format {since} content in a format "
                                            f"{ctx.version} bundle")
        return []
    held = []
    for rec in sorted(records, key=lambda r: (r["job"], r["seq"])):
        problem = _problem(rec)
        if problem is not None:
            ctx.fail("engine_settings", f"{at(rec)} {problem}")
            continue
        ctx.count(counted)
        held.append(rec)
    return held


def _check_groups(ctx: Audit, groups: dict[tuple, list[dict]], at, alike: str) -> None:
    """Each run of a group (``alike`` says what its runs share) holds its first run's settings."""
    for runs in groups.values():
        first = runs[0]
        for rec in runs[1:]:
            for key, got, want in _differences(rec["engine_settings"], first["engine_settings"]):
                ctx.fail("engine_settings", f"{at(rec)}: {key} is {got}, where seq {first['seq']}, {alike}, "
                                            f"holds {want}")


def check(ctx: Audit, plan: dict, records: list[dict]) -> None:
    """Format 9: each record's ``engine_settings``, and equal settings within an arm's runs at one point and
    track in one session; before format 9: none."""
    references = {pt["key"]: pt["reference"]["sha256"] for pt in plan["points"] if pt.get("reference")}
    groups: dict[tuple, list[dict]] = {}
    for rec in _held(ctx, records, SINCE, _at, "engine_settings"):
        track = "natural" if check_natural.is_natural(plan, rec) else "replay"
        _check_against_record(ctx, rec, _at(rec), rec["max_num_seqs"])
        if track == "replay":
            _check_schedule(ctx, rec, references.get(rec["point"]))
        else:
            _check_no_schedule(ctx, rec, _at(rec), "a natural comparison's run replays no schedule: it runs its own "
                                                   "exits")
        groups.setdefault((rec.get("session", rec["job"]), rec["point"], track, rec["arm"]), []).append(rec)
    _check_groups(ctx, groups, _at, "a run of the same arm at the same point and track in the same session")


def check_online(ctx: Audit, plan: dict, records: list[dict], measured: list[dict]) -> None:
    """Format 10: each online record's ``engine_settings`` (``records``: check_online.load_records), held to its
    record and to the plan's exit policy and ``max_model_len``, naming no replayed schedule, equal across the
    online runs of one arm in one session, and null only where its engine's are (:func:`_check_engine_reports`,
    against the ``measured`` raw records too); before format 10: none."""
    if not plan.get("online"):
        return
    groups: dict[tuple, list[dict]] = {}
    held = _held(ctx, records, ONLINE_SINCE, _online_at, "online_engine_settings")
    for rec in held:
        _check_against_record(ctx, rec, _online_at(rec), plan["online"]["max_num_seqs"])
        _check_claims(ctx, rec, _online_at(rec), _online_planned(plan))
        _check_no_schedule(ctx, rec, _online_at(rec), "an online run replays no schedule: its server runs the plan's "
                                                      "exit policy")
        groups.setdefault((rec["session"], rec["arm"]), []).append(rec)
    _check_groups(ctx, groups, _online_at, "an online run of the same arm in the same session")
    if held:
        _check_engine_reports(ctx, held, [r for r in measured if _problem(r) is None])


def _check_engine_reports(ctx: Audit, online: list[dict], measured: list[dict]) -> None:
    """null says an engine without ``settings()`` (runtime/api.py), which one engine (``arm_config.engine``) either
    has or lacks in one bundle's code: an online run whose settings are null where the first run of its engine
    (a measured run first, else an online one) holds an object, or the other way round, is named, so a null cannot
    hide what the engine reported."""
    first: dict = {}
    for rec, at in [*((r, _at) for r in measured), *((r, _online_at) for r in online)]:
        first.setdefault(rec["arm_config"].get("engine"), (rec, at))
    for rec in online:
        engine = rec["arm_config"].get("engine")
        other, at = first[engine]
        if (rec["engine_settings"] is None) != (other["engine_settings"] is None):
            _, got, want = _differences(rec["engine_settings"], other["engine_settings"])[0]   # null, an object
            ctx.fail("engine_settings", f"{_online_at(rec)}: engine_settings is {got}, where {at(other)}, of the same "
                                        f"engine ({engine}), holds {want}")


# ------------------------------------------------------------------------------------------ report

def _shown(value) -> str:
    """A setting as the report shows it (``report.runtime_settings.about``): a non-empty string itself, else its
    JSON (``""``, ``true``, ``null``, ``16``)."""
    return json.dumps(value) if value == "" or not isinstance(value, str) else value


def section(w: dict, plan: dict, records: list[dict], heading: str | None = None, text: str | None = None) -> list[str]:
    """The Runtime settings section of ``records`` in the wording ``w`` (render.wording of the bundle's format),
    by ``report.runtime_settings.about``: an arm's value of a setting is its runs' values, each once, in run
    order (plan point, job, seq; n/a where a run lacks it); the settings whose value differs between arms as
    rows, one column per arm, then the line of those every arm shares; the "none" line when no run's engine
    reported any; no section without runs. ``heading`` and ``text`` (the section's own by default) word it
    for other runs (the online runs': :func:`online_report_lines`)."""
    from .render import _table

    spec, na = w["runtime_settings"], w["words"]["na"]
    points = [p["key"] for p in plan["points"]]
    runs = sorted(records, key=lambda r: (points.index(r["point"]) if r["point"] in points else len(points),
                                          r["job"], r["seq"]))
    if not runs:
        return []
    values = [{k: _shown(v) for k, v in (r.get("engine_settings") or {}).items()} for r in runs]
    lines = ["", heading or w["headings"]["runtime_settings"], ""]
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
                shown = held.get(name, na)
                if rec["arm"] == arm and shown not in seen:
                    seen.append(shown)
            cells.append(spec["value_separator"].join(seen))
        if all(cell == cells[0] for cell in cells):
            shared.append(spec["setting"].format(key=name, value=cells[0]))
        else:
            rows.append(spec["row"].format(setting=name, cells=spec["cell_separator"].join(cells)))
    lines += [text or spec["text"], ""]
    if rows:
        lines += _table(w, [spec["column"], *arms], rows) + [""]
    return lines + [spec["shared"].format(settings=spec["setting_separator"].join(shared) or spec["shared_none"])]


def report_lines(ctx: Audit, plan: dict, records: list[dict]) -> list[str]:
    """The Runtime settings section of a format-9 bundle (none before format 9)."""
    if ctx.version < SINCE:
        return []
    from .render import wording

    return section(wording(contract.FORMAT["report"], ctx.version), plan, records)


def online_report_lines(ctx: Audit, plan: dict, records: list[dict]) -> list[str]:
    """The Online section's settings of the online runs (``online.report.settings_heading``; format 10, none
    before): the online ``records``' engine_settings laid out as the Runtime settings section."""
    if ctx.version < ONLINE_SINCE:
        return []
    from .render import wording

    words = contract.FORMAT["online"]["report"]
    return section(wording(contract.FORMAT["report"], ctx.version), plan, records, words["settings_heading"],
                   words["settings_text"])
