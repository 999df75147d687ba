"""The online track's part of the frozen plan (``plan.json`` ``online``), written before anything is measured.

It freezes the trace (the unit-rate Poisson arrivals of harness/online/loadgen.py, with its sha256), the
point whose prompts and reference the trace uses (request i is the point's request i: its prompt, the i-th of
the point's block of the pool, and its D tokens, checked against reference request ``r<i:04d>``), the rates (multiples of the calibration run's capacity), the SLO
(declared, or null: derived from the calibration run) and the order: seq 0 is the calibration run of the
baseline arm (closed loop at concurrency B), then per rate, ``pairs`` pairs whose first arm is
``stats.balanced_first`` seeded with (order_seed, rate index, 1).
"""
from __future__ import annotations

from .. import progress, stats, workloads
from ..spec import BenchSpec
from . import loadgen, metrics

ORDER_FIELDS = ("seq", "kind", "arm", "rate_index", "rate_multiple", "pair", "position", "slot")


def online_order(rates: tuple[float, ...], pairs: int, baseline: str, candidate: str, order_seed: int) -> list[dict]:
    """The calibration run, then every rate's balanced pairs (see the module docstring)."""
    order = [{"seq": 0, "kind": "calibration", "arm": baseline, "rate_index": None, "rate_multiple": None,
              "pair": None, "position": None, "slot": None}]
    for ri, rate in enumerate(rates):
        firsts = stats.balanced_first(pairs, [order_seed, ri, 1])
        for pair in range(pairs):
            positions = ("baseline", "candidate") if firsts[pair] == stats.FIRST_BASELINE else ("candidate", "baseline")
            for slot, pos in enumerate(positions):
                order.append({"seq": len(order), "kind": "arm", "arm": baseline if pos == "baseline" else candidate,
                              "rate_index": ri, "rate_multiple": float(rate), "pair": pair, "position": pos,
                              "slot": slot})
    return order


def online_plan(spec: BenchSpec, devices: list[dict]) -> dict | None:
    """``plan.json`` ``online`` of ``spec`` (None without an online track); it runs on ``devices[0]``."""
    on = spec.online
    if on is None:
        return None
    point = next(p for p in spec.points if p.key == on.point)
    first_prompt = workloads.prompt_offsets(spec)[point.prompt_len]   # the point's block of the prompt pool
    unit = loadgen.unit_trace(on.num_requests, on.trace_seed)
    declared = on.slo_ttft_s is not None
    return {
        "device": devices[0]["name"], "point": point.key, "max_num_seqs": point.max_num_seqs,
        "num_requests": on.num_requests, "max_tokens": workloads.output_len(spec, point),
        "requests": [{"index": i, "prompt_index": first_prompt + i, "reference_request_id": f"r{i:04d}"}
                     for i in range(on.num_requests)],
        "trace": {"kind": "poisson", "rate_rps": 1.0, "seed": on.trace_seed, "unit_arrivals_s": unit,
                  "sha256": loadgen.trace_sha256(unit)},
        "rates": {"unit": "capacity", "multiples": [float(r) for r in on.rates]},
        "baseline": on.baseline, "candidate": on.candidate, "pairs": on.pairs,
        "calibration": {"arm": on.baseline, "mode": "closed", "concurrency": point.max_num_seqs},
        "slo": {"source": "declared", "ttft_s": on.slo_ttft_s, "tpot_s": on.slo_tpot_s, "factor": None}
        if declared else {"source": "calibration", "ttft_s": None, "tpot_s": None, "factor": metrics.SLO_FACTOR},
        "percentile_method": metrics.PERCENTILE_METHOD,
        "warmup_requests": on.warmup_requests, "max_duration_s": on.max_duration_s,
        "health_timeout_s": on.health_timeout_s,
        "order": online_order(on.rates, on.pairs, on.baseline, on.candidate, spec.order_seed),
    }


def describe(spec: BenchSpec) -> list[str]:
    """``loopbench plan``'s lines about the online track (none without one)."""
    on = spec.online
    if on is None:
        return []
    slo = (f"declared TTFT <= {on.slo_ttft_s} s, TPOT <= {on.slo_tpot_s} s" if on.slo_ttft_s is not None
           else f"{metrics.SLO_FACTOR} x the calibration run's p99 TTFT and TPOT")
    runs = 1 + 2 * on.pairs * len(on.rates)
    return [f"  online: {runs} server runs on the first device after its arms: a {on.baseline} calibration run "
            f"(closed loop at B), then {on.baseline} vs {on.candidate}, {progress.counted(on.pairs, 'balanced pair')} at each of "
            f"{', '.join(f'{r:g}' for r in on.rates)} x capacity on a Poisson trace of {on.num_requests} requests "
            f"of point {on.point} (seed {on.trace_seed}); SLO {slo}"]
