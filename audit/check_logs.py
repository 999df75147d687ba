"""Each arm record against the line its session printed when it wrote it (``documents.log``).

A session child prints, after writing each arm record, the record's measured elapsed_s and tokens/s
(``documents.log.arm_line``) to its log, ``logs/<children.json log>``: a second copy of the measurement, written
at the time. Every figure of tables, summary, report and plot is re-derived from the records, so a record whose
elapsed_s was changed afterwards, and everything re-derived from it, agrees with itself; it does not agree with
the log the run left. Held here, in every format version (the line has not changed since the first):

- each line of a record's key (``arm_line_key``, behind the ``line_prefix``) in its session's log is the
  record's ``arm_line``, the figures as the contract formats them;
- a session that completed printed one for each record naming it (a child killed between writing a record
  and printing its line may lack it); a lone run a resume measured again has its line too, held to its record under
  superseded/ from format 15 (audit/check_superseded.py; earlier formats deleted the record, leaving the line unread);
- every arm line of a session's log (a line of ``arm_line``'s shape) has the key of an item of its device's order
  in plan.json: a run cut from the plan (a point dropped with its records) leaves lines the plan no longer holds;
- from format 7, each ``ceiling_line`` of a session's log gives the copy ceiling of its ``ceilings/<session>.json``
  (the roofline's denominator), and a session that completed with a ceiling file printed one;
- from format 14, each ``plan_line`` of a measuring session's log gives the sha256 of the bundle's plan.json, and a
  measuring session that completed printed one (the plan, its verdict rule included, is the one the arms ran under).
"""
from __future__ import annotations

import hashlib
import re

from . import contract, derive
from .context import Audit

LOG = contract.DOCS["log"]
PREFIX = re.compile(LOG["line_prefix"])


def arm_line_key(record: dict) -> str:
    return LOG["arm_line_key"].format(seq=record["seq"], point=record["point"], comparison=record["comparison"],
                                      pair=record["pair"], position=record["position"], arm=record["arm"])


def arm_line(record: dict) -> str:
    return LOG["arm_line"].format(key=arm_line_key(record), elapsed_s=record["measured"]["elapsed_s"],
                                  tokens_per_s=record["tokens_per_s"])


def _lines(ctx: Audit, rel: str) -> list[tuple[int, str]] | None:
    """(line number, text after the prefix) of each prefixed line; None for a missing or unreadable log (a
    missing one is named by the required-files check)."""
    path = ctx.bundle / rel
    if not path.is_file():
        return None
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        ctx.fail("logs", f"{rel} could not be read: {type(exc).__name__}: {exc}")
        return None
    return [(n, line[m.end():]) for n, line in enumerate(text.split("\n"), 1) if (m := PREFIX.match(line))]


def check(ctx: Audit, records: list[dict], children: list[dict], what: str = "record") -> None:
    """Each record's line in its session's log (see the module docstring); ``what`` names the records in a
    discrepancy (``superseded record``: format 15's, audit/check_superseded.py)."""
    sessions = {derive.child_session(c): c for c in children if isinstance(c, dict)}   # the latest entry per id
    logs: dict[str, list[tuple[int, str]] | None] = {}
    for r in records:
        sid = derive.record_session(r)
        child = sessions.get(sid)
        if child is None or not isinstance(child.get("log"), str):
            continue   # named by check_sessions
        rel = f"logs/{child['log']}"
        if rel not in logs:
            logs[rel] = _lines(ctx, rel)
        if logs[rel] is None:
            continue
        key, want = arm_line_key(r) + ": ", arm_line(r)
        found = [(n, body) for n, body in logs[rel] if body.startswith(key)]
        where = f"{what} {r['job']} seq {r['seq']} ({r['arm']})"
        for n, body in found:
            if body != want:
                ctx.fail("logs", f"{rel} line {n} reads {body!r}; {where} gives {want!r}")
        if not found and child.get("state") == "completed":
            ctx.fail("logs", f"{rel}: {where} has no line, though session {sid} completed; the record gives {want!r}")
        ctx.count("log_lines", len(found))


def _arm_line_shape() -> re.Pattern:
    """What follows an arm line's key: ``arm_line`` after ``{key}``, its figures as numbers."""
    tail = LOG["arm_line"].split("{key}", 1)[1]
    parts = re.split(r"(\{\w+:[^}]*\})", tail)
    return re.compile("".join(r"(?:-?[\d.]+(?:e[-+]?\d+)?|nan|inf)" if p.startswith("{") else re.escape(p)
                              for p in parts) + "$")


def check_planned(ctx: Audit, plan: dict, children: list[dict]) -> None:
    """Every arm line of a session's log is the line of an item of its device's planned order (see the module
    docstring): the plan cannot have lost runs that the sessions measured."""
    shape = _arm_line_shape()
    devices = {d["name"] for d in plan["devices"]}
    for c in children:
        if not isinstance(c, dict) or c.get("name") not in devices or not isinstance(c.get("log"), str):
            continue
        rel = f"logs/{c['log']}"
        planned = {arm_line_key(it) for it in plan["order"].get(c["name"], []) if isinstance(it, dict)}
        for n, body in _lines(ctx, rel) or []:
            m = shape.search(body)
            if m is not None and body[:m.start()] not in planned:
                ctx.fail("logs", f"{rel} line {n} reads {body!r}, an arm that plan.json's order of {c['name']} "
                                 "does not hold")
            ctx.count("planned_log_lines", m is not None)


def _held_line(ctx: Audit, rel: str, sid: str, head: str, want: str, completed: bool, source: str, what: str,
               tail: str = "", why: str = "") -> int:
    """Each line of log ``rel`` between ``head`` and ``tail`` (one line of the contract's, its figure aside) against
    ``want``, which ``source`` gives, and one such line (``what``) owed by a session that completed; their count."""
    lines = _lines(ctx, rel)
    found = [(n, body) for n, body in lines or [] if body.startswith(head) and body.endswith(tail)]
    for n, body in found:
        if body != want:
            ctx.fail("logs", f"{rel} line {n} reads {body!r}; {source} gives {want!r}{why}")
    if lines is not None and not found and completed:
        ctx.fail("logs", f"{rel}: no {what} line, though session {sid} completed; {source} gives {want!r}")
    return len(found)


def check_ceilings(ctx: Audit, children: list[dict]) -> None:
    """Each session's copy ceiling, as the roofline check read it, against the ceiling line its log printed (see
    the module docstring); nothing where the roofline check read none (before format 7, or a broken file, named
    there)."""
    if ctx.roofline is None or ctx.version < LOG["ceiling_line_since"]:
        return
    sessions = {derive.child_session(c): c for c in children if isinstance(c, dict)}
    head, tail = LOG["ceiling_line"].split("{gb_per_s:.1f}")   # a session's line: its words around the figure
    for sid, doc in sorted(ctx.roofline[1].items()):
        child = sessions.get(sid)
        if child is None or not isinstance(child.get("log"), str):
            continue   # named by check_sessions
        want = LOG["ceiling_line"].format(session=sid, gb_per_s=doc["bytes_per_copy"] / min(doc["times_s"]) / 1e9)
        ctx.count("ceiling_lines", _held_line(ctx, f"logs/{child['log']}", sid, head.format(session=sid), want,
                                              child.get("state") == "completed", f"ceilings/{sid}.json",
                                              "copy ceiling", tail=tail))


def check_plan_lines(ctx: Audit, plan: dict, children: list[dict]) -> None:
    """The sha256 of the plan.json each measuring session read, as its log printed it, against the bundle's plan.json
    (see the module docstring); every run's child, not only the latest entry per name, since each read the plan."""
    if ctx.version < LOG["plan_line_since"]:
        return
    want_sha = hashlib.sha256((ctx.bundle / "plan.json").read_bytes()).hexdigest()
    head = LOG["plan_line"].split("{sha256}")[0]   # a session's plan line: its words before the sha256
    devices = {d["name"] for d in plan["devices"]}
    for c in children:
        if not isinstance(c, dict) or c.get("name") not in devices or not isinstance(c.get("log"), str):
            continue   # a reference child reads no plan; a broken entry is named by check_sessions
        sid = derive.child_session(c)
        ctx.count("plan_lines", _held_line(ctx, f"logs/{c['log']}", sid, head.format(session=sid),
                                           LOG["plan_line"].format(session=sid, sha256=want_sha),
                                           c.get("state") == "completed", "the bundle's plan.json", "plan.json sha256",
                                           why=": the plan was changed after the session read it"))
