"""Online latency figures: pure functions of the per-request timestamps the load generator records.

Per request (times in s since the run's start; harness/online/loadgen.py):
``ttft_s = token_times_s[0] - planned_s`` (time to first token, from the PLANNED arrival),
``e2e_s = end_s - planned_s``, the inter-token gaps ``itl_s = diff(token_times_s)`` and
``tpot_s = (token_times_s[-1] - token_times_s[0]) / (n - 1)`` (time per output token after the first).
A request failed when it carries an ``error``; failed requests count in ``failed`` and in no latency.

Per run: ``duration_s`` = the last request's end (the trace starts at 0); percentiles of TTFT and TPOT over
every request of the run, a failed one counted as slower than every completed one (it was not served within
the run's bound: a timed-out request is right-censored, and dropping it would make the run with more
timeouts look faster), so a percentile that reaches a failed request is None (:func:`censored_percentile`;
with no failed request these are the plain percentiles of the completed requests); percentiles of every
inter-token gap of the completed requests (``numpy.percentile``, method linear, Hyndman & Fan type 7),
``throughput_tokens_per_s`` = completed requests' tokens / duration, ``request_rate_rps`` = completed
requests / duration, and ``goodput_rps`` = requests that met the SLO / duration, where a request meets
the SLO when it completed with ``ttft_s <= slo.ttft_s`` and ``tpot_s <= slo.tpot_s`` (a one-token request
has no TPOT and is held to TTFT only). This is one run's rate of SLO-meeting requests at its offered load,
the per-request TTFT / TPOT attainment of DistServe (Zhong et al. 2024) counted per second; DistServe's own
"goodput" is another figure, the highest request rate at which a set share of requests (e.g. 90%) meets
the SLO, which one run at one rate does not measure.

The SLO is the plan's, or derived from the native calibration run: ``SLO_FACTOR`` x that run's p99 TTFT and p99
TPOT, the factor the contract states (bundle_format.json ``online.slo_factor``), which the auditor re-derives by.
"""
from __future__ import annotations

import math

import numpy as np

from ..fileio import bundle_format

SLO_FACTOR = bundle_format()["online"]["slo_factor"]
PERCENTILE_METHOD = "linear"
RUN_FIGURES = ("completed", "failed", "duration_s", "p50_ttft_s", "p99_ttft_s", "p50_itl_s", "p99_itl_s",
               "p99_tpot_s", "throughput_tokens_per_s", "request_rate_rps", "good", "goodput_rps")
# figure -> True when higher is better (the paired ratio is candidate / baseline either way)
PAIRED_FIGURES = {"p50_ttft_s": False, "p99_ttft_s": False, "p99_itl_s": False,
                  "throughput_tokens_per_s": True, "goodput_rps": True}


def request_latencies(req: dict) -> dict:
    """``ttft_s``, ``e2e_s``, ``tpot_s`` (None where undefined) and ``itl_s`` (list) of one request record."""
    times = req["token_times_s"]
    ok = req["error"] is None
    ttft = times[0] - req["planned_s"] if ok and times else None
    tpot = (times[-1] - times[0]) / (len(times) - 1) if ok and len(times) > 1 else None
    return {"ttft_s": ttft, "e2e_s": req["end_s"] - req["planned_s"] if ok else None, "tpot_s": tpot,
            "itl_s": np.diff(times).tolist() if ok else []}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of ``values`` by ``PERCENTILE_METHOD``; None for no values."""
    return float(np.percentile(values, q, method=PERCENTILE_METHOD)) if len(values) else None


def censored_percentile(values: list[float], failed: int, q: float) -> float | None:
    """The q-th percentile (0..100) of ``values`` and ``failed`` more values each larger than all of them (failed
    requests, right-censored at the run's bound): None where ``numpy.percentile`` would interpolate towards a
    failed value (its weight is not 0), or there is no value at all. Computed as the plain percentile with the
    failed values set to two different numbers above the largest value: the result is the censored percentile
    when both agree, and depends on a failed value when they do not."""
    if not values:
        return None
    if not failed:
        return percentile(values, q)
    top = max(values)
    low, high = (percentile(list(values) + [top + bump] * failed, q) for bump in (0.0, abs(top) + 1e6))
    return low if low == high else None


def meets_slo(lat: dict, slo: dict | None) -> bool:
    """Whether a completed request's latencies meet ``slo`` (``ttft_s``, ``tpot_s``)."""
    if slo is None or lat["ttft_s"] is None:
        return False
    return lat["ttft_s"] <= slo["ttft_s"] and (lat["tpot_s"] is None or lat["tpot_s"] <= slo["tpot_s"])


def _per_s(count: float, duration_s: float) -> float | None:
    return count / duration_s if duration_s > 0 else None


def run_figures(requests: list[dict], slo: dict | None) -> dict:
    """Every ``RUN_FIGURES`` figure of one run's request records (goodput None without an SLO)."""
    lats = [request_latencies(r) for r in requests]
    done = [(r, lat) for r, lat in zip(requests, lats) if r["error"] is None]
    failed = len(requests) - len(done)
    duration = max((r["end_s"] for r in requests), default=0.0)
    ttfts = [lat["ttft_s"] for _, lat in done if lat["ttft_s"] is not None]
    itls = [g for _, lat in done for g in lat["itl_s"]]
    tpots = [lat["tpot_s"] for _, lat in done if lat["tpot_s"] is not None]
    good = sum(meets_slo(lat, slo) for _, lat in done)
    return {"completed": len(done), "failed": failed, "duration_s": duration,
            "p50_ttft_s": censored_percentile(ttfts, failed, 50), "p99_ttft_s": censored_percentile(ttfts, failed, 99),
            "p50_itl_s": percentile(itls, 50), "p99_itl_s": percentile(itls, 99),
            "p99_tpot_s": censored_percentile(tpots, failed, 99),
            "throughput_tokens_per_s": _per_s(sum(len(r["token_ids"]) for r, _ in done), duration),
            "request_rate_rps": _per_s(len(done), duration),
            "good": good if slo is not None else None,
            "goodput_rps": _per_s(good, duration) if slo is not None else None}


def derived_slo(calibration: dict) -> dict:
    """``SLO_FACTOR`` x the calibration run's p99 TTFT and p99 TPOT (its ``run_figures``)."""
    if calibration["p99_ttft_s"] is None or calibration["p99_tpot_s"] is None:
        raise ValueError("the calibration run completed no request with two tokens, or its p99 reaches a failed "
                         "request: no SLO can be derived")
    return {"ttft_s": SLO_FACTOR * calibration["p99_ttft_s"], "tpot_s": SLO_FACTOR * calibration["p99_tpot_s"]}


def paired_figures(pairs: list[dict]) -> dict:
    """Per ``PAIRED_FIGURES`` figure: the median over pairs of each arm's value and of the per-pair ratio
    candidate / baseline (a pair whose baseline value is 0 or None has no ratio). A median is None where a pair's
    value is None (a percentile that reached a failed request, unknown and possibly the largest: dropping that
    pair would leave the better ones), or a pair with a None value has no ratio. ``pairs``: dicts with
    ``baseline`` and ``candidate`` run figures."""
    out = {}
    for fig in PAIRED_FIGURES:
        base = [p["baseline"][fig] for p in pairs]
        cand = [p["candidate"][fig] for p in pairs]
        ratios = [c / b for b, c in zip(base, cand) if b and c is not None]
        unknown_base, unknown_cand = None in base, None in cand
        out[fig] = {"baseline_median": None if unknown_base else _median(base),
                    "candidate_median": None if unknown_cand else _median(cand),
                    "ratios": ratios, "ratio_median": None if unknown_base or unknown_cand else _median(ratios)}
    return out


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.median(vals)) if vals else None
