"""The online serving track (format 5), re-derived from the raw per-request timestamps.

A bundle whose plan.json has ``online`` holds one raw record per online run (online/<device>/*.json).
From the plan and those records alone this module re-derives: the trace (seeded unit Poisson arrivals
and their sha256) and the balanced order; each record's place in that order, its capacity (the
calibration run's completed requests per second) and rate, and every open-loop request's planned
arrival (unit arrival / rate); every request's TTFT, end-to-end latency, TPOT and inter-token gaps
(from the planned arrival); every run's percentiles, throughput and goodput against the SLO (declared,
or the contract's ``online.slo_factor`` x the calibration run's p99s); the paired medians per rate; and the
served tokens against the frozen reference. ``online/requests.parquet`` and ``online/summary.json`` must equal that
cell for cell and leaf for leaf, and :func:`report_lines` renders the report's Online section from it.
The rules are the contract's ``online`` section (bundle_format.json); nothing of the harness is used.
"""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pandas as pd

from . import check_settings, contract
from .check_plan import first_arms, order_rule
from .context import Audit
from .values import field_diffs, plain, same

SPEC = contract.FORMAT["online"]
R = SPEC["report"]
SLO_FACTOR = SPEC["slo_factor"]   # a derived SLO's, whatever factor the bundle claims


# ------------------------------------------------------------------------------------------ plan

def unit_arrivals(n: int, seed: int) -> list[float]:
    """The unit trace by the contract's ``online.trace_rule`` (format 14 on): exponential gaps -ln(u), u from
    SHA-256 of ``online.trace_message``, 53 bits at a time."""
    out = [0.0]
    for i in range(1, n):
        digest = hashlib.sha256(SPEC["trace_message"].format(seed=seed, index=i).encode("utf-8")).digest()
        out.append(out[-1] - math.log(((int.from_bytes(digest[:8], "big") >> 11) + 1) / 2.0 ** 53))
    return out


def numpy_unit_arrivals(n: int, seed: int) -> list[float]:
    """The unit trace of formats 5 to 13 (``online.trace_rule_before``), by the installed numpy's Generator."""
    return [0.0] + np.cumsum(np.random.default_rng(seed).exponential(1.0, size=n - 1)).tolist()


def expected_order(on: dict, order_seed: int, version: int) -> list[dict]:
    """The online order by the contract's ``order_rule``, each rate's first arms by the offline order's rule of the
    bundle's ``version`` (:func:`.check_plan.first_arms`)."""
    order = [{"seq": 0, "kind": "calibration", "arm": on["baseline"], "rate_index": None, "rate_multiple": None,
              "pair": None, "position": None, "slot": None}]
    n = on["pairs"]
    for ri, rate in enumerate(on["rates"]["multiples"]):
        firsts = first_arms(n, [order_seed, ri, 1], version)
        for pair in range(n):
            first = firsts[pair]
            for slot, pos in enumerate((first, "candidate" if first == "baseline" else "baseline")):
                order.append({"seq": len(order), "kind": "arm", "arm": on[pos], "rate_index": ri,
                              "rate_multiple": rate, "pair": pair, "position": pos, "slot": slot})
    return order


def expected_requests(on: dict, point: dict) -> list[dict]:
    """plan.json ``online.requests``: request i is the plan point's i-th request (its id and prompt), for the first
    ``num_requests`` of them."""
    return [{"index": i, "prompt_index": r["prompt_index"], "reference_request_id": r["request_id"]}
            for i, r in enumerate(point["requests"][:on["num_requests"]])]


def check_plan(ctx: Audit, plan: dict) -> None:
    """plan.json online: its fields, the trace and its sha256, the point, the requests and the order."""
    on = plan["online"]
    problem = contract.fields_problem(on, SPEC["plan_fields"], "plan.json: online.", closed=True) \
        or contract.fields_problem(on["trace"], SPEC["trace_fields"], "plan.json: online.trace.", closed=True)
    if problem is not None:
        ctx.fail("online", problem)
        return
    stored = on["trace"]["unit_arrivals_s"]
    if ctx.version >= SPEC["trace_rule_since"]:   # re-derived with this platform's log: equal as floats are
        unit = unit_arrivals(on["num_requests"], on["trace"]["seed"])
        sound = all(contract.is_kind(t, "number") for t in stored) and same(stored, unit)
    else:   # JSON floats round-trip exactly, and the writer's numpy drew them
        sound = stored == numpy_unit_arrivals(on["num_requests"], on["trace"]["seed"])
    if not sound:
        rule = "online.trace_rule" if ctx.version >= SPEC["trace_rule_since"] else "online.trace_rule_before"
        ctx.fail("online", f"plan.json online.trace.unit_arrivals_s is not the seeded Poisson trace of its seed "
                           f"(the contract's {rule})")
    sha = hashlib.sha256(json.dumps([float(t) for t in on["trace"]["unit_arrivals_s"]]).encode()).hexdigest()
    if sha != on["trace"]["sha256"]:
        ctx.fail("online", f"plan.json online.trace.sha256 is {on['trace']['sha256']}, the trace hashes to {sha}")
    point = next((p for p in plan["points"] if p["key"] == on["point"]), None)
    if point is None or point["max_num_seqs"] != on["max_num_seqs"] or on["num_requests"] > point["num_requests"]:
        ctx.fail("online", f"plan.json online.point {on['point']!r} is not a plan point of B{on['max_num_seqs']} "
                           f"with at least {on['num_requests']} requests")
    if point is not None and on["requests"] != expected_requests(on, point):
        ctx.fail("online", "plan.json online.requests are not the point's first requests (request i = the point's "
                           "request r<i:04d> on its prompt)")
    if point is not None and on["max_tokens"] != point["output_len"]:
        ctx.fail("online", f"plan.json online.max_tokens is {on['max_tokens']}, point {on['point']} has "
                           f"output_len {point['output_len']}")
    if on["device"] != plan["devices"][0]["name"]:
        ctx.fail("online", f"plan.json online.device is {on['device']!r}, not the first device")
    if not same(on["order"], expected_order(on, plan["config"]["order_seed"], ctx.version)):
        ctx.fail("online", "plan.json online.order is not the seeded balanced order of its rates and pairs (the "
                           f"contract's {order_rule(ctx.version)})")
    if on["slo"].get("source") == "calibration" and not same(on["slo"].get("factor"), SLO_FACTOR):
        ctx.fail("online", f"plan.json online.slo.factor is {on['slo'].get('factor')!r}; the contract derives an SLO as "
                           f"online.slo_factor = {SLO_FACTOR!r} x the calibration run's p99 TTFT and TPOT")
    for path, got, want in field_diffs({k: on[k] for k in SPEC["plan_fields"] if k not in ("order", "requests")},
                                       configured(plan), "online"):
        if want is not contract.ABSENT:   # fields the config does not set are checked above
            ctx.fail("online", f"plan.json {path} is {got!r}, the config gives {want!r}")
    ctx.count("online_plan")


def configured(plan: dict) -> dict:
    """plan.json ``online`` as ``config.online`` asks for it (a null point, baseline or candidate: the first point's,
    the first comparison's): its point, size, trace seed, rates, arms, pairs, SLO (declared, or derived by its
    factor, which the config does not set: :func:`check_plan` holds it to the contract's), warmup and bounds, and the
    calibration run (the baseline, closed loop at the point's B)."""
    c, on = plan["config"]["online"], plan["online"]
    first = plan["config"]["comparisons"][0]
    baseline = first["baseline"] if c["baseline"] is None else c["baseline"]
    slo = {"source": "declared", "ttft_s": c["slo_ttft_s"], "tpot_s": c["slo_tpot_s"], "factor": None} \
        if c["slo_ttft_s"] is not None else {"source": "calibration", "ttft_s": None, "tpot_s": None,
                                             "factor": contract.ABSENT}
    return {"point": plan["points"][0]["key"] if c["point"] is None else c["point"], "num_requests": c["num_requests"],
            "trace": {"seed": c["trace_seed"]}, "rates": {"unit": "capacity", "multiples": c["rates"]},
            "baseline": baseline, "candidate": first["candidate"] if c["candidate"] is None else c["candidate"],
            "pairs": c["pairs"], "slo": slo, "warmup_requests": c["warmup_requests"],
            "max_duration_s": c["max_duration_s"], "health_timeout_s": c["health_timeout_s"],
            "calibration": {"arm": baseline, "mode": "closed", "concurrency": on["max_num_seqs"]}}


# --------------------------------------------------------------------------------------- records

def record_stem(item: dict) -> str:
    stem = f"{item['seq']:05d}-{item['kind']}-{item['arm']}"
    return stem if item["kind"] == "calibration" else f"{stem}-r{item['rate_index']}-p{item['pair']}"


def device_sessions(plan: dict, children: list) -> list[str]:
    """The ids of the online device's sessions in children.json, in order: its first (the device's name), then
    any restart's or resume's, each of which runs the online runs its predecessors left unrecorded."""
    device = plan["online"]["device"]
    return [c.get("session", c.get("name")) for c in children if isinstance(c, dict) and c.get("name") == device]


def load_records(ctx: Audit, plan: dict, sessions: list[str]) -> list[dict]:
    """Every online record that parses, has the contract's fields and sits at its order item's path."""
    on, out = plan["online"], []
    order = {o["seq"]: o for o in on["order"]}
    for path in sorted((ctx.bundle / "online").glob("*/*.json")):
        rel = path.relative_to(ctx.bundle).as_posix()
        try:
            rec = json.loads(path.read_text())
        except ValueError as exc:
            ctx.fail("online", f"{rel} could not be read: {exc}")
            continue
        problem = record_problem(rec, rel)
        item = order.get(rec.get("seq")) if problem is None else None
        if problem is None and (item is None or rel != f"online/{on['device']}/{record_stem(item)}.json"
                                or rec["job"] != on["device"]
                                or any(rec[k] != item[k] for k in item)):
            problem = f"{rel} is not at its place in plan.json online.order"
        if problem is not None:
            ctx.fail("online", problem)
            continue
        check_as_planned(ctx, plan, rec, rel, sessions)
        out.append(rec)
    return sorted(out, key=lambda r: r["seq"])


def record_problem(rec, rel: str) -> str | None:
    """Why ``rec`` is no online record of the contract's fields, each of its requests one too; or None."""
    if not isinstance(rec, dict):
        return f"{rel}: a JSON {type(rec).__name__}, not an object"
    problem = contract.fields_problem(rec, SPEC["record_fields"], f"{rel}: ", SPEC["record_optional"], closed=True)
    for i, q in enumerate(rec["requests"] if problem is None else []):
        problem = problem or (contract.fields_problem(q, SPEC["request_fields"], f"{rel}: requests[{i}].", closed=True)
                              if isinstance(q, dict) else f"{rel}: requests[{i}] is {q!r}, not an object")
    return problem


def check_as_planned(ctx: Audit, plan: dict, rec: dict, rel: str, sessions: list[str]) -> None:
    """A record at its place ran where and what the plan says: in a session of its device (children.json), and
    its arm's planned config, as a raw arm record must (check_plan); the engine_settings checks hold the settings
    to that config (check_settings.check_online)."""
    device, arm = plan["online"]["device"], rec["arm"]
    if rec["session"] not in sessions:
        ctx.fail("online", f"{rel}: session is {rec['session']!r}, not a session of device {device!r} in "
                           f"children.json ({', '.join(sessions) or 'none'}), the sessions that run the online track")
    for path, got, want in field_diffs(rec["arm_config"], plan["config"]["arms"].get(arm, {}), "arm_config"):
        ctx.fail("online", f"{rel}: {path} is {'missing' if got is contract.ABSENT else repr(got)}, plan.json "
                           f"config.arms.{arm} says {'nothing' if want is contract.ABSENT else repr(want)}")
    for key, want in _planned_run(plan["online"], rec["kind"]).items():
        if not same(rec[key], want):
            ctx.fail("online", f"{rel}: {key} is {rec[key]!r}, plan.json online gives the {rec['kind']} run {want!r}")


def _planned_run(on: dict, kind: str) -> dict:
    """What plan.json ``online`` sets of a run of ``kind``: the calibration run is closed loop at its concurrency and
    has no capacity or rate (it measures the capacity); an arm run is open loop (its capacity and rate:
    :func:`check_arrivals`)."""
    calibration = kind == "calibration"
    fixed = {"point": on["point"], "mode": "closed" if calibration else "open",
             "concurrency": on["calibration"]["concurrency"] if calibration else None,
             "warmup_requests": on["warmup_requests"], "max_duration_s": on["max_duration_s"]}
    return {**fixed, "capacity_rps": None, "rate_rps": None} if calibration else fixed


def _timestamps_problem(q: dict) -> str | None:
    """Why a request's times cannot come from one run's clock (time.perf_counter: a request is planned, sent, streams
    its tokens in order and ends, each time read after the one before), or None. Written so that a NaN fails too."""
    t, planned, sent, end = q["token_times_s"], q["planned_s"], q["sent_s"], q["end_s"]
    if len(t) != len(q["token_ids"]) or not all(contract.is_kind(x, "number") for x in t):
        return f"{len(t)} token_times_s for {len(q['token_ids'])} token_ids: one time, a number, per token"
    back = next((i for i in range(1, len(t)) if not t[i - 1] <= t[i]), None)
    if back is not None:
        return f"token_times_s go back in time at token {back} ({t[back - 1]} s, then {t[back]} s)"
    if not t:
        return None if sent is None or sent <= end else f"it was sent at {sent} s, after its end_s {end}"
    if not planned <= t[0]:
        return f"its first token at {t[0]} s comes before its planned arrival (planned_s {planned})"
    if sent is None or not sent <= t[0]:
        return f"its first token at {t[0]} s comes before it was sent (sent_s {sent})"
    if not t[-1] <= end:
        return f"its last token at {t[-1]} s comes after its end_s {end}"
    return None


def check_timestamps(ctx: Audit, records: list[dict]) -> None:
    """Each request's raw times in the order one clock gives them (:func:`_timestamps_problem`): every figure is
    re-derived from those times, so forged ones (a negative TTFT or inter-token gap, fewer times than tokens)
    agree with a bundle republished from them; they do not agree with a run that happened."""
    for rec in records:
        for q in rec["requests"]:
            problem = _timestamps_problem(q)
            if problem is not None:
                ctx.fail("online", f"record seq {rec['seq']} request {q['index']}: {problem}")
        ctx.count("online_request_timestamps", len(rec["requests"]))


def latencies(q: dict) -> dict:
    """One request's figures, from the planned arrival (contract ``online.requests_columns``)."""
    t = q["token_times_s"]
    ok = q["error"] is None
    return {"ttft_s": t[0] - q["planned_s"] if ok and t else None,
            "e2e_latency_s": q["end_s"] - q["planned_s"] if ok else None,
            "tpot_s": (t[-1] - t[0]) / (len(t) - 1) if ok and len(t) > 1 else None,
            "itl_s": [b - a for a, b in zip(t, t[1:])] if ok else []}


def _pct(values: list[float], q: float, method: str) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q, method=method)) if values else None


def _censored(values: list[float], failed: int, q: float, method: str) -> float | None:
    """Contract ``online.about`` (failed requests in the percentiles): the q-th percentile of ``values`` with
    ``failed`` values above all of them; None where it interpolates towards one of those (two placements of
    them disagree) or without values."""
    if not values or not failed:
        return _pct(values, q, method)
    top = max(values)
    low = _pct(list(values) + [top] * failed, q, method)
    return low if low == _pct(list(values) + [top + abs(top) + 1e6] * failed, q, method) else None


def good(lat: dict, slo: dict | None) -> bool:
    return (slo is not None and lat["ttft_s"] is not None and lat["ttft_s"] <= slo["ttft_s"]
            and (lat["tpot_s"] is None or lat["tpot_s"] <= slo["tpot_s"]))


def run_figures(rec: dict, slo: dict | None, method: str, censored: bool = True) -> dict:
    """One online run's figures; ``censored`` (format ``online.censored_since``, 13): failed requests count in the TTFT
    and TPOT percentiles (:func:`_censored`), else those percentiles are over the completed requests only."""
    done = [(q, latencies(q)) for q in rec["requests"] if q["error"] is None]
    dur = max((q["end_s"] for q in rec["requests"]), default=0.0)

    def rate(n):
        return n / dur if dur > 0 else None
    ttft = [lat["ttft_s"] for _, lat in done if lat["ttft_s"] is not None]
    itl = [g for _, lat in done for g in lat["itl_s"]]
    tpot = [lat["tpot_s"] for _, lat in done if lat["tpot_s"] is not None]
    n_good = sum(good(lat, slo) for _, lat in done)
    failed = len(rec["requests"]) - len(done)

    def pct(values, q):
        return _censored(values, failed, q, method) if censored else _pct(values, q, method)
    return {"seq": rec["seq"], "kind": rec["kind"], "arm": rec["arm"], "rate_multiple": rec["rate_multiple"],
            "rate_rps": rec["rate_rps"], "pair": rec["pair"], "position": rec["position"],
            "completed": len(done), "failed": failed, "duration_s": dur,
            "p50_ttft_s": pct(ttft, 50), "p99_ttft_s": pct(ttft, 99),
            "p50_itl_s": _pct(itl, 50, method), "p99_itl_s": _pct(itl, 99, method),
            "p99_tpot_s": pct(tpot, 99),
            "throughput_tokens_per_s": rate(sum(len(q["token_ids"]) for q, _ in done)),
            "request_rate_rps": rate(len(done)), "good": n_good if slo is not None else None,
            "goodput_rps": rate(n_good) if slo is not None else None}


def check_arrivals(ctx: Audit, plan: dict, records: list[dict], capacity: float | None) -> None:
    """Each arm run's capacity is the calibration's, its rate multiple x capacity, and each request is
    planned at unit arrival / rate (open loop) as the plan's request i on prompt i."""
    on = plan["online"]
    unit = on["trace"]["unit_arrivals_s"]
    for rec in records:
        idx = [(q["index"], q["prompt_index"]) for q in rec["requests"]]
        if idx != [(r["index"], r["prompt_index"]) for r in on["requests"]]:
            ctx.fail("online", f"record seq {rec['seq']}: its requests are not the plan's online requests in order")
        if rec["kind"] == "calibration":
            continue
        if not same(rec["capacity_rps"], capacity):
            ctx.fail("online", f"record seq {rec['seq']}: capacity_rps {rec['capacity_rps']} is not the calibration "
                               f"run's {capacity}")
            continue
        rate = rec["rate_multiple"] * capacity
        if not same(rec["rate_rps"], rate):
            ctx.fail("online", f"record seq {rec['seq']}: rate_rps {rec['rate_rps']} != rate_multiple x capacity = {rate}")
        for q in rec["requests"]:
            if not same(q["planned_s"], unit[q["index"]] / rate):
                ctx.fail("online", f"record seq {rec['seq']} request {q['index']}: planned_s {q['planned_s']} is not "
                                   f"its trace arrival {unit[q['index']] / rate}")
        ctx.count("online_arrivals", len(rec["requests"]))


# --------------------------------------------------------------------------------------- summary

def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.median(vals)) if vals else None


def rate_entries(on: dict, runs: list[dict], censored: bool = True) -> list[dict]:
    """Per rate the paired medians; ``censored`` (format 13): a median over a null value is null, else (earlier
    formats) the medians are over the pairs whose value is not null."""
    out = []
    for ri, multiple in enumerate(on["rates"]["multiples"]):
        at = [r for r in runs if r["kind"] == "arm" and r["rate_multiple"] == multiple]
        by_pair: dict = {}
        for r in at:
            by_pair.setdefault(r["pair"], {})[r["position"]] = r
        pairs = sorted(p for p, both in by_pair.items() if len(both) == 2)
        figures = {}
        for fig in SPEC["paired_figures"]:
            base = [by_pair[p]["baseline"][fig] for p in pairs]
            cand = [by_pair[p]["candidate"][fig] for p in pairs]
            ratios = [c / b for b, c in zip(base, cand) if b and c is not None]
            # a null value (a percentile that reached a failed request) is unknown: no median over it, no ratio median
            unknown_base, unknown_cand = censored and None in base, censored and None in cand
            figures[fig] = {"baseline_median": None if unknown_base else _median(base),
                            "candidate_median": None if unknown_cand else _median(cand), "ratios": ratios,
                            "ratio_median": None if unknown_base or unknown_cand else _median(ratios)}
        out.append({"rate_index": ri, "rate_multiple": multiple, "rate_rps": at[0]["rate_rps"] if at else None,
                    "baseline": on["baseline"], "candidate": on["candidate"], "pairs": pairs, "figures": figures})
    return out


def token_check(ctx: Audit, on: dict, records: list[dict]) -> dict:
    ref = {r["request_id"]: r["token_ids"] for r in
           json.loads((ctx.bundle / "references" / f"{on['point']}.schedule.json").read_text())["requests"]}
    checked = failed = 0
    mismatches = []
    for rec in records:
        first = None
        for q in rec["requests"]:
            if q["error"] is not None:
                failed += 1
                continue
            checked += 1
            rid, got = f"r{q['index']:04d}", list(q["token_ids"])
            want = ref[rid]
            pos = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if pos is None and len(got) != len(want):
                pos = min(len(got), len(want))
            if pos is not None and first is None:
                first = {"seq": rec["seq"], "arm": rec["arm"], "request_index": q["index"], "reference_request_id": rid,
                         "position": pos, "want": want[pos] if pos < len(want) else "<end>",
                         "got": got[pos] if pos < len(got) else "<end>"}
        if first is not None:
            mismatches.append(first)
    return {"ok": not mismatches, "requests_checked": checked, "requests_failed": failed, "mismatches": mismatches}


def _slo(declared: dict, calib_figs: dict | None) -> dict | None:
    """The SLO of plan.json ``online.slo``: declared, or the contract's ``online.slo_factor`` x the calibration run's
    p99 TTFT and TPOT (re-derived from its raw records); None without a calibration run or where it has neither p99
    (no request, or none of two tokens, completed)."""
    if declared["source"] == "declared":
        return {"ttft_s": declared["ttft_s"], "tpot_s": declared["tpot_s"]}
    if calib_figs is None or calib_figs["p99_ttft_s"] is None or calib_figs["p99_tpot_s"] is None:
        return None
    return {"ttft_s": SLO_FACTOR * calib_figs["p99_ttft_s"], "tpot_s": SLO_FACTOR * calib_figs["p99_tpot_s"]}


def derived(ctx: Audit, plan: dict, records: list[dict]) -> tuple[dict, dict | None]:
    """(the re-derived online/summary.json, the SLO its figures use)."""
    on = plan["online"]
    method = on["percentile_method"]
    calib = next((r for r in records if r["kind"] == "calibration"), None)
    censored = ctx.version >= SPEC["censored_since"]
    calib_figs = run_figures(calib, None, method, censored) if calib else None
    slo = _slo(on["slo"], calib_figs)
    capacity = calib_figs["request_rate_rps"] if calib_figs else None
    check_arrivals(ctx, plan, records, capacity)
    runs = [run_figures(r, slo, method, censored) for r in records]
    summary = {"schema_version": SPEC["schema_version"],
               "status": "complete" if len(records) == len(on["order"]) else "incomplete",
               "runs_planned": len(on["order"]), "runs_recorded": len(records), "capacity_rps": capacity,
               "slo": {**on["slo"], **(slo or {})}, "percentile_method": method, "runs": runs,
               "rates": rate_entries(on, runs, censored), "checks": token_check(ctx, on, records)}
    return summary, slo


def expected_rows(records: list[dict], slo: dict | None) -> list[dict]:
    rows = []
    for rec in records:
        for q in rec["requests"]:
            lat = latencies(q)
            rows.append({"job": rec["job"], "seq": rec["seq"], "kind": rec["kind"], "arm": rec["arm"],
                         "rate_multiple": rec["rate_multiple"], "rate_rps": rec["rate_rps"], "pair": rec["pair"],
                         "position": rec["position"], "request_index": q["index"], "prompt_index": q["prompt_index"],
                         "planned_s": q["planned_s"], "sent_s": q["sent_s"],
                         "first_token_s": q["token_times_s"][0] if q["token_times_s"] else None, "end_s": q["end_s"],
                         **lat, "tokens": len(q["token_ids"]), "finish_reason": q["finish_reason"], "error": q["error"],
                         "meets_slo": q["error"] is None and good(lat, slo)})
    return rows


def check_table(ctx: Audit, rows: list[dict]) -> None:
    """online/requests.parquet: its declared columns, and every cell the re-derived one."""
    rel = "online/requests.parquet"
    df = pd.read_parquet(ctx.bundle / rel)
    declared = [c["name"] for c in SPEC["requests_columns"]]
    if list(df.columns) != declared:
        ctx.fail(rel, f"has columns {list(df.columns)}, the contract declares {declared}")
        return
    if len(df) != len(rows):
        ctx.fail(rel, f"has {len(df)} rows, the raw online records give {len(rows)}")
        return
    for got, want in zip(df.to_dict("records"), rows):
        key = f"row {want['job']} seq {want['seq']} request {want['request_index']}"
        for col in declared:
            if not same(plain(got[col]), want[col]):
                ctx.fail(rel, f"{key}: {col} is {plain(got[col])!r}, re-derived from the raw timestamps {want[col]!r}")
        ctx.count("online_request_rows")


def check_pair_sessions(ctx: Audit, records: list[dict]) -> None:
    """A pair's two online runs are measured back to back in one session (a resume measures again a pair whose other
    run was not recorded, the lone run set aside: format 15 keeps it under superseded/), as a pair of arm runs is."""
    pairs: dict[tuple, list[dict]] = {}
    for rec in records:
        if rec["kind"] == "arm":
            pairs.setdefault((rec["rate_index"], rec["pair"]), []).append(rec)
    for (ri, pair), recs in pairs.items():
        if len({r["session"] for r in recs}) > 1:
            where = ", ".join(f"{r['session']} (seq {r['seq']})" for r in recs)
            ctx.fail("online", f"pair {pair} at rate index {ri} ran in sessions {where}; a pair's two runs are "
                               "measured back to back in one session")


def check_session_order(ctx: Audit, records: list[dict], sessions: list[str]) -> None:
    """The online runs follow the plan's order through the device's sessions: a session runs only the runs its
    predecessors left, so a run of a later seq never names an earlier session than a run before it (``records``
    by seq, ``sessions`` in children.json order; a record naming none of them is named by its own check)."""
    rank = {name: i for i, name in enumerate(sessions)}
    latest = None
    for rec in records:
        if rec["session"] not in rank:
            continue
        if latest is not None and rank[rec["session"]] < rank[latest["session"]]:
            ctx.fail("online", f"seq {rec['seq']} ran in session {rec['session']}, before seq {latest['seq']} in "
                               f"{latest['session']}; a later session runs only the online runs an earlier one left")
        if latest is None or rank[rec["session"]] >= rank[latest["session"]]:
            latest = rec


def check(ctx: Audit, plan: dict, children: list) -> None:
    """Every check of the module docstring on a bundle with an online track (nothing without one)."""
    if not plan.get("online"):
        return
    check_plan(ctx, plan)
    sessions = device_sessions(plan, children)
    records = load_records(ctx, plan, sessions)
    check_pair_sessions(ctx, records)
    check_session_order(ctx, records, sessions)
    check_timestamps(ctx, records)
    ctx.online_records = records   # format 10: their engine_settings (check_settings.check_online, report_lines)
    ctx.count("online_records", len(records))
    summary, slo = derived(ctx, plan, records)
    check_table(ctx, expected_rows(records, slo))
    got = json.loads((ctx.bundle / "online" / "summary.json").read_text())
    for path, g, w in field_diffs(got, summary, ""):
        ctx.fail("online/summary.json", f"{path} is {g!r}, re-derived from the raw timestamps {w!r}")
    # each session of the device runs the online runs left unrecorded, so its last one completing leaves none
    last = [c for c in children if isinstance(c, dict) and c.get("name") == plan["online"]["device"]][-1:]
    if last and last[0].get("state") == "completed" and summary["status"] != "complete":
        ctx.fail("online", f"session {sessions[-1]} completed but {len(records)} of {len(plan['online']['order'])} "
                           "online runs are recorded")
    ctx.online_summary = summary   # for the report's Online section (report_lines)


# ---------------------------------------------------------------------------------------- report

def _num(v, t: str = R["number"]) -> str:
    return R["na"] if v is None else t.format(v)


def report_lines(ctx: Audit, plan: dict) -> list[str]:
    """The Online section of report.md from the re-derived summary (none without an online track); from format 10
    it ends its runs with what their servers' engines ran with (check_settings.online_report_lines)."""
    s = ctx.online_summary
    if not plan.get("online") or s is None:
        return []
    on, slo = plan["online"], s["slo"]
    src = R["source"][slo["source"]]
    lines = ["", R["heading"], ""]
    if s["status"] != "complete":
        lines += [R["incomplete"].format(recorded=s["runs_recorded"], planned=s["runs_planned"]), ""]
    lines += [R["trace"].format(num_requests=on["num_requests"], max_tokens=on["max_tokens"], point=on["point"],
                                seed=on["trace"]["seed"], sha256=on["trace"]["sha256"], capacity=_num(s["capacity_rps"]),
                                arm=on["calibration"]["arm"], concurrency=on["calibration"]["concurrency"],
                                ttft=_num(slo.get("ttft_s")), tpot=_num(slo.get("tpot_s")), method=s["percentile_method"],
                                source=src.format(factor=slo["factor"]) if slo["source"] == "calibration" else src), ""]
    cols = R["runs_columns"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in s["runs"]:
        lines.append(R["runs_row"].format(
            seq=r["seq"], arm=r["arm"], completed=r["completed"], failed=r["failed"],
            rate_multiple=R["closed"] if r["rate_multiple"] is None else _num(r["rate_multiple"], R["multiple"]),
            rate_rps=R["closed"] if r["rate_rps"] is None else _num(r["rate_rps"]),
            **{k: _num(r[k]) for k in ("p50_ttft_s", "p99_ttft_s", "p99_itl_s", "throughput_tokens_per_s", "goodput_rps")}))
    for rate in s["rates"]:
        b, c = rate["baseline"], rate["candidate"]
        cols = [h.format(baseline=b, candidate=c) for h in R["paired_columns"]]
        lines += ["", R["paired_subheading"].format(rate_multiple=_num(rate["rate_multiple"], R["multiple"]),
                                                    rate_rps=_num(rate["rate_rps"]), baseline=b, candidate=c,
                                                    n=len(rate["pairs"])), "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += [R["paired_row"].format(figure=f, baseline_median=_num(v["baseline_median"]),
                                         candidate_median=_num(v["candidate_median"]), ratio_median=_num(v["ratio_median"]))
                  for f, v in rate["figures"].items()]
    ch = s["checks"]
    line = R["check_ok"].format(checked=ch["requests_checked"], failed=ch["requests_failed"]) if ch["ok"] else \
        R["check_failed"].format(n=len(ch["mismatches"]), checked=ch["requests_checked"], failed=ch["requests_failed"],
                                 **ch["mismatches"][0])
    return lines + ["", line, *check_settings.online_report_lines(ctx, plan, ctx.online_records), "", R["plot"]]
