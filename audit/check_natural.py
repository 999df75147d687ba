"""The natural-schedule track (format 5), re-derived from the traced runs and raw records alone.

A comparison of the plan's config with ``track: natural`` runs each arm on its own exits. The auditor
checks, with its own code (nothing of the harness):

- plan ``natural``: the natural comparisons, each one's floor (``natural.floor``, else the natural A/A
  of its baseline arm, else any natural A/A, else none), the epsilons, the rule's words (the contract's
  ``documents.plan.natural_rule``) and one traced run per point, comparison and position;
- each ``natural/<trace>.json``: its fields, its arm and policy as planned, one output per request of
  the point, one survival list and one top-2 pair per token, a survival per loop the token ran;
- the records of natural comparisons are not held to the frozen reference (:func:`is_natural`); their
  coverage is re-derived from their own measured exits (:func:`own_schedule`);
- ``tables/natural.parquet``, ``tables/natural_divergences.parquet`` and ``summary.json`` ``natural``
  equal the figures derived here: divergent requests, each first divergence (position, the first loop
  whose exit test ``r >= min_loops and 1 - S_r >= threshold`` differs, |1 - S_r - threshold| of each arm
  there, top-1 - top-2 logit of each arm at the first different token, the larger margin against its
  epsilon), runs reproducing their traced run, warmup/measured mismatches, the work beside the time
  ratios and the verdict of the declared rule;
- the report's natural section (:func:`report_lines`), from the derived summary.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import pandas as pd

from . import contract
from .context import Audit
from .values import field_diffs, plain

PLAN = contract.DOCS["plan"]
TRACE = contract.DOCS["trace"]
SINCE = PLAN["fields_since"]["natural"]
R = contract.FORMAT["report"]["natural"]
SIDES = ("baseline", "candidate")


# --------------------------------------------------------------------------------------------- plan

def natural_comps(plan: dict) -> list[dict]:
    return [c for c in plan["config"]["comparisons"] if c.get("track") == "natural"]


def is_natural(plan: dict, record: dict) -> bool:
    """A record of a natural comparison (its own exits: not held to the frozen reference)."""
    return any(c["name"] == record["comparison"] for c in natural_comps(plan))


def _floor(cfg_floor, comps: list[dict], comp: dict):
    if cfg_floor is not None:
        return cfg_floor
    for pick in (lambda c: c["baseline"] == c["candidate"] == comp["baseline"],
                 lambda c: c["baseline"] == c["candidate"]):
        hit = [c["name"] for c in comps if pick(c)]
        if hit:
            return hit[0]
    return None


def expected_plan_entry(plan: dict) -> dict:
    cfg, comps = plan["config"], natural_comps(plan)
    nat = cfg["natural"]
    traces = []
    for pt in plan["points"]:
        for c in comps:
            for side in SIDES:
                traces.append({"point": pt["key"], "comparison": c["name"], "position": side, "arm": c[side],
                               "file": f"natural/{pt['key']}-{c['name']}-{side}.json"})
    return {"comparisons": [c["name"] for c in comps], "floors": {c["name"]: _floor(nat["floor"], comps, c)
                                                                  for c in comps},
            "gate_epsilon": nat["gate_epsilon"], "logit_epsilon": nat["logit_epsilon"],
            "rule": PLAN["natural_rule"].format(**nat), "traces": traces}


def check_plan_entry(ctx: Audit, plan: dict) -> None:
    """plan.json ``natural`` is what the config declares (format 5)."""
    if ctx.version < SINCE:
        return
    got = plan.get("natural")
    problem = contract.fields_problem(got if isinstance(got, dict) else {}, PLAN["natural_fields"],
                                      "plan.json natural.", closed=True)
    if problem is not None:
        ctx.fail("natural", problem)
        return
    for path, g, w in field_diffs(got, expected_plan_entry(plan), "plan.json natural"):
        ctx.fail("natural", f"{path} is {plain(g) if g is not contract.ABSENT else 'missing'}, the config gives "
                            f"{w if w is not contract.ABSENT else 'nothing'}")


# ------------------------------------------------------------------------------------------- traces

def _trace_problem(doc: dict, entry: dict, plan: dict) -> str | None:
    problem = contract.fields_problem(doc, TRACE["fields"], "", closed=True)
    if problem is not None:
        return problem
    for key in ("point", "comparison", "position", "arm"):
        if doc[key] != entry[key]:
            return f"{key} is {doc[key]!r}, the plan lists {entry[key]!r}"
    cfg = plan["config"]
    if doc["arm_config"] != cfg["arms"][entry["arm"]] or doc["policy"] != cfg["exit"]["policy"]:
        return "its arm_config or policy is not the plan's"
    if doc["warmup"] != cfg["warmup"]:
        return f"warmup is {doc['warmup']!r}, the plan's is {cfg['warmup']!r}"
    point = next(p for p in plan["points"] if p["key"] == entry["point"])
    if sorted(doc["outputs"]) != sorted(q["request_id"] for q in point["requests"]):
        return "its requests are not the point's"
    for rid, out in sorted(doc["outputs"].items()):
        problem = contract.fields_problem(out, TRACE["output_fields"], f"outputs.{rid}.", closed=True)
        if problem is not None:
            return problem
        n = len(out["token_ids"])
        if not (len(out["exit_depths"]) == len(out["survival"]) == len(out["top2"]) == n):
            return f"request {rid}: token_ids, exit_depths, survival and top2 differ in length"
        # the first token comes from the prefill (every loop, no gate); each later one has S_r per loop run
        if any(len(s) != (0 if i == 0 else d) for i, (s, d) in enumerate(zip(out["survival"], out["exit_depths"]))):
            return f"request {rid}: a token's survival list does not have one S_r per loop it ran"
        if any(len(t) != 2 for t in out["top2"]):
            return f"request {rid}: a top2 entry is not two logits"
    return None


def load_traces(ctx: Audit, plan: dict) -> dict:
    """Every traced run the plan lists, checked; by (point, comparison, position)."""
    out = {}
    if ctx.version < SINCE or not isinstance(plan.get("natural"), dict):
        return out
    for entry in plan["natural"].get("traces", []):
        doc = ctx.read_json(entry["file"])
        if not isinstance(doc, dict):
            ctx.fail("natural", f"{entry['file']} is missing or unreadable")
            continue
        problem = _trace_problem(doc, entry, plan)
        if problem is not None:
            ctx.fail("natural", f"{entry['file']}: {problem}")
            continue
        out[entry["point"], entry["comparison"], entry["position"]] = doc
        ctx.count("natural_traces")
    return out


def own_schedule(record: dict, frozen: dict) -> dict:
    """The schedule a natural record's measured run followed, for its coverage: the point's frozen
    schedule (requests, prompt lengths, bounds, admission order) with the run's own tokens and exit
    depths; its row trace is the run's, which the replay rules must then reproduce."""
    outs = record["measured"]["outputs"]
    reqs = [{**q, **{k: outs.get(q["request_id"], {}).get(k, []) for k in ("token_ids", "exit_depths")}}
            for q in frozen["requests"]]
    return {**frozen, "requests": reqs, "trace_sha256": record["measured"].get("trace_sha256")}


# ------------------------------------------------------------------------------------------- derive

def _decided(s: float, r: int, ex: dict) -> bool:
    return ex["threshold"] < 1.0 and r >= ex["min_loops"] and 1.0 - s >= ex["threshold"]


def first_divergence(a: dict, b: dict, ex: dict, nat: dict) -> dict | None:
    """The first divergence of one request between two traced runs (see the module docstring)."""
    n = min(len(a["token_ids"]), len(b["token_ids"]))
    diff = [i for i in range(n) if (a["token_ids"][i], a["exit_depths"][i]) != (b["token_ids"][i], b["exit_depths"][i])]
    if not diff and len(a["token_ids"]) == len(b["token_ids"]):
        return None
    pos = diff[0] if diff else n
    is_exit = pos < n and a["exit_depths"][pos] != b["exit_depths"][pos]
    out = dict.fromkeys(("loop", "baseline_gate_margin", "candidate_gate_margin", "token_position",
                         "baseline_logit_margin", "candidate_logit_margin"))
    out.update(position=pos, kind="exit" if is_exit else "token")
    if is_exit:
        sa, sb = a["survival"][pos], b["survival"][pos]
        for r, (x, y) in enumerate(zip(sa, sb), start=1):
            if _decided(x, r, ex) != _decided(y, r, ex):
                out.update(loop=r, baseline_gate_margin=abs(1.0 - x - ex["threshold"]),
                           candidate_gate_margin=abs(1.0 - y - ex["threshold"]))
                break
    toks = [i for i in range(n) if a["token_ids"][i] != b["token_ids"][i]]
    if toks:
        j = toks[0]
        out.update(token_position=j, baseline_logit_margin=a["top2"][j][0] - a["top2"][j][1],
                   candidate_logit_margin=b["top2"][j][0] - b["top2"][j][1])
    kind = "gate" if is_exit else "logit"
    pair = (out[f"baseline_{kind}_margin"], out[f"candidate_{kind}_margin"])
    decided_here = is_exit or out["token_position"] == pos
    out["margin"] = max(pair) if decided_here and None not in pair else None
    out["epsilon"] = nat["gate_epsilon"] if is_exit else nat["logit_epsilon"]
    out["near_tie"] = out["margin"] is not None and out["margin"] < out["epsilon"]
    return out


def _equal(x: dict, y: dict) -> bool:
    return set(x["outputs"]) == set(y["outputs"]) and all(
        (o["token_ids"], o["exit_depths"]) == (y["outputs"][rid]["token_ids"], y["outputs"][rid]["exit_depths"])
        for rid, o in x["outputs"].items())


def _differing(x: dict, y: dict) -> int:
    """Requests of run x whose tokens or exit depths are not run y's."""
    other = y["outputs"]
    return sum((o["token_ids"], o["exit_depths"]) != (other.get(q, {}).get("token_ids"), other.get(q, {}).get("exit_depths"))
               for q, o in x["outputs"].items())


def _n_rows(m: dict) -> int:
    return sum(m["work"]["rows_per_depth"])


def _median(xs: list):
    return statistics.median(xs) if xs else None


def _side_work(ms: list[dict]) -> tuple[list[float], float | None, float | None]:
    per_depth = [sum(col) / len(ms) for col in zip(*(m["work"]["rows_per_depth"] for m in ms))]
    toks = sum(m["work"]["decode_tokens"] for m in ms)
    loops = sum(_n_rows(m) for m in ms) / toks if toks else None
    return per_depth, loops, _median([m["elapsed_s"] * 1e6 / _n_rows(m) for m in ms if _n_rows(m)])


def _row(pt: dict, c: dict, tb: dict, tc: dict, recs: list[dict], ex: dict, nat: dict) -> tuple[dict, list[dict]]:
    divs = []
    for rid in sorted(tb["outputs"]):
        d = first_divergence(tb["outputs"][rid], tc["outputs"][rid], ex, nat)
        if d is not None:
            divs.append({"point": pt["key"], "comparison": c["name"], "request_id": rid, **d})
    row = {"point": pt["key"], "max_num_seqs": pt["max_num_seqs"], "num_requests": pt["num_requests"],
           "comparison": c["name"], "baseline_arm": c["baseline"], "candidate_arm": c["candidate"],
           "aa": c["baseline"] == c["candidate"], "requests": len(tb["outputs"]),
           "token_divergent": sum(tb["outputs"][q]["token_ids"] != tc["outputs"][q]["token_ids"] for q in tb["outputs"]),
           "depth_divergent": sum(tb["outputs"][q]["exit_depths"] != tc["outputs"][q]["exit_depths"]
                                  for q in tb["outputs"]),
           "divergent": len(divs), "near_ties": sum(d["near_tie"] for d in divs)}
    row["above_epsilon"] = row["divergent"] - row["near_ties"]
    traces = {"baseline": tb, "candidate": tc}
    phases = [(r, r[ph]) for r in recs for ph in ("warmup", "measured") if r.get(ph) is not None]
    row["runs"] = len(phases)
    row["runs_reproducing"] = sum(_equal(data, traces[r["position"]]) for r, data in phases)
    row["warmup_mismatches"] = sum(r.get("warmup") is not None and not _equal(r["warmup"], r["measured"]) for r in recs)
    pairs: dict = {}
    for r in recs:
        pairs.setdefault((r["job"], r["pair"]), {})[r["position"]] = r["measured"]
    full = [(p["baseline"], p["candidate"]) for _, p in sorted(pairs.items()) if len(p) == 2]
    row["pairs"] = len(full)
    row["pairs_divergent_max"] = max((_differing(b, k) for b, k in full), default=0)
    for side in SIDES:
        per_depth, loops, us = _side_work([r["measured"] for r in recs if r["position"] == side])
        row.update({f"{side}_rows_per_depth": per_depth, f"{side}_loops_per_token": loops, f"{side}_us_per_row": us})
    row["time_ratio"] = _median([b["elapsed_s"] / k["elapsed_s"] for b, k in full])
    row["work_ratio"] = _median([_n_rows(b) / _n_rows(k) for b, k in full if _n_rows(k)])
    row["per_row_ratio"] = _median([(b["elapsed_s"] / _n_rows(b)) / (k["elapsed_s"] / _n_rows(k))
                                    for b, k in full if _n_rows(b) and _n_rows(k)])
    return row, divs


def _verdict(row: dict, bound: int) -> tuple[str, str]:
    if row["runs_reproducing"] != row["runs"]:
        return "inconclusive", (f"{row['runs'] - row['runs_reproducing']} of {row['runs']} runs differ from "
                                "their arm's traced run, so its margins do not describe them")
    if row["divergent"] > bound:
        return "not_equivalent", f"{row['divergent']} divergent requests > the floor's {bound}"
    if row["above_epsilon"] > 0:
        return "not_equivalent", f"{row['above_epsilon']} divergences above epsilon"
    return "equivalent", (f"{row['divergent']} divergent requests <= the floor's {bound}; "
                          f"{row['near_ties']} near-ties, none above epsilon")


def derive(plan: dict, records: list[dict], traces: dict) -> tuple[list[dict], list[dict]]:
    """The natural table's and the divergence table's rows."""
    cfg, entry = plan["config"], expected_plan_entry(plan)
    rows, divs = [], []
    for pt in plan["points"]:
        for c in natural_comps(plan):
            tb, tc = traces.get((pt["key"], c["name"], "baseline")), traces.get((pt["key"], c["name"], "candidate"))
            if tb is None or tc is None:
                continue
            recs = [r for r in records if (r["point"], r["comparison"]) == (pt["key"], c["name"])]
            row, d = _row(pt, c, tb, tc, recs, cfg["exit"], cfg["natural"])
            row["floor"] = entry["floors"][c["name"]]
            rows.append(row)
            divs += d
    for row in rows:
        floor = next((r for r in rows if r["point"] == row["point"] and r["comparison"] == row["floor"]), None)
        row["floor_divergent"] = None if floor is None else floor["divergent"]
        row["verdict"], row["verdict_reason"] = _verdict(row, row["floor_divergent"] or 0)
    return rows, divs


def summary(plan: dict, rows: list[dict], divs: list[dict]) -> dict:
    entry = expected_plan_entry(plan)
    return {"rule": entry["rule"], "gate_epsilon": entry["gate_epsilon"], "logit_epsilon": entry["logit_epsilon"],
            "comparisons": rows, "divergences": divs}


def check(ctx: Audit, plan: dict, records: list[dict]) -> dict | None:
    """Plan entry, traced runs and both tables (format 5); returns the summary's expected ``natural``
    (None before format 5)."""
    if ctx.version < SINCE:
        return None
    check_plan_entry(ctx, plan)
    rows, divs = derive(plan, records, load_traces(ctx, plan))
    check_tables(ctx, rows, divs)
    return summary(plan, rows, divs)


def check_tables(ctx: Audit, rows: list[dict], divs: list[dict]) -> None:
    """Both natural tables against the derived rows (check_tables.check_table's rules)."""
    from .check_tables import check_table

    for name, data in zip(contract.NATURAL_TABLES, (rows, divs)):
        rel = Path("tables") / f"{name}.parquet"
        if not (ctx.bundle / rel).is_file():
            ctx.fail("natural", f"{rel} is missing")
            continue
        got = pd.read_parquet(ctx.bundle / rel)
        cols = list(contract.declared_columns(name))
        ctx.section(f"{name}.parquet", check_table, name, got, pd.DataFrame(data, columns=cols))


# ------------------------------------------------------------------------------------------- report

def _f(value) -> str:
    return R["none"] if value is None else R["number"].format(value)


def _opt(value) -> object:
    return R["none"] if value is None else value


def report_lines(plan: dict, natural: dict | None, table) -> list[str]:
    """The report's natural section as the contract words it, from the auditor's derived ``natural``;
    ``table``: render.py's table renderer. None without natural comparisons."""
    if not natural or not natural["comparisons"]:
        return []
    rows = natural["comparisons"]
    cells = []
    for r in rows:
        c = dict(r)
        for key in [k for k in r if k.endswith(("_loops_per_token", "_us_per_row", "_ratio"))]:
            c[key] = _f(r[key])
        for side in SIDES:
            c[f"{side}_rows_per_depth"] = " / ".join(R["rows"].format(x) for x in r[f"{side}_rows_per_depth"])
        c["aa"] = R["aa"] if r["aa"] else ""
        c["floor_text"] = R["none"] if r["floor"] is None else R["floor"].format(**r)
        cells.append(c)
    lines = ["", R["heading"], "",
             R["text"].format(**plan["config"]["exit"], gate_epsilon=natural["gate_epsilon"],
                              logit_epsilon=natural["logit_epsilon"]),
             "", R["rule"].format(rule=natural["rule"]), ""]
    lines += table(R["columns"], [R["row"].format(**c) for c in cells])
    lines += ["", R["work_text"], ""]
    lines += table(R["work_columns"], [R["work_row"].format(**c) for c in cells])
    divs = natural["divergences"]
    if not divs:
        return lines
    sizes = {(r["point"], r["comparison"]): r for r in rows}
    body = []
    for d in divs[:R["max_divergences"]]:
        pt = sizes[d["point"], d["comparison"]]
        body.append(R["divergence_row"].format(
            **{**d, "loop": _opt(d["loop"]), "token_position": _opt(d["token_position"]), "margin": _f(d["margin"])},
            max_num_seqs=pt["max_num_seqs"], num_requests=pt["num_requests"],
            gate_margins=f"{_f(d['baseline_gate_margin'])} / {_f(d['candidate_gate_margin'])}",
            logit_margins=f"{_f(d['baseline_logit_margin'])} / {_f(d['candidate_logit_margin'])}",
            **{"class": R["near_tie"] if d["near_tie"] else R["above"]}))
    lines += [""] + table(R["divergence_columns"], body)
    if len(divs) > R["max_divergences"]:
        lines.append(R["more"].format(n=len(divs) - R["max_divergences"]))
    return lines
