"""The natural-schedule track (issue 12, item 1): arms that run their own exits, and how far they diverge.

A comparison with ``track: natural`` measures its arms without replay: each engine runs the plan's
natural exit policy (``exit.policy``, ``ouro_delayed`` in the presets), in the same balanced pairs with
warmups as the replay track. Such arms are not held to the frozen reference token for token (their
schedules may legitimately differ); they are held to self-consistency, and their divergences are
reported, never hidden:

- **traced runs** (untimed, in the reference child before any measurement): per point, natural
  comparison and position one fresh engine, a warmup, then a run with ``EngineConfig.trace_loops`` that
  records each loop's survival ``S_r`` and each token's top-2 logits; ``natural/<trace>.json``;
- **divergences** (:func:`first_divergence`): per request, the first position where the two positions'
  traced runs differ in token or exit depth; at an exit difference the first loop r whose exit test
  (``r >= min_loops`` and ``1 - S_r >= threshold``, BRIEF section 1) came out differently and the gate
  margin ``|1 - S_r - threshold|`` of each arm there; the top-2 logit margin of each arm at the first
  different token. A divergence is a *near-tie* when the larger of the two arms' margins (gate margin
  for an exit divergence, logit margin for a token divergence) is below its declared epsilon;
- **self-consistency**: every warmup and measured run of an arm must reproduce its position's traced
  run (identical inputs), else the margins do not describe what was measured;
- **equivalence** (declared in the plan, :func:`rule_text`): ``equivalent`` when the divergent requests
  are at most the floor's (a natural A/A comparison) and no divergence is above epsilon; ``inconclusive``
  when a run does not reproduce its traced run; otherwise ``not_equivalent``;
- **work**: time ratios beside the work done (rows per depth, loops per token, time per decode row),
  so a speed change is never confused with a change in work.

The auditor re-derives every figure from the trace files and raw records (audit/check_natural.py).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .fileio import bundle_format

# the plan document of the bundle contract, read through fileio (importing evidence.py would load pandas here,
# in the session child)
_PLAN_DOC = bundle_format()["documents"]["plan"]
NATURAL = "natural"
POSITIONS = ("baseline", "candidate")
VERDICTS = ("equivalent", "not_equivalent", "inconclusive")


# ------------------------------------------------------------------------------------------- config

def comparisons(config: dict) -> list[dict]:
    """The config's natural-track comparisons (plain dicts, names filled in); none in a config that
    lists no comparisons (a session job's hand-made config in tests)."""
    return [c for c in config.get("comparisons", []) if c.get("track") == NATURAL]


def is_natural(config: dict, comparison: str) -> bool:
    return any(c["name"] == comparison for c in comparisons(config))


def floor_of(config: dict, comp: dict) -> str | None:
    """The A/A comparison bounding ``comp``: ``natural.floor``, else the natural A/A of its baseline arm,
    else any natural A/A, else None (the bound is then 0 divergent requests)."""
    declared = (config.get("natural") or {}).get("floor")
    if declared is not None:
        return declared
    aa = [c for c in comparisons(config) if c["baseline"] == c["candidate"]]
    own = [c for c in aa if c["baseline"] == comp["baseline"]]
    return (own or aa or [{"name": None}])[0]["name"]


def rule_text(config: dict) -> str:
    """The declared equivalence rule in words (the contract's ``documents.plan.natural_rule``)."""
    return _PLAN_DOC["natural_rule"].format(**config["natural"])


def trace_stem(point: str, comparison: str, position: str) -> str:
    return f"{point}-{comparison}-{position}"


def plan_entry(config: dict, point_keys: list[str]) -> dict:
    """``plan.json`` ``natural``: the declared rule and every traced run's file, fixed before measuring."""
    comps = comparisons(config)
    return {"comparisons": [c["name"] for c in comps], "floors": {c["name"]: floor_of(config, c) for c in comps},
            "gate_epsilon": config["natural"]["gate_epsilon"], "logit_epsilon": config["natural"]["logit_epsilon"],
            "rule": rule_text(config),
            "traces": [{"point": pt, "comparison": c["name"], "position": pos, "arm": c[pos],
                        "file": f"natural/{trace_stem(pt, c['name'], pos)}.json"}
                       for pt in point_keys for c in comps for pos in POSITIONS]}


def reference_job_entry(config: dict, point_keys: list[str]) -> dict:
    """What the reference child needs to run the traced runs (``run_traces``)."""
    return {"natural_traces": plan_entry(config, point_keys)["traces"], "arms": config["arms"],
            "warmup": config["warmup"]}


def run_traces(spec: dict, model, prompts: list, point: dict, device: dict, bundle: Path) -> None:
    """The reference job's traced runs of ``point``: per listed trace a fresh engine of its arm under the
    natural policy with ``trace_loops``, a warmup (when the plan warms up), then the traced run, written
    to the trace's file. Untimed: nothing here is measured. ValueError for an engine without a loop trace."""
    import dataclasses

    from . import engines, session
    from .fileio import atomic_write_json
    from .records import ArmSpec

    for t in (t for t in spec.get("natural_traces", []) if t["point"] == point["key"]):
        arm = ArmSpec.from_plain(spec["arms"][t["arm"]])
        reqs = session.point_requests(prompts, point, spec["output_len"], spec["exit"])
        cfg = arm.engine_config(point["max_num_seqs"], spec["max_model_len"], spec["exit"]["policy"])
        eng = engines.build_engine(arm.engine, model, dataclasses.replace(cfg, trace_loops=True))
        if getattr(eng, "loop_trace", None) is None:
            raise ValueError(f"arm {t['arm']!r}: engine {arm.engine} keeps no loop_trace, so the natural track "
                             "cannot trace it")
        if spec["warmup"]:
            session.run_phase(eng, reqs, device)
            eng.reset_run()
        phase = session.run_phase(eng, reqs, device)
        outputs = {rid: {"token_ids": [int(x) for x in o.token_ids], "exit_depths": [int(d) for d in o.exit_depths],
                         **eng.loop_trace[rid]} for rid, o in sorted(phase.outputs.items())}
        atomic_write_json(Path(bundle) / t["file"], {
            "point": t["point"], "comparison": t["comparison"], "position": t["position"], "arm": t["arm"],
            "arm_config": arm.to_plain(), "policy": spec["exit"]["policy"], "warmup": spec["warmup"],
            "outputs": outputs, "work": phase.work(), "trace_sha256": phase.trace_sha256})


# --------------------------------------------------------------------------------------- divergence

def _test(survival: float, loop: int, ex: dict) -> bool:
    """The exit test of loop ``loop`` (1-based): ``r >= min_loops`` and ``1 - S_r >= threshold``."""
    return ex["threshold"] < 1.0 and loop >= ex["min_loops"] and (1.0 - survival) >= ex["threshold"]


def _logit_margin(top2: list[float]) -> float:
    return top2[0] - top2[1]


def first_divergence(a: dict, b: dict, ex: dict, nat: dict) -> dict | None:
    """Where one request's traced runs ``a`` (baseline) and ``b`` (candidate) first differ, or None.

    ``a``, ``b``: {token_ids, exit_depths, survival [token][loop] S_r, top2 [token][2]}; ``ex``: the plan's
    exit config; ``nat``: its natural config (epsilons). Returns the row of ``natural_divergences``.
    """
    ta, tb, da, db = a["token_ids"], b["token_ids"], a["exit_depths"], b["exit_depths"]
    n = min(len(ta), len(tb))
    pos = next((i for i in range(n) if ta[i] != tb[i] or da[i] != db[i]), n if len(ta) != len(tb) else None)
    if pos is None:
        return None
    row = {"position": pos, "kind": "exit" if pos < n and da[pos] != db[pos] else "token", "loop": None,
           "baseline_gate_margin": None, "candidate_gate_margin": None, "token_position": None,
           "baseline_logit_margin": None, "candidate_logit_margin": None}
    if row["kind"] == "exit":
        sa, sb = a["survival"][pos], b["survival"][pos]
        loop = next((r for r in range(1, min(len(sa), len(sb)) + 1)
                     if _test(sa[r - 1], r, ex) != _test(sb[r - 1], r, ex)), None)
        if loop is not None:
            row.update(loop=loop, baseline_gate_margin=abs(1.0 - sa[loop - 1] - ex["threshold"]),
                       candidate_gate_margin=abs(1.0 - sb[loop - 1] - ex["threshold"]))
    tok = next((i for i in range(n) if ta[i] != tb[i]), None)
    if tok is not None:
        row.update(token_position=tok, baseline_logit_margin=_logit_margin(a["top2"][tok]),
                   candidate_logit_margin=_logit_margin(b["top2"][tok]))
    gate = row["kind"] == "exit"
    margins = [row[f"{p}_{'gate' if gate else 'logit'}_margin"] for p in POSITIONS]
    if gate or row["token_position"] == pos:
        row["margin"] = None if None in margins else max(margins)
    else:
        row["margin"] = None     # the sequences differ in length only: nothing was decided differently
    row["epsilon"] = nat["gate_epsilon"] if gate else nat["logit_epsilon"]
    row["near_tie"] = row["margin"] is not None and row["margin"] < row["epsilon"]
    return row


def divergences(trace_b: dict, trace_c: dict, ex: dict, nat: dict) -> tuple[dict, list[dict]]:
    """Counts ({requests, token_divergent, depth_divergent, divergent, near_ties, above_epsilon}) and one
    divergence row per divergent request (request id order) of two traced runs."""
    ob, oc = trace_b["outputs"], trace_c["outputs"]
    rows, tok, dep = [], 0, 0
    for rid in sorted(set(ob) | set(oc)):
        if rid not in ob or rid not in oc:
            raise ValueError(f"request {rid!r} is in one traced run only ({trace_b['arm']} / {trace_c['arm']})")
        tok += ob[rid]["token_ids"] != oc[rid]["token_ids"]
        dep += ob[rid]["exit_depths"] != oc[rid]["exit_depths"]
        row = first_divergence(ob[rid], oc[rid], ex, nat)
        if row is not None:
            rows.append({"request_id": rid, **row})
    near = sum(r["near_tie"] for r in rows)
    return ({"requests": len(ob), "token_divergent": tok, "depth_divergent": dep, "divergent": len(rows),
             "near_ties": near, "above_epsilon": len(rows) - near}, rows)


# ------------------------------------------------------------------------------ consistency and work

def _same_outputs(phase: dict, trace: dict) -> bool:
    """Whether a run's outputs are the traced run's (or another run's): every request, token and exit."""
    if set(phase["outputs"]) != set(trace["outputs"]):
        return False
    return all(phase["outputs"][rid][f] == trace["outputs"][rid][f]
               for rid in phase["outputs"] for f in ("token_ids", "exit_depths"))


def _differing_requests(a: dict, b: dict) -> int:
    return sum(a["outputs"][rid]["token_ids"] != b["outputs"].get(rid, {}).get("token_ids") or
               a["outputs"][rid]["exit_depths"] != b["outputs"].get(rid, {}).get("exit_depths")
               for rid in a["outputs"])


def consistency(recs: list[dict], traces: dict[str, dict]) -> dict:
    """Of one comparison's records: runs (warmup and measured), those reproducing their position's traced
    run, records whose warmup differs from their measured run, complete pairs, and the most requests that
    differ between a pair's two measured runs."""
    runs = same = warm_diff = 0
    for r in recs:
        for phase in ("warmup", "measured"):
            if r.get(phase) is not None:
                runs += 1
                same += _same_outputs(r[phase], traces[r["position"]])
        if r.get("warmup") is not None and not _same_outputs(r["warmup"], r["measured"]):
            warm_diff += 1
    pairs = _pairs(recs)
    return {"runs": runs, "runs_reproducing": same, "warmup_mismatches": warm_diff, "pairs": len(pairs),
            "pairs_divergent_max": max((_differing_requests(b["measured"], c["measured"]) for b, c in pairs),
                                       default=0)}


def _pairs(recs: list[dict]) -> list[tuple[dict, dict]]:
    by: dict[tuple, dict] = {}
    for r in recs:
        by.setdefault((r["job"], r["pair"]), {})[r["position"]] = r
    return [(p["baseline"], p["candidate"]) for _, p in sorted(by.items()) if len(p) == 2]


def _rows(phase: dict) -> int:
    return sum(phase["work"]["rows_per_depth"])


def work(recs: list[dict]) -> dict:
    """Per position: mean rows per depth and loops per decode token over its measured runs, the median µs
    per decode row (elapsed / decode rows); per pair medians of the time ratio, the work ratio (baseline
    rows / candidate rows) and the per-row time ratio (time ratio / work ratio)."""
    out: dict = {}
    for pos in POSITIONS:
        ms = [r["measured"] for r in recs if r["position"] == pos]
        depths = list(zip(*[m["work"]["rows_per_depth"] for m in ms]))
        tokens = sum(m["work"]["decode_tokens"] for m in ms)
        out[f"{pos}_rows_per_depth"] = [sum(d) / len(ms) for d in depths]
        out[f"{pos}_loops_per_token"] = sum(_rows(m) for m in ms) / tokens if tokens else None
        per_row = [m["elapsed_s"] * 1e6 / _rows(m) for m in ms if _rows(m)]
        out[f"{pos}_us_per_row"] = statistics.median(per_row) if per_row else None
    pairs = [(b["measured"], c["measured"]) for b, c in _pairs(recs)]
    t = [b["elapsed_s"] / c["elapsed_s"] for b, c in pairs]
    w = [_rows(b) / _rows(c) for b, c in pairs if _rows(c)]
    pr = [(b["elapsed_s"] / _rows(b)) / (c["elapsed_s"] / _rows(c)) for b, c in pairs if _rows(b) and _rows(c)]
    for key, vals in (("time_ratio", t), ("work_ratio", w), ("per_row_ratio", pr)):
        out[key] = statistics.median(vals) if vals else None
    return out


# ------------------------------------------------------------------------------------------ verdict

def verdict(row: dict, floor_divergent: int) -> tuple[str, str]:
    """The declared rule (:func:`rule_text`) on one comparison's row: (verdict, reason)."""
    if row["runs_reproducing"] < row["runs"]:
        return "inconclusive", (f"{row['runs'] - row['runs_reproducing']} of {row['runs']} runs differ from "
                                "their arm's traced run, so its margins do not describe them")
    if row["divergent"] > floor_divergent:
        return "not_equivalent", f"{row['divergent']} divergent requests > the floor's {floor_divergent}"
    if row["above_epsilon"]:
        return "not_equivalent", f"{row['above_epsilon']} divergences above epsilon"
    return "equivalent", (f"{row['divergent']} divergent requests <= the floor's {floor_divergent}; "
                          f"{row['near_ties']} near-ties, none above epsilon")


# ------------------------------------------------------------------------------------------- bundle

def load_traces(bundle: Path, plan: dict) -> dict[tuple[str, str, str], dict]:
    """Every traced run the plan lists that the bundle holds, by (point, comparison, position)."""
    out = {}
    for t in (plan.get("natural") or {}).get("traces", []):
        path = Path(bundle) / t["file"]
        if path.is_file():
            out[t["point"], t["comparison"], t["position"]] = json.loads(path.read_text())
    return out


def derive(plan: dict, records: list[dict], traces: dict) -> tuple[list[dict], list[dict]]:
    """(``natural`` table rows: one per point and natural comparison with both traced runs; the
    ``natural_divergences`` rows), in plan order."""
    cfg, nat = plan["config"], plan.get("natural") or {}
    rows, divs = [], []
    for pt in plan["points"]:
        for comp in comparisons(cfg):
            name = comp["name"]
            tb, tc = (traces.get((pt["key"], name, p)) for p in POSITIONS)
            if tb is None or tc is None:
                continue
            counts, d = divergences(tb, tc, cfg["exit"], cfg["natural"])
            recs = [r for r in records if r["point"] == pt["key"] and r["comparison"] == name]
            row = {"point": pt["key"], "max_num_seqs": pt["max_num_seqs"], "num_requests": pt["num_requests"],
                   "comparison": name, "baseline_arm": comp["baseline"], "candidate_arm": comp["candidate"],
                   "aa": comp["baseline"] == comp["candidate"], **counts,
                   **consistency(recs, {"baseline": tb, "candidate": tc}), **work(recs),
                   "floor": nat["floors"][name]}
            rows.append(row)
            divs += [{"point": pt["key"], "comparison": name, **x} for x in d]
    by = {(r["point"], r["comparison"]): r for r in rows}
    for row in rows:
        floor = by.get((row["point"], row["floor"]))
        row["floor_divergent"] = None if floor is None else floor["divergent"]
        row["verdict"], row["verdict_reason"] = verdict(row, row["floor_divergent"] or 0)
    return rows, divs


def summary(plan: dict, rows: list[dict], divs: list[dict]) -> dict:
    """``summary.json`` ``natural``: the declared rule, the natural table's rows and the divergences."""
    nat = plan["natural"]
    return {"rule": nat["rule"], "gate_epsilon": nat["gate_epsilon"], "logit_epsilon": nat["logit_epsilon"],
            "comparisons": rows, "divergences": divs}


# ------------------------------------------------------------------------------------------- report

def _num(template: str, value, none: str) -> str:
    return none if value is None else template.format(value)


def _cells(row: dict, R: dict) -> dict:
    """The formatted cells of one natural table row (floats by ``R["number"]``, None as ``R["none"]``)."""
    fmt = {k: _num(R["number"], row[k], R["none"]) for k in row if k.endswith(("_per_token", "_per_row", "_ratio"))}
    for pos in POSITIONS:
        fmt[f"{pos}_rows_per_depth"] = " / ".join(R["rows"].format(v) for v in row[f"{pos}_rows_per_depth"])
    floor = R["none"] if row["floor"] is None else R["floor"].format(**row)
    return {**row, **fmt, "aa": R["aa"] if row["aa"] else "", "floor_text": floor}


def _divergence_cells(d: dict, rows: dict, R: dict) -> dict:
    pt = rows[d["point"], d["comparison"]]
    pair = {f"{k}s": " / ".join(_num(R["number"], d[f"{p}_{k}"], R["none"]) for p in POSITIONS)
            for k in ("gate_margin", "logit_margin")}
    return {**d, **pair, "max_num_seqs": pt["max_num_seqs"], "num_requests": pt["num_requests"],
            "loop": R["none"] if d["loop"] is None else d["loop"],
            "token_position": R["none"] if d["token_position"] is None else d["token_position"],
            "margin": _num(R["number"], d["margin"], R["none"]),
            "class": R["near_tie"] if d["near_tie"] else R["above"]}


def report_lines(plan: dict, natural: dict | None, R: dict, table) -> list[str]:
    """The report's natural-schedule section (``R``: the contract's ``report.natural``; ``table``: the
    report's table renderer, columns and rows to lines); none without natural comparisons."""
    if not natural or not natural["comparisons"]:
        return []
    rows = natural["comparisons"]
    by = {(r["point"], r["comparison"]): r for r in rows}
    ex = plan["config"]["exit"]
    out = ["", R["heading"], "", R["text"].format(**ex, gate_epsilon=natural["gate_epsilon"], logit_epsilon=natural["logit_epsilon"]),
           "", R["rule"].format(rule=natural["rule"]), ""]
    out += table(R["columns"], [R["row"].format(**_cells(r, R)) for r in rows])
    out += ["", R["work_text"], ""]
    out += table(R["work_columns"], [R["work_row"].format(**_cells(r, R)) for r in rows])
    divs = natural["divergences"]
    if divs:
        shown = divs[:R["max_divergences"]]
        out += [""] + table(R["divergence_columns"],
                            [R["divergence_row"].format(**_divergence_cells(d, by, R)) for d in shown])
        if len(divs) > len(shown):
            out.append(R["more"].format(n=len(divs) - len(shown)))
    return out
