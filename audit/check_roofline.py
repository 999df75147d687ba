"""Roofline accounting (format 7), re-derived from the raw records, the prompts, the model config in the plan
and the sessions' copy-ceiling files, with the auditor's own code (audit/FORMAT.md, "Roofline").

Per measured run: the decode loops (work.decode_steps), every decode token's loops and context from its
request's prompt length and its exit depths, the bytes of weights, lm_head, KV read and KV write those
loops move, the device seconds (the sum of the record's ``decode_timing.loop_s``, which must hold one
entry per loop and fit inside the measured run), and the achieved bandwidth against the session's copy
ceiling (``bytes_per_copy / min(times_s)`` of ``ceilings/<session>.json``). Every cell of
``tables/roofline.parquet`` and every line of the report's Roofline section follows from them.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from . import contract
from .context import Audit

SINCE = 7
RECORD = contract.DOCS["record"]
CEILING = contract.DOCS["ceiling"]
TABLE = contract.ROOFLINE_TABLES[0]
SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
TIMING_OF_DEVICE = {"cuda": "cuda_events", "cpu": "wall_clock"}


# ------------------------------------------------------------------------------------------ inputs

def load_ceilings(ctx: Audit, sessions: set[str]) -> dict[str, dict]:
    """Each ``ceilings/<session>.json`` with its contract fields, a copy of twice its buffer and positive
    times; every session with records has one."""
    found = {}
    for path in sorted((ctx.bundle / "ceilings").glob("*")):
        rel = path.relative_to(ctx.bundle).as_posix()
        doc = ctx.read_json(rel, "roofline")
        problem = contract.fields_problem(doc, CEILING["fields"], f"{rel}: ", closed=True) \
            if isinstance(doc, dict) else f"{rel} is not a JSON object"
        if problem is None and doc["session"] != path.stem:
            problem = f"{rel}: session is {doc['session']!r}"
        if problem is None and doc["bytes_per_copy"] != 2 * doc["buffer_bytes"]:
            problem = f"{rel}: bytes_per_copy {doc['bytes_per_copy']} is not 2 x buffer_bytes {doc['buffer_bytes']}"
        if problem is None and not (doc["times_s"] and all(contract.is_kind(t, "number") and t > 0
                                                           for t in doc["times_s"])):
            problem = f"{rel}: times_s is {doc['times_s']!r}"
        if problem is not None:
            ctx.fail("roofline", problem)
            continue
        found[path.stem] = doc
        ctx.count("ceilings")
    for sid in sorted(sessions - set(found)):
        ctx.fail("roofline", f"ceilings/{sid}.json is missing: session {sid} measured arms")
    return found


def _timing_problem(rec: dict) -> str | None:
    """Why the record's ``decode_timing`` is not one entry per measured decode loop inside the run."""
    if "decode_timing" not in rec:
        return "has no decode_timing"
    timing = rec["decode_timing"]
    if timing is None:
        return None
    problem = contract.fields_problem(timing, RECORD["decode_timing_fields"], "decode_timing.", closed=True) \
        if isinstance(timing, dict) else f"decode_timing is {timing!r}"
    if problem is not None:
        return problem
    want = TIMING_OF_DEVICE.get(rec["device"].get("kind"))
    if timing["method"] != want:
        return f"decode_timing.method is {timing['method']!r}, a {rec['device'].get('kind')} session times by {want!r}"
    loop_s, loops = timing["loop_s"], rec["measured"]["work"]["decode_steps"]
    if len(loop_s) != loops or not all(contract.is_kind(t, "number") and t >= 0 for t in loop_s):
        return f"decode_timing.loop_s has {len(loop_s)} entries (of non-negative seconds?), the run has {loops} decode loops"
    if sum(loop_s) > rec["measured"]["elapsed_s"]:
        return f"decode_timing.loop_s sums to {sum(loop_s)!r} s, more than the measured run's {rec['measured']['elapsed_s']!r} s"
    return None


# ----------------------------------------------------------------------------------------- figures

def _loop_weights(mc: dict, size: int) -> int:
    """One loop's weights: per layer qkv [(H + 2 Hkv) D, h], o [h, H D], gate_up [2 I, h], down [h, I] and
    four norms [h]; the final norm [h] and the gate [1, h]."""
    h, d = mc["hidden_size"], mc["head_dim"]
    shapes = [((mc["num_attention_heads"] + 2 * mc["num_key_value_heads"]) * d, h), (h, mc["num_attention_heads"] * d),
              (2 * mc["intermediate_size"], h), (h, mc["intermediate_size"])] + [(h, 1)] * 4
    return size * (mc["num_hidden_layers"] * sum(a * b for a, b in shapes) + h + h)


def _counts(plan: dict, rec: dict, prompt_lens: dict[str, int]) -> dict:
    mc, size = plan["checkpoint"]["model_config"], SIZES[plan["config"]["model"]["dtype"]]
    token_kv = 2 * mc["num_key_value_heads"] * mc["head_dim"] * size * mc["num_hidden_layers"]   # all layers
    planes = min(plan["config"]["exit"]["max_loops"], mc["total_ut_steps"])
    native = rec["arm_config"]["kv_layout"] == "native"
    rows = keys = fill_src = tokens = 0
    for rid, out in rec["measured"]["outputs"].items():
        for j in range(1, len(out["exit_depths"])):
            e = out["exit_depths"][j]
            tokens += 1
            rows += e
            keys += e * (prompt_lens[rid] + j)
            fill_src += 1 if native and e < planes else 0
    loops = rec["measured"]["work"]["decode_steps"]
    cov = rec["coverage"]
    return {"decode_loops": loops, "decode_rows": rows, "context_keys": keys,
            "weight_bytes": loops * _loop_weights(mc, size),
            "lm_head_bytes": loops * mc["vocab_size"] * mc["hidden_size"] * size,
            "kv_read_bytes": token_kv * (keys + fill_src) + 4 * mc["num_hidden_layers"] * cov["routed_reads"],
            "kv_write_bytes": token_kv * (rows + cov["fill_token_planes"]) + (0 if native else 4 * tokens)}


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def derive_rows(ctx: Audit, plan: dict, records: list[dict], ceilings: dict[str, dict]) -> list[dict]:
    prompts = ctx.read_json(plan["prompts"]["file"], "roofline")
    lens = {pt["key"]: {q["request_id"]: len(prompts[q["prompt_index"]]) for q in pt["requests"]}
            for pt in plan["points"]}
    rows = []
    for rec in sorted(records, key=lambda r: (r["job"], r["seq"])):
        at = f"record {rec['job']} seq {rec['seq']} ({rec['arm']})"
        problem = _timing_problem(rec)
        if problem is not None:
            ctx.fail("roofline", f"{at}: {problem}")
        c = _counts(plan, rec, lens[rec["point"]])
        if c["decode_rows"] != sum(rec["measured"]["work"]["rows_per_depth"]):
            ctx.fail("roofline", f"{at}: its outputs' exit depths give {c['decode_rows']} decode rows, its work "
                                 f"rows_per_depth {sum(rec['measured']['work']['rows_per_depth'])}")
        timing, session = rec.get("decode_timing"), rec.get("session", rec["job"])
        gpu_s = math.fsum(timing["loop_s"]) if problem is None and timing and c["decode_loops"] else None
        moved = c["weight_bytes"] + c["lm_head_bytes"] + c["kv_read_bytes"] + c["kv_write_bytes"]
        cell = ceilings.get(session)
        ceiling = None if cell is None else cell["bytes_per_copy"] / min(cell["times_s"]) / 1e9
        gb_s = None if gpu_s is None else _ratio(moved / 1e9, gpu_s)
        rows.append({"job": rec["job"], "seq": rec["seq"], "session": session, "device": rec["device"]["label"],
                     "point": rec["point"], "arm": rec["arm"], "kv_layout": rec["arm_config"]["kv_layout"],
                     "timing": timing["method"] if isinstance(timing, dict) else None, **c,
                     "decode_gpu_s": gpu_s, "ms_per_loop": None if gpu_s is None else gpu_s * 1e3 / c["decode_loops"],
                     "mb_per_loop": _ratio(moved / 1e6, c["decode_loops"]), "achieved_gb_per_s": gb_s,
                     "ceiling_gb_per_s": ceiling, "ceiling_fraction": _ratio(gb_s, ceiling)})
    return rows


# ------------------------------------------------------------------------------------------- check

def check(ctx: Audit, plan: dict, records: list[dict]) -> None:
    """Format 7: the ceilings, each record's decode timing, and ``tables/roofline.parquet`` cell by cell;
    keeps the derived rows on ``ctx.roofline`` for the report (nothing before format 7)."""
    if ctx.version < SINCE:
        return
    from .check_tables import check_table
    from .load import _check_columns

    ceilings = load_ceilings(ctx, {r.get("session", r["job"]) for r in records})
    rows = derive_rows(ctx, plan, records, ceilings)
    ctx.roofline = (rows, ceilings)
    rel = Path("tables") / f"{TABLE}.parquet"
    if not (ctx.bundle / rel).is_file():
        ctx.fail("roofline", f"{rel} is missing")
        return
    _check_columns(ctx, TABLE, pq.read_schema(ctx.bundle / rel), True)
    want = pd.DataFrame(rows, columns=list(contract.declared_columns(TABLE)))
    ctx.section(f"{TABLE}.parquet", check_table, TABLE, pd.read_parquet(ctx.bundle / rel), want)


# ------------------------------------------------------------------------------------------ report

def report_lines(ctx: Audit, plan: dict) -> list[str]:
    """The Roofline section from the derived rows (none before format 7 or when they could not be derived)."""
    if ctx.version < SINCE or ctx.roofline is None:
        return []
    from .render import _table, wording
    from .render_sections import workload

    rows, ceilings = ctx.roofline
    w = wording(contract.FORMAT["report"], ctx.version)
    spec, na = w["roofline"], w["words"]["na"]
    shown = w["device_names"]

    def med(fmt: str, values) -> str:
        got = [v for v in values if v is not None]
        return spec[fmt].format(statistics.median(got)) if got else na

    index = {p["key"]: (i, p) for i, p in enumerate(plan["points"])}
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["device"], index[r["point"]][0], r["arm"]), []).append(r)
    body = []
    for (device, i, arm), g in sorted(cells.items()):
        pt = plan["points"][i]
        mb = {k: med("mb", [_ratio(r[f"{k}_bytes"] / 1e6, r["decode_loops"]) for r in g])
              for k in ("weight", "lm_head", "kv_read", "kv_write")}
        body.append(spec["row"].format(
            device=shown.get(device, device), max_num_seqs=pt["max_num_seqs"], num_requests=pt["num_requests"],
            workload=workload(plan, pt["key"]), arm=arm, runs=len(g), ms=med("ms", [r["ms_per_loop"] for r in g]),
            weights=mb["weight"], lm_head=mb["lm_head"], kv_read=mb["kv_read"], kv_write=mb["kv_write"],
            total=med("mb", [r["mb_per_loop"] for r in g]), gb_s=med("gb_s", [r["achieved_gb_per_s"] for r in g]),
            ceiling=med("gb_s", [r["ceiling_gb_per_s"] for r in g]),
            fraction=med("fraction", [r["ceiling_fraction"] for r in g])))
    sessions = []
    for sid in sorted(ceilings):
        c = ceilings[sid]
        sessions.append(spec["ceiling_row"].format(
            session=sid, device=shown.get(c["device"], c["device"]), mib=spec["mib"].format(c["buffer_bytes"] / 2**20), copies=len(c["times_s"]),
            best_ms=spec["ms"].format(min(c["times_s"]) * 1e3),
            gb_s=spec["gb_s"].format(c["bytes_per_copy"] / min(c["times_s"]) / 1e9)))
    return ["", w["headings"]["roofline"], "", spec["text"], ""] + _table(w, spec["columns"], body) \
        + ["", spec["ceiling_text"], ""] + _table(w, spec["ceiling_columns"], sessions)
