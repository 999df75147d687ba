"""CUDA-Graph coverage of a measured run: the row-weighted share of its work that ran eagerly.

An arm with graphs replays a captured graph per decode step (the recurrent core) and per prefill loop;
when its graph cache is full it runs that launch eagerly (``GraphCounters.fallbacks``). An arm without
graphs runs everything eagerly. Two arms whose measured runs replay graphs for different shares of
their work do not differ only in what a comparison names (a layout, a kernel): the launch overhead that
graphs remove differs too. So a comparison whose paired arms' coverage differs gets no verdict
(``BARRED``), whatever its interval says.

Weighting (decided here, audit/check_graphs.py re-implements it): by rows, not by launches, and not by
timing each launch. A decode or prefill launch costs device time roughly in proportion to the rows it
computes (every row runs every layer once), so rows are the time proxy the bundle's own counters give:
decode rows = ``sum(work.rows_per_depth)``, prefill rows = ``work.prefill_rows``. Timing each launch
would put events inside the timed region (perturbing what is measured); counting launches alone would
weigh a 1-row launch like a 128-row one. Within a kind, the counters say how many launches fell back,
not which, so each kind's eager share is its fallbacks over its launches (replays + fallbacks + any
capture), applied to that kind's rows:

    eager_fraction = (R_decode * f_decode + R_prefill * f_prefill) / (R_decode + R_prefill)

with f = 1 for an arm without graphs. None when the run computed no rows.
"""
from __future__ import annotations

import statistics

BARRED = "barred: graph coverage differs"


def _eager_share(counters: dict, prefix: str) -> float:
    """fallbacks / launches of one graph kind (decode: no prefix; prefill: ``prefill_``); 0 without launches."""
    launches = sum(counters.get(f"{prefix}{k}", 0) for k in ("captures", "replays", "fallbacks"))
    return counters.get(f"{prefix}fallbacks", 0) / launches if launches else 0.0


def eager_fraction(cuda_graphs: bool, graphs: dict, work: dict) -> float | None:
    """The row-weighted eager fraction of one run (module docstring), in [0, 1].

    ``graphs``: ``PhaseResult.graphs()`` (captures / replays / fallbacks, prefill ones prefixed);
    ``work``: ``PhaseResult.work()``. None when the run computed no rows.
    """
    decode_rows, prefill_rows = sum(work["rows_per_depth"]), work["prefill_rows"]
    if decode_rows + prefill_rows == 0:
        return None
    if not cuda_graphs:
        return 1.0
    eager = decode_rows * _eager_share(graphs, "") + prefill_rows * _eager_share(graphs, "prefill_")
    return eager / (decode_rows + prefill_rows)


def record_eager_fraction(record: dict) -> float | None:
    """:func:`eager_fraction` of a raw arm record's measured run."""
    m = record["measured"]
    return eager_fraction(bool(record["arm_config"]["cuda_graphs"]), m["graphs"], m["work"])


def result_coverage(pairs: list[tuple[float | None, float | None]], tolerance: float) -> dict:
    """The summary result's ``graph_coverage`` from each pair's (baseline, candidate) eager fractions.

    ``differs`` when some pair's two fractions differ by more than ``tolerance`` (or one is None and the
    other is not); medians are over the pairs' runs (None when no run has rows).
    """
    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    gaps = [abs(b - c) for b, c in pairs if b is not None and c is not None]
    one_sided = any((b is None) != (c is None) for b, c in pairs)
    max_gap = max(gaps) if gaps else None
    return {"baseline_eager_fraction": median([b for b, _ in pairs]),
            "candidate_eager_fraction": median([c for _, c in pairs]),
            "max_pair_gap": max_gap, "tolerance": tolerance,
            "differs": one_sided or (max_gap is not None and max_gap > tolerance)}
