"""The human-readable side of a bundle: the seed-style result table, ``report.md`` and the plot of
paired ratios. Pure rendering from the summary and the tables that ``evidence.py`` builds.

Every heading, column heading, sentence and number format comes from the ``report`` section of the bundle
format contract (``loopbench/bundle_format.json``); this module only derives the fields those templates
name. The auditor re-renders the whole report from the raw records with its own code (``audit/render.py``,
driven by the same contract) and requires ``report.md`` to match it line for line.
"""
from __future__ import annotations

import io
import re
import string
from pathlib import Path

import numpy as np
import pandas as pd

from . import natural, report_sections, roofline, stats
from .evidence import FORMAT, atomic_write_bytes
from .exit_status import exit_status_text

_SINCE = re.compile(r"(.+)_since_(\d+)")


def wording(section, version: int):
    """The contract's ``report`` section as a bundle of format ``version`` words it: a key ``k_since_N``
    (the latest N <= ``version``) replaces ``k`` at every depth; later wordings are left out."""
    if not isinstance(section, dict):
        return section
    chosen: dict[str, tuple[int, object]] = {}
    for key, value in section.items():
        m = _SINCE.fullmatch(key)
        base, since = (m[1], int(m[2])) if m else (key, 0)
        if since <= version and since >= chosen.get(base, (-1, None))[0]:
            chosen[base] = (since, wording(value, version))
    return {key: value for key, (_, value) in chosen.items()}


class _Counted(string.Formatter):
    """str.format plus the contract's count field ``{n:one|many}``: "1 pair", "2 pairs", "1,024 tokens"."""

    def format_field(self, value, format_spec: str) -> str:
        if "|" not in format_spec:
            return super().format_field(value, format_spec)
        one, many = format_spec.split("|")
        return f"{value:,} {one if value == 1 else many}"


R = wording(FORMAT["report"], FORMAT["version"])   # the harness writes the current format only
WORDS = R["words"]
CODES = wording(FORMAT["status_codes"], FORMAT["version"])["codes"]   # a code's text_since_N, as the report's
fill = _Counted().format


def level_text(confidence: float) -> str:
    """The interval's level as the report names it: 0.95 -> "95%" (``verdict.confidence``)."""
    return R["level"].format(100 * confidence)


def shown_device(label: str, r: dict = R) -> str:
    """A device as the report (``r``: the wording of a format, default the current) names it: "CPU", or the GPU's
    label ("H200 #0")."""
    return r["device_names"].get(label, label)


def reason_text(reason: dict, children: list[dict] = ()) -> str:
    """The contract's words for one status code of ``summary.json`` ``incomplete_reasons``; a
    ``child_failed`` code names its child's exit status, from the child's latest entry in ``children``
    (``children.json``'s entries; the code's own fields where none has its session id)."""
    fields = {k: v for k, v in reason.items() if k != "code"}
    if reason["code"] == "child_failed":
        entries = [c for c in children if c.get("session", c["name"]) == reason["child"]]
        fields["exit_status"] = exit_status_text(entries[-1] if entries else reason)
    return CODES[reason["code"]]["text"].format(**fields)


def reasons_text(summary: dict) -> str:
    """Every incomplete reason of a summary in words, joined as the report joins them ("" when complete)."""
    children = summary.get("children", [])
    return R["reason_separator"].join(reason_text(r, children) for r in summary["incomplete_reasons"])


def table_lines(columns: list[str], rows: list[str], r: dict = R) -> list[str]:
    """A markdown table: its heading row (the column names of ``r``'s wording), the ``---`` row and the rendered
    rows."""
    columns = [r["column_names"].get(c, c) for c in columns]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows]


def ci_text(ci: list | None, r: dict = R) -> str:
    return r["ci"].format(*ci) if ci else f"[{r['words']['na']}]"


def table_row(res: dict, workload: str, r: dict = R) -> str:
    """One seed-style row (device, B / C, P / D ``workload``, tokens/s of each arm, speedup [CI], change,
    verdict), in ``r``'s wording."""
    st = res["stats"]
    verdict = res["verdict"] if res["verdict"] is not None else r["words"]["no_verdict"]
    return r["result"]["row"].format(workload=workload, **{
        **res, "device": shown_device(res["device"], r), "speedup": st["speedup"], "ci": ci_text(st["ci"], r),
        "change_pct": 100 * (st["speedup"] - 1), "verdict": verdict})


def result_tables(summary: dict, plan: dict, version: int | None = None) -> str:
    """The seed's table, one per comparison (device, B / C, P / D of the ``plan``'s point, tokens/s of each
    arm, speedup [CI], change), as format ``version`` words it: by default the current format, which the harness
    writes; ``loopbench show`` passes a bundle's own, whose report.md says it so."""
    r = R if version is None else wording(FORMAT["report"], version)
    spec, out = r["result"], []
    columns = spec["columns"]
    comps: dict[str, list[dict]] = {}
    for res in summary["results"]:
        comps.setdefault(res["comparison"], []).append(res)
    for comp, rows in comps.items():
        b, c = rows[0]["baseline"], rows[0]["candidate"]
        level = r["level"].format(100 * rows[0]["stats"]["confidence"])
        out += [spec["subheading"].format(comparison=comp, aa=r["words"]["aa"] if b == c else ""), ""]
        out += table_lines([h.format(baseline=b, candidate=c, level=level) for h in columns],
                           [table_row(x, report_sections.workload_label(plan, x["point"]), r) for x in rows], r)
        out.append("")
    return "\n".join(out)


def noise_floor_lines(summary: dict, plan: dict) -> list[str]:
    """The result section's warnings (format 15): one per ``noise_floor`` entry (diagnostics.noise_floor), naming
    the A/A row, its ratio and CI and the verdicts of its point that its noise undermines, then a blank line."""
    spec, lines = R["noise_floor"], []
    for entry in summary.get("noise_floor", []):
        at = [r for r in summary["results"] if r["job"] == entry["job"] and r["point"] == entry["point"]]
        aa = next(r for r in at if r["comparison"] == entry["comparison"])
        verdicts = {r["comparison"]: r["verdict"] if r["verdict"] is not None else WORDS["no_verdict"] for r in at}
        affected = spec["affected_separator"].join(spec["affected"].format(comparison=c, verdict=verdicts[c])
                                                   for c in entry["affected"]) or spec["no_affected"]
        lines.append(spec["line"].format(**{
            **aa, **entry, "device": shown_device(entry["device"]), "ci": ci_text(entry["ci"]),
            "workload": report_sections.workload_label(plan, entry["point"]), "change_pct": 100 * (entry["speedup"] - 1),
            "level": level_text(aa["stats"]["confidence"]), "affected": affected}))
    return lines + [""] if lines else []


def cpu_load_lines(environment: dict) -> list[str]:
    """The header's warning of a CPU run measured on a busy machine (format 15): environment.json ``cpu_load``
    judged by the contract's ``cpu_load_rule`` (machine.cpu_load_kind), after a blank line; none without."""
    from .machine import cpu_load_kind

    load = environment.get("cpu_load")
    kind = cpu_load_kind(load) if load else None
    return ["", fill(R["cpu_load"][kind], **load)] if kind else []


def prompt_label(wl: dict) -> str:
    """The header's prompt lengths: one P, a cycled mix ("31,32,63,33 cycled") or "file"."""
    if wl["prompts_file"]:
        return WORDS["prompts_file"]
    if wl.get("prompt_lens"):
        return ",".join(str(n) for n in wl["prompt_lens"]) + WORDS["cycled"]
    return str(wl["prompt_len"])


def _header(plan: dict, summary: dict, environment: dict) -> list[str]:
    cfg, code, ckpt = plan["config"], plan["code"], plan["checkpoint"]
    wl, ex = cfg["workload"], cfg["exit"]
    lines = [R["title"].format(name=plan["name"], state=R["state"][summary["status"]]), ""]
    if summary["status"] != "complete":
        lines += [R["banner"]["incomplete"].format(reasons=reasons_text(summary)), ""]
    elif not summary["verdicts_published"]:
        lines += [R["banner"]["checks_failed"], ""]
    fields = {"git_sha": code["git_sha"] or WORDS["unknown_sha"], "dirty": WORDS["dirty"] if code["git_dirty"] else "",
              "plan_sha256": summary["plan_sha256"], "description": ckpt["description"], "dtype": cfg["model"]["dtype"],
              "checkpoint_sha256": ckpt["sha256"], "prompt": prompt_label(wl), "output_len": wl["output_len"],
              "prompts_sha256": plan["prompts"]["sha256"], "reference_arm": plan["reference_arm"], **ex,
              "pairs": cfg["pairs"], "order_seed": cfg["order_seed"],
              "warmup": WORDS["warmup"] if cfg["warmup"] else WORDS["no_warmup"],
              "torch": environment.get("torch", {}).get("version"),
              "triton": environment.get("packages", {}).get("triton"),
              "python": environment.get("python", {}).get("version")}
    return lines + [fill(line, **fields) for line in R["header"]] + cpu_load_lines(environment)


def _statistics(results: list[dict]) -> list[str]:
    spec, rows = R["statistics"], []
    for r in results:
        st = r["stats"]
        bca = R["ci"].format(*st["bca_ci"]) if st["bca_ci"] else WORDS["undefined"]
        p = spec["p"].format(p=st["wilcoxon_p"], method=st["wilcoxon_method"]) if st["wilcoxon_p"] is not None \
            else WORDS["na"]
        rows.append(spec["row"].format(**{**r, **st, "bca": bca, "p": p}))
    return [R["headings"]["statistics"], ""] + table_lines(spec["columns"], rows)


def _checks(ch: dict) -> list[str]:
    spec, findings = R["checks"], ch["findings"]
    most = spec["max_findings"]
    lines = [R["headings"]["checks"], "",
             fill(spec["line"], **ch, outcome=WORDS["pass"] if ch["ok"] else WORDS["fail"])]
    lines += [spec["finding"].format(message=f["message"]) for f in findings[:most]]
    if len(findings) > most:
        lines.append(spec["more"].format(n=len(findings) - most))
    return lines + [spec["warning"].format(warning=w) for w in ch.get("warnings") or []]


def _mib(series) -> str:
    vals = [v for v in series if v is not None and not pd.isna(v)]
    return R["graph_memory"]["mib"].format(max(vals) / 2**20) if vals else WORDS["na"]


def _graph_memory(arms: pd.DataFrame, plan: dict) -> list[str]:
    spec, rows = R["graph_memory"], []
    for cell, g in report_sections.arm_groups(arms, plan):
        rows.append(spec["row"].format(
            **cell, runs=len(g),
            warmup_captures=int(g["warmup_captures"].fillna(0).sum() + g["warmup_prefill_captures"].fillna(0).sum()),
            captures=int(g["captures"].sum() + g["prefill_captures"].sum()), replays=int(g["replays"].sum()),
            fallbacks=int(g["fallbacks"].sum()), prefill_replays=int(g["prefill_replays"].sum()),
            prefill_fallbacks=int(g["prefill_fallbacks"].sum()), peak_allocated_mib=_mib(g["peak_allocated_bytes"]),
            peak_reserved_mib=_mib(g["peak_reserved_bytes"]), kv_blocks=int(g["kv_blocks_used"].max())))
    return ["", R["headings"]["graph_memory"], ""] + table_lines(spec["columns"], rows)


def _per_run(values) -> str:
    """The one value an arm's runs share ("a/b/c" for a list), or "varies"."""
    sep = R["coverage"]["list_separator"]
    texts = {sep.join(str(int(x)) for x in v) if isinstance(v, (list, tuple, np.ndarray)) else str(int(v))
             for v in values}
    return texts.pop() if len(texts) == 1 else WORDS["varies"]


def _coverage(arms: pd.DataFrame, plan: dict) -> list[str]:
    """Per (device, point, arm): how often each path where the layouts differ ran in one measured run."""
    spec = R["coverage"]
    if "coverage_routed_reads" not in arms.columns:
        return []
    rows = [spec["row"].format(**cell, runs=len(g),
                                       cells=" | ".join(_per_run(g[f"coverage_{k}"]) for k in spec["counts"]))
            for cell, g in report_sections.arm_groups(arms, plan)]
    return ["", R["headings"]["coverage"], "", spec["text"], ""] + table_lines(spec["columns"], rows)


def _children(children: list[dict]) -> list[str]:
    spec = R["children"]
    rows = [spec["row"].format(**{**c, "session": c.get("session", c["name"]), "exit_status": exit_status_text(c),
                                  "wall": spec["wall"].format(c["wall_s"]) if c["wall_s"] is not None else WORDS["na"]})
            for c in children]   # wall_s None: a child never started, or its controller died
    return [R["headings"]["children"], ""] + table_lines(spec["columns"], rows)


# ------------------------------------------------------------------ sessions, drift (issue 12)

def _fmt(template: str, value) -> str:
    """``template`` of a number, or the contract's n/a for None (an undefined statistic)."""
    return WORDS["na"] if value is None else template.format(value)


def rule_text(plan: dict, summary: dict) -> str:
    """The result section's sentence under the table: the verdict rule and how the interval was made."""
    vd = plan["config"]["verdict"]
    return fill(R["result"]["rule"], **vd, **summary["evidence_rule"], level=level_text(vd["confidence"]),
                verdict_alpha=1 - vd["confidence"])


def mde_line(plan: dict) -> str:
    """The plan's minimum detectable effect in words (``plan.detectable_effect``)."""
    spec, de = R["sessions"], plan["detectable_effect"]
    noise = de["noise"]
    return fill(spec["mde"], **de, sigma=_fmt(spec["sigma"], noise["sigma_log_ratio"]),
                              source=spec["source"][noise["source"]].format(**noise),
                              mde=_fmt(spec["mde_value"], de["mde_relative"]))


def _sessions(plan: dict, summary: dict) -> list[str]:
    """Per result: each session's median ratio, the spread between and within sessions, the pooled median."""
    spec, rows = R["sessions"], []
    for r in summary["results"]:
        ev, st = r["evidence"], r["stats"]
        rows.append(spec["row"].format(
            **r, n_sessions=len(ev["sessions"]), speedup=st["speedup"], ci=ci_text(st["ci"]),
            medians=spec["median_separator"].join(spec["median"].format(m) for m in ev["session_medians"]),
            between=_fmt(spec["sd"], ev["between_sd"]), within=_fmt(spec["sd"], ev["within_sd"])))
    return ["", R["headings"]["sessions"], "", fill(spec["text"], **summary["evidence_rule"]), "",
            mde_line(plan), ""] + table_lines(spec["columns"], rows)


def _flags(ev: dict) -> str:
    spec = R["drift"]
    flags = [spec[f"flag_{name}"] for name in ("trend", "order") if ev[name]["flag"]]
    return spec["flag_separator"].join(flags) or spec["no_flag"]


def _drift(summary: dict) -> list[str]:
    """Per result the trend and order tests; per device the allocator's peak creep."""
    spec, rows = R["drift"], []
    for r in summary["results"]:
        t, o = r["evidence"]["trend"], r["evidence"]["order"]
        rows.append(spec["row"].format(**r, **o, rho=_fmt(spec["stat"], t["statistic"]), trend_p=_fmt(spec["p"], t["p"]),
                                       u=_fmt(spec["stat"], o["statistic"]), order_p=_fmt(spec["p"], o["p"]),
                                       flags=_flags(r["evidence"])))
    creep = [spec["creep_row"].format(
        device=c["device"], n=c["n"], first=_fmt(spec["mib"], None if c["first"] is None else c["first"] / 2**20),
        last=_fmt(spec["mib"], None if c["last"] is None else c["last"] / 2**20), rho=_fmt(spec["stat"], c["statistic"]),
        p=_fmt(spec["p"], c["p"]), flag=spec["flag_creep"] if c["flag"] else spec["no_flag"]) for c in summary["memory_creep"]]
    # exact_up_to: the most values whose Spearman p stats.trend_test takes exactly (format 12's sentence names it)
    text = spec["text"].format(**summary["evidence_rule"], exact_up_to=stats.TREND_EXACT_UP_TO)
    return (["", R["headings"]["drift"], "", text, ""]
            + table_lines(spec["columns"], rows) + [""] + table_lines(spec["creep_columns"], creep))


def _as_shown(summary: dict, arms: pd.DataFrame) -> tuple[dict, pd.DataFrame]:
    """The summary and the arms table with every device named as the report names it (``shown_device``)."""
    summary = {**summary, **{key: [{**x, "device": shown_device(x["device"])} for x in summary[key]]
                             for key in ("results", "memory_creep", "children")}}
    return summary, arms.assign(device=arms["device"].map(shown_device)) if len(arms) else arms


def render_report(plan: dict, summary: dict, arms: pd.DataFrame, environment: dict, online: list[str] = (),
                  roof: tuple[list[dict], dict] | None = None, settings: list[str] = (),
                  superseded: list[str] = ()) -> str:
    """The whole ``report.md``: the contract's sections in its order (the arm sections only with arms);
    ``online``: the Online section's lines (harness/online/report.py), none without an online track;
    ``roof``: the roofline rows and the ceilings by session (evidence.write_roofline), none: no section;
    ``settings``: the Runtime settings section's lines (report_sections.runtime_settings of the raw records);
    ``superseded``: the lines of the records a resume superseded (superseded.report_lines, format 15), none without."""
    summary, arms = _as_shown(summary, arms)
    sections = {
        "header": lambda: _header(plan, summary, environment),
        "result": lambda: ["", R["headings"]["result"], "", *noise_floor_lines(summary, plan), result_tables(summary, plan),
                           rule_text(plan, summary), ""],
        "statistics": lambda: _statistics(summary["results"]),
        "sessions": lambda: _sessions(plan, summary),
        "drift": lambda: _drift(summary),
        "natural": lambda: natural.report_lines(plan, summary.get("natural"), R["natural"], table_lines),
        "checks": lambda: ["", *_checks(summary["checks"])],
        "graph_memory": lambda: _graph_memory(arms, plan) if len(arms) else [],
        "coverage": lambda: _coverage(arms, plan) if len(arms) else [],
        "graph_coverage": lambda: report_sections.graph_coverage(plan, summary),
        "telemetry": lambda: report_sections.telemetry(plan, arms),
        "children": lambda: ["", *_children(summary["children"])],
        "superseded": lambda: list(superseded),
        "online": lambda: list(online),
        "roofline": lambda: [] if roof is None else roofline.report_lines(
            plan, *roof, R, table_lines, report_sections.workload_label),
        "runtime_settings": lambda: list(settings),
        "plot": lambda: ["", R["plot"], ""],
    }
    return "\n".join(line for name in R["sections"] for line in sections[name]())


def plot_ratios(summary: dict, pairs: pd.DataFrame, path: Path) -> None:
    """Each pair's ratio (dots), the median (bar) and its CI (whiskers), one row per device/point/comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = summary["results"]
    fig, ax = plt.subplots(figsize=(8, 0.55 * max(len(results), 1) + 1.4))
    for y, r in enumerate(results):
        grp = pairs[(pairs["job"] == r["job"]) & (pairs["point"] == r["point"]) & (pairs["comparison"] == r["comparison"])]
        ax.scatter(grp["ratio"], np.full(len(grp), y) + np.linspace(-0.12, 0.12, len(grp)), s=14, color="0.45", zorder=2)
        st = r["stats"]
        if st["ci"]:
            ax.errorbar([st["speedup"]], [y], xerr=[[st["speedup"] - st["ci"][0]], [st["ci"][1] - st["speedup"]]],
                        fmt="none", ecolor="C0", capsize=4, zorder=3)
        ax.scatter([st["speedup"]], [y], marker="|", s=300, color="C0", zorder=4)
    ax.axvline(1.0, color="C3", lw=0.8)
    ax.set_yticks(range(len(results)))
    ax.set_yticklabels([f"{r['device']} B{r['max_num_seqs']}/C{r['num_requests']}\n{r['comparison']}" for r in results],
                       fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("pair ratio baseline_s / candidate_s (> 1: candidate faster)")
    levels = sorted({r["stats"]["confidence"] for r in results if r["stats"].get("confidence") is not None})
    level = "/".join(f"{c:.0%}" for c in levels) or "no"   # verdict.confidence, as the intervals were computed
    ax.set_title(f"Paired ratios, median and {level} CI" + ("" if summary["status"] == "complete" else " (INCOMPLETE)"))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())
