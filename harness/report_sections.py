"""The report sections of bundle format 5: each point's workload (P / D), graph coverage, telemetry and energy;
and format 9's runtime settings.

Rendered from the plan, the summary and the arms table (the runtime settings: from the raw records) by the
contract's ``report`` templates (``loopbench/bundle_format.json``), like the rest of ``report.md``
(harness/report.py); the auditor renders the same sections from the raw records with its own code
(audit/render_sections.py, audit/check_settings.py).
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from .evidence import FORMAT

R = FORMAT["report"]
WORDS = R["words"]


def workload_label(plan: dict, point_key: str) -> str:
    """"P / D" of a point: its own prompt_len, else the workload's prompt label ("31,32,63,33 cycled")."""
    from .report import prompt_label

    pt = next(p for p in plan["points"] if p["key"] == point_key)
    wl = plan["config"]["workload"]
    prompt = str(pt["prompt_len"]) if pt.get("prompt_len") is not None else prompt_label(wl)
    return R["result"]["workload"].format(prompt=prompt, output_len=pt.get("output_len", wl["output_len"]))


def arm_groups(arms: pd.DataFrame, plan: dict):
    """(row fields, runs) per (GPU, point, arm), points in plan order (format 5: points of one B / C with
    their own workloads are separate rows); the fields are device, max_num_seqs, num_requests, workload, arm."""
    order = {p["key"]: i for i, p in enumerate(plan["points"])}
    for (dev, _, arm), g in arms.assign(point_index=arms["point"].map(order)).groupby(["device", "point_index", "arm"]):
        yield {"device": dev, "max_num_seqs": int(g["max_num_seqs"].iloc[0]), "num_requests": int(g["num_requests"].iloc[0]),
               "workload": workload_label(plan, g["point"].iloc[0]), "arm": arm}, g


def _fraction(value) -> str:
    return WORDS["na"] if value is None else R["graph_coverage"]["fraction"].format(value)


def graph_coverage(plan: dict, summary: dict) -> list[str]:
    """Per result: each arm's median eager fraction, the largest pair gap and whether the verdict is barred."""
    spec, rows = R["graph_coverage"], []
    for r in summary["results"]:
        gc = r["graph_coverage"]
        rows.append(spec["row"].format(**r, workload=workload_label(plan, r["point"]),
                                       baseline_fraction=_fraction(gc["baseline_eager_fraction"]),
                                       candidate_fraction=_fraction(gc["candidate_eager_fraction"]), gap=_fraction(gc["max_pair_gap"]),
                                       bar=spec["barred"] if gc["differs"] else spec["no_bar"]))
    from .report import table_lines

    text = spec["text"].format(tolerance=plan["config"]["verdict"]["eager_fraction_tolerance"])
    return ["", R["headings"]["graph_coverage"], "", text, ""] + table_lines(spec["columns"], rows)


def _present(series: pd.Series) -> list:
    return [v for v in series if v is not None and not pd.isna(v)]


def _median(spec_key: str, series: pd.Series) -> str:
    vals = _present(series)
    return R["telemetry"][spec_key].format(float(np.median(vals))) if vals else WORDS["na"]


def _range(lo: pd.Series, hi: pd.Series) -> str:
    los, his = _present(lo), _present(hi)
    return R["telemetry"]["range"].format(int(min(los)), int(max(his))) if los and his else WORDS["na"]


def _flags(g: pd.DataFrame) -> str:
    spec = R["telemetry"]
    flags = [spec["flag"].format(name=spec[f"flag_{name}"], n=n, runs=len(g))
             for name, col in (("throttle", "throttled"), ("clocks", "clock_changed"))
             if (n := sum(bool(v) for v in _present(g[col])))]
    return spec["flag_separator"].join(flags) or spec["no_flag"]


def _telemetry_row(key: tuple, g: pd.DataFrame) -> str:
    spec = R["telemetry"]
    dev, point, arm = key
    rates = _present(g["sample_rate_hz"])
    cpu = [c / e for c, e in zip(g["sampler_cpu_s"], g["elapsed_s"]) if c is not None and not pd.isna(c)]
    samples = _present(g["telemetry_samples"])
    return spec["row"].format(
        device=dev, point=point, arm=arm, runs=len(g),
        samples=str(int(np.median(samples))) if samples else WORDS["na"],
        rate=spec["rate"].format(min(rates)) if rates else WORDS["na"], power=_median("power", g["mean_power_w"]),
        energy=_median("energy", g["energy_j"]), per_token=_median("per_token", g["joules_per_token"]),
        sm=_range(g["min_sm_clock_mhz"], g["max_sm_clock_mhz"]), mem=_range(g["min_mem_clock_mhz"], g["max_mem_clock_mhz"]),
        cpu=spec["cpu"].format(max(cpu)) if cpu else WORDS["na"], flags=_flags(g))


def telemetry(plan: dict, arms: pd.DataFrame) -> list[str]:
    """Per (GPU, point, arm) the telemetry of its measured runs, or the contract's "no telemetry" line."""
    from .report import table_lines

    spec = R["telemetry"]
    head = ["", R["headings"]["telemetry"], ""]
    if not len(arms) or not _present(arms["telemetry_samples"]):
        return head + [spec["none"]]
    rows = [_telemetry_row(key, g) for key, g in arms.groupby(["device", "point", "arm"], sort=True)]
    return head + [spec["text"].format(sample_hz=plan["config"]["telemetry"]["sample_hz"]), ""] + \
        table_lines(spec["columns"], rows)


def setting_text(value) -> str:
    """One engine setting as report.md shows it: a non-empty string as it is, any other JSON scalar as JSON
    writes it (``""``, ``true``, ``false``, ``null``, ``16``, ``0.5``)."""
    return value if isinstance(value, str) and value else json.dumps(value)


def runtime_settings(plan: dict, records: list[dict], heading: str | None = None, text: str | None = None) -> list[str]:
    """Format 9's Runtime settings section from the raw records' ``engine_settings`` (``report.runtime_settings``).
    Each arm's value of a setting is its runs' values, each once, in run order (runs by plan point, then job and
    seq; a run without the setting holds n/a), joined by " / " (an arm run at two points: "16 / 32"). A table of
    the settings whose value differs between arms, one column per arm (in name order), then the line of those
    every arm shares; the contract's "none" line when no run's engine reported any; nothing without runs.
    ``heading`` and ``text`` (the section's own by default) word it for other runs: format 10's online runs
    (``online.report.settings_heading``, harness/online/evidence.py)."""
    from .report import table_lines

    spec = R["runtime_settings"]
    order = {p["key"]: i for i, p in enumerate(plan["points"])}
    runs = sorted(records, key=lambda r: (order.get(r["point"], len(order)), r["job"], r["seq"]))
    if not runs:
        return []
    reported = [r.get("engine_settings") or {} for r in runs]
    keys = sorted({key for settings in reported for key in settings})
    head = ["", heading or R["headings"]["runtime_settings"], ""]
    if not keys:
        return head + [spec["none"]]
    arms = sorted({r["arm"] for r in runs})
    rows, shared = [], []
    for key in keys:
        texts = [setting_text(settings[key]) if key in settings else WORDS["na"] for settings in reported]
        cells = [spec["value_separator"].join(dict.fromkeys(t for r, t in zip(runs, texts) if r["arm"] == arm))
                 for arm in arms]
        if len(set(cells)) == 1:
            shared.append(spec["setting"].format(key=key, value=cells[0]))
        else:
            rows.append(spec["row"].format(setting=key, cells=spec["cell_separator"].join(cells)))
    table = table_lines([spec["column"], *arms], rows) + [""] if rows else []
    return head + [text or spec["text"], ""] + table + [
        spec["shared"].format(settings=spec["setting_separator"].join(shared) or spec["shared_none"])]
