"""Telemetry during measured runs (format 5), re-derived from the raw NVML samples with the auditor's own code.

A record's ``telemetry`` holds the device reading before (``start``) and after (``end``) its measured run,
each with the total-energy counter ``energy_mj``, and the sampler's readings during it (``samples``,
``sampler``). From them: the telemetry table's rows (start, during 0..n-1, end), and the arms table's
per-run figures: energy_j = (end - start) energy / 1000, joules_per_token = energy_j / (C * D), the
mean power of the samples, min / max SM and memory clocks, the OR of throttle-reason bits other than
the contract's ignored ones (``telemetry.ignored_reasons_mask``: idle) and the flags ``throttled`` and
``clock_changed``. No NVML: every figure None, no telemetry rows but start / end, the report says so.
The sampler must reach the contract's ``min_sample_hz`` in a run it sampled (a slower one is named).
"""
from __future__ import annotations

import statistics

from . import contract
from .context import Audit

T = contract.FORMAT["telemetry"]
SINCE = T["since"]


def telemetry_rows(r: dict) -> list[dict]:
    """telemetry.parquet rows of one record: start, during 0..n-1, end (an earlier format's table lacks the
    ``sample`` column, which the table check then drops, and its records have no samples)."""
    tele = r.get("telemetry") or {}
    ident = {"job": r["job"], "seq": r["seq"], "arm": r["arm"]}
    during = [{**ident, "when": "during", "sample": i, **s} for i, s in enumerate(tele.get("samples") or [])]
    ends = {w: [{**ident, "when": w, "sample": 0, **tele[w]}] if tele.get(w) else [] for w in ("start", "end")}
    return ends["start"] + during + ends["end"]


def _minmax(samples: list[dict], key: str) -> tuple:
    vals = [s[key] for s in samples if s.get(key) is not None]
    return (min(vals), max(vals)) if vals else (None, None)


def arm_columns(r: dict) -> dict:
    """The arms table's telemetry columns of one record (module docstring)."""
    tele = r.get("telemetry") or {}
    samples = tele.get("samples") or []
    energy = [(tele.get(w) or {}).get("energy_mj") for w in ("start", "end")]
    energy_j = None if None in energy else (energy[1] - energy[0]) / 1000
    cols = dict.fromkeys(T["arm_columns"])
    cols.update(energy_j=energy_j,
                joules_per_token=None if energy_j is None else energy_j / (r["num_requests"] * r["output_len"]))
    if not samples:
        return cols
    t = [s["time_unix_s"] for s in samples]
    power = [s["power_w"] for s in samples if s.get("power_w") is not None]
    bits = [int(s["throttle_reasons"]) for s in samples if s.get("throttle_reasons") is not None]
    seen = None
    if bits:
        seen = 0
        for b in bits:
            seen |= b
        seen &= ~T["ignored_reasons_mask"]
    sm, mem = _minmax(samples, "sm_clock_mhz"), _minmax(samples, "mem_clock_mhz")
    cols.update(telemetry_samples=len(samples), sample_rate_hz=(len(t) - 1) / (t[-1] - t[0]) if t[-1] > t[0] else None,
                mean_power_w=statistics.fmean(power) if power else None, min_sm_clock_mhz=sm[0], max_sm_clock_mhz=sm[1],
                min_mem_clock_mhz=mem[0], max_mem_clock_mhz=mem[1], throttle_reasons_seen=seen,
                throttled=None if seen is None else seen != 0,
                clock_changed=any(lo is not None and lo != hi for lo, hi in (sm, mem)),
                sampler_cpu_s=(tele.get("sampler") or {}).get("cpu_s"))
    return cols


def check_sample_rate(ctx: Audit, records: list[dict]) -> None:
    """Each sampled run reached ``min_sample_hz`` (a rate below it could miss a short throttle)."""
    if ctx.version < SINCE:
        return
    for r in records:
        rate = arm_columns(r)["sample_rate_hz"]
        if rate is not None and rate < T["min_sample_hz"]:
            ctx.fail("telemetry", f"record {r['job']} seq {r['seq']} ({r['arm']}): sampled at {rate:.2f} Hz, below "
                                  f"the contract's {T['min_sample_hz']} Hz")
        ctx.count("telemetry_runs")
