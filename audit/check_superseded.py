"""Records a resume superseded (format 15): each held to the run it was, and kept out of every figure.

A resume measures again a pair whose other arm was not recorded (a pair's two arms run back to back in one
session) and moves the lone arm's raw record, or a lone online run's record with its server log, to
``superseded/<session>/<its path>`` (the contract's ``superseded``), ``<session>`` being the session that measured
it. No figure reads them: tables, summary, plot and the report's other sections are re-derived from raw/ and online/
alone. From format 15 (in an earlier bundle a file under superseded/ is a stray of the layout, check_files):

- each record is well formed (a raw arm record's fields, load.record_problem; an online record's,
  check_online.record_problem) and sits at the place of its own session, job and run;
- it is a run this bundle planned: a raw record at its place in plan.json's order with its arm's config and
  workload (check_plan.check_record_place); an online record at its place in online.order, an arm run (a
  calibration run has no partner, so it is never lone), as planned (check_online.check_as_planned);
- it was measured by a session of its device in children.json whose job asked for it, and a raw record's line in
  that session's log is its line (check_logs.check);
- it was measured again: the run's record in raw/ or online/ names a later session of its device (children.json is
  in run order) than the superseded one does. A run without a record there is accepted: the bundle is then
  incomplete, its status says so, and the next resume measures the pair (a resume stopped between setting a record
  aside and its session's first arm leaves exactly that).
"""
from __future__ import annotations

from . import check_logs, check_online, check_plan, check_sessions, contract, derive, load
from .context import Audit

SPEC = contract.FORMAT["superseded"]


def place(session: str, rel: str) -> str:
    """Where the file at bundle path ``rel`` that session ``session`` wrote is kept once superseded."""
    return SPEC["path"].format(folder=SPEC["folder"], session=session, path=rel)


def _measured_again(ctx: Audit, rel: str, sid: str, now: dict | None, now_rel: str, rank: dict[str, int]) -> None:
    """The run superseded at ``rel`` was measured again: its record in the bundle (``now`` at ``now_rel``; None: none,
    accepted) names a session after ``sid`` in children.json."""
    if now is None:
        return
    later = derive.record_session(now)
    if rank.get(later, -1) <= rank.get(sid, -1):
        ctx.fail("superseded", f"{rel} was not measured again: {now_rel} is of session {later}, not of a session "
                               f"after {sid} in children.json")


def _arm_record(ctx: Audit, plan: dict, rel: str, rec, sessions: dict[str, dict], rank: dict[str, int],
                current: dict[tuple, dict]) -> dict | None:
    """A superseded raw arm record (see the module docstring); the record where it is one."""
    problem = load.record_problem(rec, ctx.version >= contract.CLOSED_SINCE)
    if problem is not None:
        ctx.fail("superseded", f"{rel} is not an arm record: {problem}")
        return None
    job, seq, sid = rec["job"], rec["seq"], derive.record_session(rec)
    now_rel = f"raw/{job}/{load.record_file_name(rec)}"
    if rel != place(sid, now_rel):
        ctx.fail("superseded", f"{rel} holds {job} seq {seq} of session {sid}, whose place is {place(sid, now_rel)}")
    item = next((it for it in plan["order"].get(job, []) if it["seq"] == seq), None)
    check_plan.check_record_place(ctx, plan, rec, item, "superseded", rel)
    c = sessions.get(sid)
    if c is None or c.get("name") != job:
        ctx.fail("superseded", f"{rel}: session {sid!r} is not a session of {job} in children.json")
        return rec
    asked = check_sessions.asked_seqs(ctx, plan, sid, job)
    if asked is not None and seq not in asked:
        ctx.fail("superseded", f"{rel}: session {sid} measured seq {seq}, which its job did not ask for "
                               f"({sorted(asked)})")
    _measured_again(ctx, rel, sid, current.get((job, seq)), now_rel, rank)
    return rec


def _online_record(ctx: Audit, plan: dict, rel: str, rec, rank: dict[str, int], sessions: list[str]) -> dict | None:
    """A superseded online record (see the module docstring); the record where it is one."""
    on = plan.get("online")
    if not on:
        ctx.fail("superseded", f"{rel}: plan.json has no online track")
        return None
    problem = check_online.record_problem(rec, rel)
    if problem is not None:
        ctx.fail("superseded", problem)
        return None
    item = next((o for o in on["order"] if o["seq"] == rec["seq"]), None)
    if item is None or item["kind"] != "arm" or rec["job"] != on["device"] or any(rec[k] != item[k] for k in item):
        ctx.fail("superseded", f"{rel} is not an arm run at its place in plan.json online.order")
        return None
    now_rel = f"online/{on['device']}/{check_online.record_stem(item)}.json"
    if rel != place(rec["session"], now_rel):
        ctx.fail("superseded", f"{rel} holds online seq {rec['seq']} of session {rec['session']}, whose place is "
                               f"{place(rec['session'], now_rel)}")
    check_online.check_as_planned(ctx, plan, rec, rel, sessions)
    now = next((r for r in ctx.online_records if r["seq"] == rec["seq"]), None)
    _measured_again(ctx, rel, rec["session"], now, now_rel, rank)
    return rec


def check(ctx: Audit, plan: dict, children: list[dict], records: list[dict]) -> None:
    """Every superseded record (see the module docstring); ``ctx.superseded`` gets those that load, for the
    report's section (:func:`report_lines`). Run after check_online, whose records it reads."""
    ctx.superseded = []
    folder = ctx.bundle / SPEC["folder"]
    if ctx.version < SPEC["since"] or not folder.is_dir():
        return
    ids = [derive.child_session(c) for c in children if isinstance(c, dict)]
    rank = {sid: i for i, sid in enumerate(ids)}
    sessions = {derive.child_session(c): c for c in children if isinstance(c, dict)}
    current = {(r["job"], r["seq"]): r for r in records}
    online_sessions = check_online.device_sessions(plan, children) if plan.get("online") else []
    arms = []
    for path in sorted(p for p in folder.rglob("*.json") if p.is_file()):
        rel = path.relative_to(ctx.bundle).as_posix()
        rec = ctx.read_json(rel, "superseded")
        if rec is None:
            continue
        parts = path.relative_to(folder).parts   # <session>, then the path it had: raw/... or online/...
        if len(parts) > 1 and parts[1] == "online":
            got = _online_record(ctx, plan, rel, rec, rank, online_sessions)
        else:
            got = _arm_record(ctx, plan, rel, rec, sessions, rank, current)
            arms += [got] if got is not None else []
        if got is not None:
            ctx.superseded.append((rel, got))
    check_logs.check(ctx, arms, children, "superseded record")
    ctx.count("superseded_records", len(ctx.superseded))


def report_lines(ctx: Audit, children: list[dict]) -> list[str]:
    """The report's section of the superseded records (``superseded.report``, format 15): none without any; rows by
    the session that measured each in ``children`` (children.json, run order), then by path."""
    if ctx.version < SPEC["since"] or not ctx.superseded:
        return []
    from .render import _table, fill, wording

    spec, ids = SPEC["report"], [derive.child_session(c) for c in children if isinstance(c, dict)]
    rank = {sid: ids.index(sid) for sid in ids}   # a repeated id: named by check_sessions; its first place here
    first = sorted(ctx.superseded, key=lambda run: (rank.get(derive.record_session(run[1]), len(ids)), run[0]))
    rows = [spec["row"].format(file=rel, session=derive.record_session(rec), seq=rec["seq"], arm=rec["arm"])
            for rel, rec in first]
    return ["", spec["heading"], "", fill(spec["text"], runs=len(rows)), ""] \
        + _table(wording(contract.FORMAT["report"], ctx.version), spec["columns"], rows)
