"""The online track's evidence: raw online records in; ``online/requests.parquet``, ``online/summary.json``,
``online/latency.png`` and the report's Online section out (contract: bundle_format.json ``online``).

Every figure is a function of the raw records' timestamps (harness/online/metrics.py), so the auditor
(audit/check_online.py) re-derives all of it. The served-token check holds each completed request's
tokens to the frozen natural reference of the same prompt (the online point's ``r<index:04d>``); online
batches differ from the reference's, so this holds only where the runtime is batch-invariant, and a
mismatch is a failed check naming the first differing run, request and token, never hidden.
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from ..evidence import FORMAT, arrow_type, atomic_write_json, write_table
from . import metrics

SPEC = FORMAT["online"]
R = SPEC["report"]


def load_online_records(bundle: Path) -> list[dict]:
    """Every raw online record of the bundle, by (job, seq)."""
    recs = [json.loads(p.read_text()) for p in sorted((Path(bundle) / "online").glob("*/*.json"))]
    return sorted(recs, key=lambda r: (r["job"], r["seq"]))


def slo_of(online: dict, records: list[dict]) -> dict | None:
    """The SLO the figures use: the plan's declared one, or the factor x the calibration run's p99s
    (None while no calibration run is recorded, or when it has no p99 TTFT or TPOT: it completed no
    request, or none of two tokens; its session failed, so the bundle is incomplete)."""
    slo = online["slo"]
    if slo["source"] == "declared":
        return {"ttft_s": slo["ttft_s"], "tpot_s": slo["tpot_s"]}
    calib = next((r for r in records if r["kind"] == "calibration"), None)
    if calib is None:
        return None
    figs = metrics.run_figures(calib["requests"], None)
    if figs["p99_ttft_s"] is None or figs["p99_tpot_s"] is None:
        return None
    return {"ttft_s": slo["factor"] * figs["p99_ttft_s"], "tpot_s": slo["factor"] * figs["p99_tpot_s"]}


def request_rows(records: list[dict], slo: dict | None) -> pa.Table:
    """``online/requests.parquet``: one row per request of every online record, the contract's columns."""
    rows = []
    for rec in records:
        for req in rec["requests"]:
            lat = metrics.request_latencies(req)
            rows.append({"job": rec["job"], "seq": rec["seq"], "kind": rec["kind"], "arm": rec["arm"],
                         "rate_multiple": rec["rate_multiple"], "rate_rps": rec["rate_rps"], "pair": rec["pair"],
                         "position": rec["position"], "request_index": req["index"], "prompt_index": req["prompt_index"],
                         "planned_s": req["planned_s"], "sent_s": req["sent_s"],
                         "first_token_s": req["token_times_s"][0] if req["token_times_s"] else None,
                         "end_s": req["end_s"], "ttft_s": lat["ttft_s"], "e2e_latency_s": lat["e2e_s"],
                         "tpot_s": lat["tpot_s"], "itl_s": lat["itl_s"], "tokens": len(req["token_ids"]),
                         "finish_reason": req["finish_reason"], "error": req["error"],
                         "meets_slo": req["error"] is None and metrics.meets_slo(lat, slo)})
    schema = pa.schema([(c["name"], arrow_type(c["type"])) for c in SPEC["requests_columns"]])
    return pa.Table.from_pylist(rows, schema=schema)


def token_check(bundle: Path, online: dict, records: list[dict]) -> dict:
    """Every completed request's tokens against the frozen reference; the first mismatch of each run."""
    from loopbench.runtime.schedule import first_difference

    ref_file = Path(bundle) / "references" / f"{online['point']}.schedule.json"
    ref = {r["request_id"]: r["token_ids"] for r in json.loads(ref_file.read_text())["requests"]}
    checked = failed = 0
    mismatches = []
    for rec in records:
        first = None
        for req in rec["requests"]:
            if req["error"] is not None:
                failed += 1
                continue
            checked += 1
            rid = f"r{req['index']:04d}"
            diff = first_difference(req["token_ids"], ref[rid])
            if diff is not None and first is None:
                first = {"seq": rec["seq"], "arm": rec["arm"], "request_index": req["index"],
                         "reference_request_id": rid, "position": diff[0], "want": diff[1], "got": diff[2]}
        if first is not None:
            mismatches.append(first)
    return {"ok": not mismatches, "requests_checked": checked, "requests_failed": failed, "mismatches": mismatches}


def run_entries(records: list[dict], slo: dict | None) -> list[dict]:
    keys = ("seq", "kind", "arm", "rate_multiple", "rate_rps", "pair", "position")
    return [{**{k: rec[k] for k in keys}, **metrics.run_figures(rec["requests"], slo)} for rec in records]


def rate_entries(online: dict, runs: list[dict]) -> list[dict]:
    """Per rate: the complete pairs' figures, paired (metrics.paired_figures)."""
    out = []
    for ri, multiple in enumerate(online["rates"]["multiples"]):
        at = [r for r in runs if r["kind"] == "arm" and r["rate_multiple"] == multiple]
        by_pair: dict[int, dict] = {}
        for r in at:
            by_pair.setdefault(r["pair"], {})[r["position"]] = r
        pairs = sorted(p for p, both in by_pair.items() if len(both) == 2)
        out.append({"rate_index": ri, "rate_multiple": multiple, "rate_rps": at[0]["rate_rps"] if at else None,
                    "baseline": online["baseline"], "candidate": online["candidate"], "pairs": pairs,
                    "figures": metrics.paired_figures([by_pair[p] for p in pairs])})
    return out


def online_summary(bundle: Path, plan: dict, records: list[dict]) -> dict:
    """``online/summary.json`` (contract ``online.summary_fields``)."""
    online = plan["online"]
    slo = slo_of(online, records)
    runs = run_entries(records, slo)
    calib = next((r for r in runs if r["kind"] == "calibration"), None)
    planned = len(online["order"])
    return {"schema_version": SPEC["schema_version"], "status": "complete" if len(records) == planned else "incomplete",
            "runs_planned": planned, "runs_recorded": len(records),
            "capacity_rps": calib["request_rate_rps"] if calib else None,
            "slo": {**online["slo"], **(slo or {})}, "percentile_method": online["percentile_method"],
            "runs": runs, "rates": rate_entries(online, runs), "checks": token_check(bundle, online, records)}


def publish(bundle: Path, plan: dict) -> list[str]:
    """Write the online files of a bundle whose plan has an online track; the report's Online lines
    (none without a track)."""
    from ..report_sections import runtime_settings
    from .report import plot_latency, report_lines

    if plan.get("online") is None:
        return []
    bundle = Path(bundle)
    records = load_online_records(bundle)
    summary = online_summary(bundle, plan, records)
    write_table(bundle / "online" / "requests.parquet", request_rows(records, slo_of(plan["online"], records)))
    atomic_write_json(bundle / "online" / "summary.json", summary)
    plot_latency(records, summary, bundle / "online" / "latency.png")
    settings = runtime_settings(plan, records, R["settings_heading"], R["settings_text"])   # format 10
    return report_lines(plan["online"], summary, settings)
