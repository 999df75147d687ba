"""Checks of what every arm ran against its frozen reference: tokens and exit depths, work counters and
row trace; zero measured Graph captures; equal Graph coverage within a pair; and the coverage counts a
record claims against those the auditor derives from the frozen schedule (:mod:`.coverage`)."""
from __future__ import annotations

from . import check_natural, contract, coverage
from .context import Audit
from .values import field_diffs, plain

RECORD = contract.DOCS["record"]
ABSENT = contract.ABSENT


def check_against_references(ctx: Audit, plan: dict, records: list[dict], refs: dict) -> bool:
    """True when no record differs from its reference (the summary's ``checks.ok``)."""
    before = len(ctx.discrepancies)
    warmup = plan["config"]["warmup"]
    for r in records:
        ref = refs.get(r["point"])
        if ref is None:
            ctx.fail("reference", f"{r['job']} seq {r['seq']}: no frozen reference for {r['point']}")
            continue
        for phase in RECORD["phases"]:
            data = r.get(phase)
            if data is None:
                if phase == "measured" or warmup:
                    ctx.fail("reference", f"{r['job']} seq {r['seq']} {r['arm']}: no {phase} run")
                continue
            if not check_natural.is_natural(plan, r):   # a natural arm runs its own exits
                _check_phase(ctx, r, phase, data, ref)
        _check_coverage_trace(ctx, r)
        new_captures = {k: n for k, n in r["measured"]["graphs"].items() if k.endswith("captures") and n}
        if warmup and new_captures:
            ctx.fail("captures", f"{r['job']} seq {r['seq']} {r['arm']}: {new_captures} in the measured run")
    _check_graph_coverage(ctx, [r for r in records if not check_natural.is_natural(plan, r)])
    return len(ctx.discrepancies) == before


def _first_difference(got: list, want: list) -> tuple[int, object, object]:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return i, got[i] if i < len(got) else "<end>", want[i] if i < len(want) else "<end>"


def _check_phase(ctx: Audit, r: dict, phase: str, data: dict, ref: dict) -> None:
    frozen = {q["request_id"]: q for q in ref["schedule"]["requests"]}
    where = f"{r['job']} seq {r['seq']} {r['point']} {r['comparison']} pair {r['pair']} arm {r['arm']!r} {phase}"
    if set(data["outputs"]) != set(frozen):
        ctx.fail("reference", f"{where}: requests {sorted(data['outputs'])} != frozen {sorted(frozen)}")
    for rid in sorted(set(data["outputs"]) & set(frozen)):
        for field, kind in (("token_ids", "tokens"), ("exit_depths", "exit_depths")):
            got, want = data["outputs"][rid][field], frozen[rid][field]
            if got != want:
                i, g, w = _first_difference(got, want)
                ctx.fail(kind, f"{where} request {rid!r} position {i}: {g} != frozen {w}")
        ctx.count("requests_vs_reference")
    for key in RECORD["work_keys"]:
        if key in ref["work"] and data["work"].get(key) != ref["work"][key]:
            ctx.fail("work", f"{where}: {key} {data['work'].get(key)} != reference {ref['work'][key]}")
    trace = ref["schedule"].get("trace_sha256")
    if data.get("trace_sha256") is not None and trace is not None and data["trace_sha256"] != trace:
        ctx.fail("trace", f"{where}: row trace differs from the frozen schedule")


def _check_coverage_trace(ctx: Audit, r: dict) -> None:
    """The record's coverage counts are of the rows that ran (the checker's ``coverage`` finding)."""
    cov, trace = r.get("coverage"), r["measured"].get("trace_sha256")
    if cov is not None and trace is not None and cov["trace_sha256"] != trace:
        ctx.fail("coverage", f"{r['job']} seq {r['seq']} {r['arm']}: coverage was derived from a row trace "
                             "other than the measured run's")


def _check_graph_coverage(ctx: Audit, records: list[dict]) -> None:
    """Both arms of a pair with the same Graph settings replay and fall back equally often."""
    pairs: dict[tuple, list[dict]] = {}
    for r in records:
        pairs.setdefault((r["job"], r["point"], r["comparison"], r["pair"]), []).append(r)
    for (job, point, comp, pair), members in pairs.items():
        if len(members) != 2:
            continue
        a, b = members
        if any(a["arm_config"].get(k) != b["arm_config"].get(k) for k in ("cuda_graphs", "graph_cache_size")):
            continue
        ga, gb = a["measured"]["graphs"], b["measured"]["graphs"]
        for key in sorted(k for k in set(ga) | set(gb) if k.endswith(("replays", "fallbacks"))):
            if ga.get(key) != gb.get(key):
                ctx.fail("graph_coverage", f"{job} {point} {comp} pair {pair}: {key} {a['arm']} "
                                           f"{ga.get(key)} != {b['arm']} {gb.get(key)}")


def check_coverage(ctx: Audit, plan: dict, records: list[dict], refs: dict) -> None:
    """Every record's coverage is what the auditor derives from the frozen schedule and its arm."""
    with_cov = [r for r in records if "coverage" in r]
    if with_cov and len(with_cov) != len(records):
        ctx.fail("coverage", f"{len(with_cov)} of {len(records)} records carry coverage counts; a bundle's "
                             "records all do or none")
    planes = plan["checkpoint"]["model_config"]["total_ut_steps"]
    derived: dict[tuple, dict] = {}
    for r in with_cov:
        ref = refs.get(r["point"])
        if ref is None:
            continue  # named by the reference check
        own = check_natural.is_natural(plan, r)   # coverage of its own exits (format 5)
        key = (r["job"], r["seq"]) if own else (r["point"], r["arm"])
        schedule = check_natural.own_schedule(r, ref["schedule"]) if own else ref["schedule"]
        if key not in derived:
            derived[key] = coverage.coverage(schedule, r["arm_config"], planes, r.get("schema", 1))
            if derived[key]["trace_sha256"] != schedule.get("trace_sha256"):
                ctx.fail("coverage", f"{r['point']} {'seq ' + str(r['seq']) if own else ''}: the replay scheduling "
                                     "rules do not reproduce the row trace, so no coverage count can be vouched for")
        for path, got, want in field_diffs(r["coverage"], derived[key], "coverage"):
            ctx.fail("coverage", f"record {r['job']} seq {r['seq']} ({r['arm']}): {path} is "
                                 f"{plain(got) if got is not ABSENT else 'missing'}, the frozen schedule gives "
                                 f"{want if want is not ABSENT else 'no such count'}")
        ctx.count("coverage_records")
