"""Graph coverage (format 5), re-derived from the raw records with the auditor's own code.

Per measured run, the row-weighted eager fraction: each graph kind's fallbacks over its launches
(replays + fallbacks + captures), applied to its rows (decode: the sum of ``work.rows_per_depth``;
prefill: ``work.prefill_rows``); 1 for an arm without CUDA Graphs; None for a run without rows. Per
result, each pair's two fractions: the comparison's coverage differs when some pair's gap exceeds the
plan's ``verdict.eager_fraction_tolerance`` (or one side has rows and the other none), and a verdict
it would publish is then the contract's barred word instead (``summary.graph_barred_verdict``).
"""
from __future__ import annotations

import statistics

from . import contract

SINCE = contract.DOCS["summary"]["result_fields_since"]["graph_coverage"]
BARRED = contract.DOCS["summary"]["graph_barred_verdict"]


def eager_fraction(record: dict) -> float | None:
    m = record["measured"]
    work, graphs = m["work"], m["graphs"]
    rows = {"": sum(work["rows_per_depth"]), "prefill_": work["prefill_rows"]}
    total = sum(rows.values())
    if total == 0:
        return None
    if not record["arm_config"]["cuda_graphs"]:
        return 1.0
    eager = 0.0
    for prefix, n_rows in rows.items():
        launches = sum(graphs.get(prefix + k, 0) for k in ("captures", "replays", "fallbacks"))
        if launches:
            eager += n_rows * graphs.get(prefix + "fallbacks", 0) / launches
    return eager / total


def result_coverage(pair_rows: list[dict], by_seq: dict[tuple, dict], tolerance: float) -> dict:
    """The result's ``graph_coverage`` from its pairs (pairs.parquet rows) and the records by (job, seq)."""
    fr = [(eager_fraction(by_seq[p["job"], p["baseline_seq"]]), eager_fraction(by_seq[p["job"], p["candidate_seq"]]))
          for p in pair_rows]
    gaps = [abs(b - c) for b, c in fr if b is not None and c is not None]
    present = {side: [f[side] for f in fr if f[side] is not None] for side in (0, 1)}
    return {"baseline_eager_fraction": statistics.median(present[0]) if present[0] else None,
            "candidate_eager_fraction": statistics.median(present[1]) if present[1] else None,
            "max_pair_gap": max(gaps) if gaps else None, "tolerance": tolerance,
            "differs": any((b is None) != (c is None) for b, c in fr) or bool(gaps and max(gaps) > tolerance)}


def apply(plan: dict, results: list[dict], pairs: list[dict], records: list[dict], version: int) -> None:
    """Add each result's ``graph_coverage`` and bar its verdict (format 5 on; earlier bundles unchanged)."""
    if version < SINCE:
        return
    tolerance = plan["config"]["verdict"]["eager_fraction_tolerance"]
    by_seq = {(r["job"], r["seq"]): r for r in records}
    for res in results:
        rows = [p for p in pairs if (p["job"], p["point"], p["comparison"]) == (res["job"], res["point"], res["comparison"])]
        res["graph_coverage"] = result_coverage(sorted(rows, key=lambda p: p["pair"]), by_seq, tolerance)
        if res["verdict"] is not None and res["graph_coverage"]["differs"]:
            res["verdict"] = BARRED
