"""The report sections of bundle format 5, rendered by the auditor from re-derived figures: each point's
P / D in the result table, graph coverage (from the re-derived results), telemetry and energy (from the
arms rows the auditor derives from the raw samples). Templates: the contract's ``report`` section."""
from __future__ import annotations

import statistics

from . import contract

R = contract.FORMAT["report"]
WORDS = R["words"]


def workload(plan: dict, point_key: str) -> str:
    """"P / D": the point's own prompt_len, else the workload's prompt label; the point's output_len."""
    from .render import _prompt_label

    pt = next(p for p in plan["points"] if p["key"] == point_key)
    wl = plan["config"]["workload"]
    prompt = str(pt["prompt_len"]) if pt.get("prompt_len") is not None else _prompt_label(wl)
    return R["result"]["workload"].format(prompt=prompt, output_len=pt.get("output_len", wl["output_len"]))


def graph_coverage(w: dict, plan: dict, results: list[dict]) -> list[str]:
    """Per result its arms' eager fractions and the verdict bar; ``w`` the bundle's wording (render.wording)."""
    from .render import _table

    spec = R["graph_coverage"]

    def frac(v) -> str:
        return WORDS["na"] if v is None else spec["fraction"].format(v)

    rows = [spec["row"].format(**r, workload=workload(plan, r["point"]),
                               baseline_fraction=frac(r["graph_coverage"]["baseline_eager_fraction"]),
                               candidate_fraction=frac(r["graph_coverage"]["candidate_eager_fraction"]),
                               gap=frac(r["graph_coverage"]["max_pair_gap"]),
                               bar=spec["barred"] if r["graph_coverage"]["differs"] else spec["no_bar"])
            for r in results]
    return ["", R["headings"]["graph_coverage"], "",
            spec["text"].format(tolerance=plan["config"]["verdict"]["eager_fraction_tolerance"]), ""] \
        + _table(w, spec["columns"], rows)


def _row(dev: str, point: str, arm: str, g: list[dict]) -> str:
    spec = R["telemetry"]

    def got(key: str) -> list:
        return [a[key] for a in g if a[key] is not None]

    def med(fmt: str, key: str) -> str:
        return spec[fmt].format(statistics.median(got(key))) if got(key) else WORDS["na"]

    def clock(name: str) -> str:
        lo, hi = got(f"min_{name}_clock_mhz"), got(f"max_{name}_clock_mhz")
        return spec["range"].format(int(min(lo)), int(max(hi))) if lo and hi else WORDS["na"]

    cpu = [a["sampler_cpu_s"] / a["elapsed_s"] for a in g if a["sampler_cpu_s"] is not None]
    flags = []
    for name, key in (("flag_throttle", "throttled"), ("flag_clocks", "clock_changed")):
        n = sum(1 for a in g if a[key])
        if n:
            flags.append(spec["flag"].format(name=spec[name], n=n, runs=len(g)))
    return spec["row"].format(
        device=dev, point=point, arm=arm, runs=len(g),
        samples=str(int(statistics.median(got("telemetry_samples")))) if got("telemetry_samples") else WORDS["na"],
        rate=spec["rate"].format(min(got("sample_rate_hz"))) if got("sample_rate_hz") else WORDS["na"],
        power=med("power", "mean_power_w"), energy=med("energy", "energy_j"), per_token=med("per_token", "joules_per_token"),
        sm=clock("sm"), mem=clock("mem"), cpu=spec["cpu"].format(max(cpu)) if cpu else WORDS["na"],
        flags=spec["flag_separator"].join(flags) or spec["no_flag"])


def telemetry(w: dict, plan: dict, arm_rows: list[dict]) -> list[str]:
    """Per (GPU, point, arm) its runs' telemetry, or the "no telemetry" line when no run was sampled;
    ``w`` the bundle's wording (render.wording)."""
    from .render import _groups, _table

    spec = R["telemetry"]
    head = ["", R["headings"]["telemetry"], ""]
    if not any(a["telemetry_samples"] is not None for a in arm_rows):
        return head + [spec["none"]]
    rows = [_row(dev, point, arm, g) for (dev, point, arm), g in _groups(arm_rows, ["device", "point", "arm"])]
    return head + [spec["text"].format(sample_hz=plan["config"]["telemetry"]["sample_hz"]), ""] \
        + _table(w, spec["columns"], rows)
