"""``report.md`` as the bundle makes it: the auditor's own rendering, line for line.

The report a bundle carries must be exactly this text: every figure in it (header hashes, result rows,
statistics, the checks line, Graph counters and memory, children) is rendered here from values the
auditor re-derived (:mod:`.derive`) or verified (plan, environment, children), never from the claims
being audited. Sections, headings, column headings, sentences and number formats are the ``report``
section of the format contract, which ``harness/report.py`` renders by too; any other line, hidden or
visible, is a discrepancy.
"""
from __future__ import annotations

from . import check_natural, contract, render_sections

R = contract.FORMAT["report"]
WORDS = R["words"]
FREE_TEXT = "loopbench/bundle_format.json report.free_text"


def one_line(line: str) -> str:
    """``line``, refused (ValueError) when a string of the bundle in it would break it into several lines
    of report.md (a newline, carriage return or any other line boundary: a forged heading or row)."""
    if line.splitlines() not in ([line], []):
        raise ValueError(f"a string of the bundle would break report.md's lines ({FREE_TEXT}): {line!r}")
    return line


def _table(columns: list[str], rows: list[str]) -> list[str]:
    """A table; a row whose strings hold a '|' (a forged cell) is refused (ValueError)."""
    for row in rows:
        if row.count("|") != len(columns) + 1:
            raise ValueError(f"a string of the bundle would add cells to a report.md table ({FREE_TEXT}): {row!r}")
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows]


def _ci(ci: list | None, missing: str) -> str:
    return R["ci"].format(*ci) if ci else missing


def result_row(res: dict, workload: str | None = None) -> str:
    """One seed-style row: GPU, B / C, [P / D (format 5),] tokens/s of each arm, speedup [CI], change, verdict."""
    st = res["stats"]
    return R["result"]["row" if workload is None else "row_since_5"].format(workload=workload, **{
        **res, "speedup": st["speedup"], "ci": _ci(st["ci"], f"[{WORDS['na']}]"),
        "change_pct": 100 * (st["speedup"] - 1),
        "verdict": res["verdict"] if res["verdict"] is not None else WORDS["no_verdict"]})


def _result_tables(results: list[dict], plan: dict | None = None) -> list[str]:
    """One table per comparison; with the ``plan`` (format 5) each point's P / D too."""
    columns = R["result"]["columns"] if plan is None else R["result"]["columns_since_5"]

    def label(res: dict) -> str | None:
        return None if plan is None else render_sections.workload(plan, res["point"])

    by_comparison: dict[str, list[dict]] = {}
    for res in results:
        by_comparison.setdefault(res["comparison"], []).append(res)
    lines = []
    for comp, rows in by_comparison.items():
        b, c = rows[0]["baseline"], rows[0]["candidate"]
        lines += [R["result"]["subheading"].format(comparison=comp, aa=WORDS["aa"] if b == c else ""), ""]
        lines += _table([h.format(baseline=b, candidate=c) for h in columns], [result_row(r, label(r)) for r in rows])
        lines.append("")
    return lines or [""]   # no results: one empty line, as harness/report.py writes it


def _prompt_label(wl: dict) -> str:
    """One P, a cycled mix of ``prompt_lens`` ("31,32,63,33 cycled"), or "file"."""
    if wl["prompts_file"]:
        return WORDS["prompts_file"]
    if wl.get("prompt_lens"):
        return ",".join(str(n) for n in wl["prompt_lens"]) + WORDS["cycled"]
    return str(wl["prompt_len"])


def _reasons(summary: dict) -> str:
    """The incomplete reasons in words: status codes worded by the contract (a version-1 summary's are
    sentences already)."""
    return R["reason_separator"].join(r if isinstance(r, str) else contract.reason_text(r)
                                      for r in summary["incomplete_reasons"])


def _header(plan: dict, plan_sha256: str, prompts_sha256: str, summary: dict, environment: dict) -> list[str]:
    cfg, code, ckpt = plan["config"], plan["code"], plan["checkpoint"]
    wl = cfg["workload"]
    lines = [R["title"].format(name=plan["name"], state=R["state"][summary["status"]]), ""]
    if summary["status"] != "complete":
        lines += [R["banner"]["incomplete"].format(reasons=_reasons(summary)), ""]
    elif not summary["verdicts_published"]:
        lines += [R["banner"]["checks_failed"], ""]
    facts = {**cfg["exit"], "git_sha": code["git_sha"] or WORDS["unknown_sha"],
             "dirty": WORDS["dirty"] if code["git_dirty"] else "", "plan_sha256": plan_sha256,
             "description": ckpt["description"], "dtype": cfg["model"]["dtype"], "checkpoint_sha256": ckpt["sha256"],
             "prompt": _prompt_label(wl), "output_len": wl["output_len"], "prompts_sha256": prompts_sha256,
             "reference_arm": plan["reference_arm"], "pairs": cfg["pairs"], "order_seed": cfg["order_seed"],
             "warmup": WORDS["warmup"] if cfg["warmup"] else WORDS["no_warmup"],
             "torch": environment.get("torch", {}).get("version"),
             "triton": environment.get("packages", {}).get("triton"),
             "python": environment.get("python", {}).get("version")}
    return lines + [line.format(**facts) for line in R["header"]]


def _statistics(results: list[dict]) -> list[str]:
    spec, rows = R["statistics"], []
    for r in results:
        st = r["stats"]
        p = spec["p"].format(p=st["wilcoxon_p"], method=st["wilcoxon_method"]) if st["wilcoxon_p"] is not None \
            else WORDS["na"]
        rows.append(spec["row"].format(**{**r, **st, "bca": _ci(st["bca_ci"], WORDS["undefined"]), "p": p}))
    return [R["headings"]["statistics"], ""] + _table(spec["columns"], rows)


def _checks(checks: dict) -> list[str]:
    spec, findings = R["checks"], checks["findings"]
    most = spec["max_findings"]
    lines = [R["headings"]["checks"], "",
             spec["line"].format(**checks, outcome=WORDS["pass"] if checks["ok"] else WORDS["fail"])]
    lines += [spec["finding"].format(message=f["message"]) for f in findings[:most]]
    if len(findings) > most:
        lines.append(spec["more"].format(n=len(findings) - most))
    return lines + [spec["warning"].format(warning=w) for w in checks.get("warnings", [])]


def _mib(values: list) -> str:
    present = [v for v in values if v is not None]
    return R["graph_memory"]["mib"].format(max(present) / 2**20) if present else WORDS["na"]


def _groups(arm_rows: list[dict], keys: list[str]) -> list[tuple[tuple, list[dict]]]:
    groups: dict[tuple, list[dict]] = {}
    for a in arm_rows:
        groups.setdefault(tuple(a[k] for k in keys), []).append(a)
    return sorted(groups.items())


def _cell_groups(arm_rows: list[dict], spec: dict, plan: dict | None) -> list[tuple[dict, list[dict]]]:
    """(row fields, runs) per (GPU, B, C, arm); with the plan (format 5) per (GPU, point in plan order, arm),
    the fields then with the point's P / D as ``workload``."""
    if plan is None:
        return [({"device": d, "max_num_seqs": b, "num_requests": c, "arm": a}, g)
                for (d, b, c, a), g in _groups(arm_rows, spec["group_by"])]
    index = {p["key"]: i for i, p in enumerate(plan["points"])}
    keyed = [{**a, "point_index": index[a["point"]]} for a in arm_rows]
    return [({"device": d, "max_num_seqs": g[0]["max_num_seqs"], "num_requests": g[0]["num_requests"], "arm": a,
              "workload": render_sections.workload(plan, g[0]["point"])}, g)
            for (d, _, a), g in _groups(keyed, ["device", "point_index", "arm"])]


def _graph_memory(arm_rows: list[dict], plan: dict | None = None) -> list[str]:
    """Per (GPU, B, C, arm) (format 5: per point): runs, Graph captures / replays / fallbacks, peak memory, KV blocks."""
    spec, rows = R["graph_memory"], []
    since_5 = "" if plan is None else "_since_5"

    def total(g: list[dict], *keys: str) -> int:
        return int(sum(r[k] or 0 for r in g for k in keys))

    for cell, g in _cell_groups(arm_rows, spec, plan):
        rows.append(spec["row" + since_5].format(
            **cell, runs=len(g),
            warmup_captures=total(g, "warmup_captures", "warmup_prefill_captures"),
            captures=total(g, "captures", "prefill_captures"), replays=total(g, "replays"),
            fallbacks=total(g, "fallbacks"), prefill_replays=total(g, "prefill_replays"),
            prefill_fallbacks=total(g, "prefill_fallbacks"),
            peak_allocated_mib=_mib([r["peak_allocated_bytes"] for r in g]),
            peak_reserved_mib=_mib([r["peak_reserved_bytes"] for r in g]),
            kv_blocks=max(r["kv_blocks_used"] for r in g)))
    return [R["headings"]["graph_memory"], ""] + _table(spec["columns" + since_5], rows)


def _count_text(value) -> str:
    return R["coverage"]["list_separator"].join(str(v) for v in value) if isinstance(value, list) else str(value)


def _coverage(arm_rows: list[dict], plan: dict | None = None) -> list[str]:
    """Per (GPU, B, C, arm) (format 5: per point), the coverage counts its runs share ("varies" where not)."""
    spec = R["coverage"]
    if "coverage_routed_reads" not in arm_rows[0]:
        return []
    rows, since_5 = [], "" if plan is None else "_since_5"
    for cell, g in _cell_groups(arm_rows, spec, plan):
        cells = []
        for key in spec["counts"]:
            texts = {_count_text(r[f"coverage_{key}"]) for r in g}
            cells.append(texts.pop() if len(texts) == 1 else WORDS["varies"])
        rows.append(spec["row" + since_5].format(**cell, runs=len(g), cells=" | ".join(cells)))
    return ["", R["headings"]["coverage"], "", spec["text"], ""] + _table(spec["columns" + since_5], rows)


def _children(children: list[dict]) -> list[str]:
    """One row per child of every run of the bundle, named by its session id (its name before resume)."""
    spec = R["children"]
    rows = [spec["row"].format(**{**c, "session": c.get("session", c["name"]),
                                  "wall": WORDS["na"] if c["wall_s"] is None else spec["wall"].format(c["wall_s"])})
            for c in children]   # wall_s None: never started, or its controller died
    return [R["headings"]["children"], ""] + _table(spec["columns"], rows)


# ------------------------------------------------------------------- format 4: sessions, drift

def _num(template: str, value) -> str:
    return WORDS["na"] if value is None else template.format(value)


def _rule(plan: dict, summary: dict, version: int) -> str:
    vd = plan["config"]["verdict"]
    if version < contract.DOCS["plan"]["sessions_since"]:
        return R["result"]["rule"].format(**vd)
    return R["result"]["rule_since_4"].format(**vd, **summary["evidence_rule"])


def _sessions(plan: dict, summary: dict) -> list[str]:
    """Per result each session's median, between / within SDs and the pooled median [CI]; the plan's MDE."""
    spec, de = R["sessions"], plan["detectable_effect"]
    noise = de["noise"]
    mde = spec["mde"].format(**de, sigma=_num(spec["sigma"], noise["sigma_log_ratio"]),
                             source=spec["source"][noise["source"]].format(**noise),
                             mde=_num(spec["mde_value"], de["mde_relative"]))
    rows = []
    for r in summary["results"]:
        ev = r["evidence"]
        medians = spec["median_separator"].join(spec["median"].format(m) for m in ev["session_medians"])
        rows.append(spec["row"].format(**r, n_sessions=len(ev["sessions"]), medians=medians,
                                       between=_num(spec["sd"], ev["between_sd"]), within=_num(spec["sd"], ev["within_sd"]),
                                       speedup=r["stats"]["speedup"], ci=_ci(r["stats"]["ci"], f"[{WORDS['na']}]")))
    return ["", R["headings"]["sessions"], "", spec["text"].format(**summary["evidence_rule"]), "", mde, ""] \
        + _table(spec["columns"], rows)


def _drift(summary: dict) -> list[str]:
    """Per result the Spearman trend and Mann-Whitney order test; per device the allocator creep."""
    spec, rows = R["drift"], []
    for r in summary["results"]:
        t, o = r["evidence"]["trend"], r["evidence"]["order"]
        flags = [spec["flag_trend"]] * t["flag"] + [spec["flag_order"]] * o["flag"]
        rows.append(spec["row"].format(**r, n_baseline_first=o["n_baseline_first"],
                                       n_candidate_first=o["n_candidate_first"], rho=_num(spec["stat"], t["statistic"]),
                                       trend_p=_num(spec["p"], t["p"]), u=_num(spec["stat"], o["statistic"]),
                                       order_p=_num(spec["p"], o["p"]),
                                       flags=spec["flag_separator"].join(flags) or spec["no_flag"]))
    creep = []
    for c in summary["memory_creep"]:
        mib = [None if v is None else v / 2**20 for v in (c["first"], c["last"])]
        creep.append(spec["creep_row"].format(device=c["device"], n=c["n"], first=_num(spec["mib"], mib[0]),
                                              last=_num(spec["mib"], mib[1]), rho=_num(spec["stat"], c["statistic"]),
                                              p=_num(spec["p"], c["p"]),
                                              flag=spec["flag_creep"] if c["flag"] else spec["no_flag"]))
    return ["", R["headings"]["drift"], "", spec["text"].format(**summary["evidence_rule"]), ""] \
        + _table(spec["columns"], rows) + [""] + _table(spec["creep_columns"], creep)


def report(plan: dict, plan_sha256: str, prompts_sha256: str, summary: dict, arm_rows: list[dict],
           environment: dict, version: int = contract.VERSION, online: list[str] = ()) -> str:
    """The whole ``report.md`` text of a bundle of format ``version`` whose re-derived summary is
    ``summary``: that version's sections in the contract's order (the arm sections only with arms)."""
    sections = {
        "header": lambda: _header(plan, plan_sha256, prompts_sha256, summary, environment),
        "result": lambda: ["", R["headings"]["result"], "",
                           *_result_tables(summary["results"], plan if version >= 5 else None),
                           _rule(plan, summary, version), ""],
        "statistics": lambda: _statistics(summary["results"]),
        "sessions": lambda: _sessions(plan, summary),
        "drift": lambda: _drift(summary),
        "natural": lambda: check_natural.report_lines(plan, summary.get("natural"), _table),
        "checks": lambda: ["", *_checks(summary["checks"])],
        "graph_memory": lambda: ["", *_graph_memory(arm_rows, plan if version >= 5 else None)] if arm_rows else [],
        "coverage": lambda: _coverage(arm_rows, plan if version >= 5 else None) if arm_rows else [],
        "graph_coverage": lambda: render_sections.graph_coverage(plan, summary["results"]),
        "telemetry": lambda: render_sections.telemetry(plan, arm_rows),
        "children": lambda: ["", *_children(summary["children"])],
        "online": lambda: list(online),   # format 5: check_online.report_lines
        "plot": lambda: ["", R["plot"], ""],
    }
    return "\n".join(one_line(line) for name in R["sections_by_version"][str(version)] for line in sections[name]())
