"""``report.md`` as the bundle makes it: the auditor's own rendering, line for line.

The report a bundle carries must be exactly this text: every figure in it (header hashes, result rows,
statistics, the checks line, Graph counters and memory, children) is rendered here from values the
auditor re-derived (:mod:`.derive`) or verified (plan, environment, children), never from the claims
being audited. Sections, headings, column headings, sentences and number formats are the ``report``
section of the format contract, which ``harness/report.py`` renders by too; any other line, hidden or
visible, is a discrepancy.
"""
from __future__ import annotations

import re
import string

from . import check_natural, check_sessions, contract, render_sections

WORDS = contract.FORMAT["report"]["words"]
FREE_TEXT = "loopbench/bundle_format.json report.free_text"
_SINCE = re.compile(r"(.+)_since_(\d+)")


def wording(section, version: int):
    """The contract's ``report`` section as a bundle of format ``version`` words it: at every depth a key
    ``k_since_N`` with the latest N <= ``version`` stands for ``k``; later wordings are dropped.
    harness/report.py has its twin (the auditor imports nothing of the harness); a test holds them equal."""
    if not isinstance(section, dict):
        return section
    latest: dict[str, tuple[int, object]] = {}
    for key, value in section.items():
        m = _SINCE.fullmatch(key)
        base, since = (m[1], int(m[2])) if m else (key, 0)
        if since <= version and since >= latest.get(base, (-1, None))[0]:
            latest[base] = (since, wording(value, version))
    return {key: value for key, (_, value) in latest.items()}


class _Counts(string.Formatter):
    """``str.format`` that also fills the contract's count fields, ``{n:one|many}`` -> "1 pair" / "3 pairs"."""

    def format_field(self, value, format_spec: str) -> str:
        if "|" in format_spec:
            one, many = format_spec.split("|")
            return f"{value:,} {one if value == 1 else many}"
        return super().format_field(value, format_spec)


fill = _Counts().format


def one_line(line: str) -> str:
    """``line``, refused (ValueError) when a string of the bundle in it would break it into several lines
    of report.md (a newline, carriage return or any other line boundary: a forged heading or row)."""
    if line.splitlines() not in ([line], []):
        raise ValueError(f"a string of the bundle would break report.md's lines ({FREE_TEXT}): {line!r}")
    return line


def _table(w: dict, columns: list[str], rows: list[str]) -> list[str]:
    """A table; a row whose strings hold a '|' (a forged cell) is refused (ValueError)."""
    for row in rows:
        if row.count("|") != len(columns) + 1:
            raise ValueError(f"a string of the bundle would add cells to a report.md table ({FREE_TEXT}): {row!r}")
    heading = [w["column_names"].get(c, c) for c in columns]   # format 7: "Device", not "GPU"
    return ["| " + " | ".join(heading) + " |", "|" + "---|" * len(columns), *rows]


def _ci(w: dict, ci: list | None, missing: str) -> str:
    return w["ci"].format(*ci) if ci else missing


def result_row(w: dict, res: dict, workload: str | None = None) -> str:
    """One seed-style row: device, B / C, [P / D (format 5),] tokens/s of each arm, speedup [CI], change, verdict."""
    st = res["stats"]
    return w["result"]["row"].format(workload=workload, **{
        **res, "speedup": st["speedup"], "ci": _ci(w, st["ci"], f"[{WORDS['na']}]"),
        "change_pct": 100 * (st["speedup"] - 1),
        "verdict": res["verdict"] if res["verdict"] is not None else WORDS["no_verdict"]})


def _result_tables(w: dict, results: list[dict], plan: dict | None = None) -> list[str]:
    """One table per comparison; with the ``plan`` (format 5) each point's P / D too."""
    def label(res: dict) -> str | None:
        return None if plan is None else render_sections.workload(plan, res["point"])

    by_comparison: dict[str, list[dict]] = {}
    for res in results:
        by_comparison.setdefault(res["comparison"], []).append(res)
    lines = []
    for comp, rows in by_comparison.items():
        b, c = rows[0]["baseline"], rows[0]["candidate"]
        level = w["level"].format(100 * rows[0]["stats"]["confidence"])   # verdict.confidence
        lines += [w["result"]["subheading"].format(comparison=comp, aa=WORDS["aa"] if b == c else ""), ""]
        lines += _table(w, [h.format(baseline=b, candidate=c, level=level) for h in w["result"]["columns"]],
                        [result_row(w, r, label(r)) for r in rows])
        lines.append("")
    return lines or [""]   # no results: one empty line, as harness/report.py writes it


def _prompt_label(wl: dict) -> str:
    """One P, a cycled mix of ``prompt_lens`` ("31,32,63,33 cycled"), or "file"."""
    if wl["prompts_file"]:
        return WORDS["prompts_file"]
    if wl.get("prompt_lens"):
        return ",".join(str(n) for n in wl["prompt_lens"]) + WORDS["cycled"]
    return str(wl["prompt_len"])


def exit_status(child: dict) -> str:
    """A child's exit status in the contract's words (``documents.children.exit_status``), by its rules:
    ``exit_code`` >= 0 "exit code N"; < 0 "killed by SIGTERM (15)" (the signal named by the contract's
    Linux table, never by this host); null "still running" (state running), "lost: no exit status
    recorded" (interrupted_by lost), "never started" (wall_s null), else "no exit status recorded".
    harness/exit_status.py words it for the writer; this is the auditor's own reading of the same rules,
    and a test holds the two equal."""
    words, code = contract.DOCS["children"]["exit_status"], child["exit_code"]
    if code is not None and code >= 0:
        return words["exited"].format(code=code)
    if code is not None:
        name = words["signal_names"].get(str(-code))
        if name is None:
            return words["signalled_unnamed"].format(number=-code)
        return words["signalled"].format(signal=name, number=-code)
    if child.get("state") == "running":
        return words["running"]
    if child.get("interrupted_by") == "lost":
        return words["lost"]
    if "wall_s" in child and child["wall_s"] is None:
        return words["not_started"]
    return words["unknown"]


def reason_text(reason: dict, children: list[dict], version: int) -> str:
    """One status code in the words of format ``version``; from format 8 a ``child_failed`` names the exit
    status of its child's latest entry in ``children`` (the code's own fields without one)."""
    codes = wording(contract.FORMAT["status_codes"], version)["codes"]
    fields = {k: v for k, v in reason.items() if k != "code"}
    if reason["code"] == "child_failed":
        entries = [c for c in children if c.get("session", c["name"]) == reason["child"]]
        fields["exit_status"] = exit_status(entries[-1] if entries else reason)
    return codes[reason["code"]]["text"].format(**fields)


def _reasons(w: dict, summary: dict, version: int) -> str:
    """The incomplete reasons in words: status codes worded by the contract (a version-1 summary's are
    sentences already)."""
    return w["reason_separator"].join(r if isinstance(r, str) else reason_text(r, summary["children"], version)
                                      for r in summary["incomplete_reasons"])


def _header(w: dict, version: int, plan: dict, plan_sha256: str, prompts_sha256: str, summary: dict,
            environment: dict) -> list[str]:
    cfg, code, ckpt = plan["config"], plan["code"], plan["checkpoint"]
    wl = cfg["workload"]
    lines = [w["title"].format(name=plan["name"], state=w["state"][summary["status"]]), ""]
    if summary["status"] != "complete":
        lines += [w["banner"]["incomplete"].format(reasons=_reasons(w, summary, version)), ""]
    elif not summary["verdicts_published"]:
        lines += [w["banner"]["checks_failed"], ""]
    facts = {**cfg["exit"], "git_sha": code["git_sha"] or WORDS["unknown_sha"],
             "dirty": WORDS["dirty"] if code["git_dirty"] else "", "plan_sha256": plan_sha256,
             "description": ckpt["description"], "dtype": cfg["model"]["dtype"], "checkpoint_sha256": ckpt["sha256"],
             "prompt": _prompt_label(wl), "output_len": wl["output_len"], "prompts_sha256": prompts_sha256,
             "reference_arm": plan["reference_arm"], "pairs": cfg["pairs"], "order_seed": cfg["order_seed"],
             "warmup": WORDS["warmup"] if cfg["warmup"] else WORDS["no_warmup"],
             "torch": environment.get("torch", {}).get("version"),
             "triton": environment.get("packages", {}).get("triton"),
             "python": environment.get("python", {}).get("version")}
    lines += [fill(line, **facts) for line in w["header"]]
    load = environment.get("cpu_load") if version >= check_sessions.CPU_LOAD_SINCE else None
    kind = check_sessions.cpu_load_kind(load) if isinstance(load, dict) else None
    return lines + (["", fill(w["cpu_load"][kind], **load)] if kind else [])


def _noise_floor(w: dict, summary: dict, plan: dict) -> list[str]:
    """Format 15: one warning per re-derived ``noise_floor`` entry above the result tables, then a blank line."""
    spec, lines = w["noise_floor"], []
    for entry in summary.get("noise_floor", []):
        at = {r["comparison"]: r for r in summary["results"] if (r["job"], r["point"]) == (entry["job"], entry["point"])}
        aa = at[entry["comparison"]]
        named = [spec["affected"].format(comparison=c, verdict=WORDS["no_verdict"] if at[c]["verdict"] is None
                                         else at[c]["verdict"]) for c in entry["affected"]]
        lines.append(spec["line"].format(
            comparison=entry["comparison"], verdict=entry["verdict"], device=aa["device"],
            max_num_seqs=aa["max_num_seqs"], num_requests=aa["num_requests"],
            workload=render_sections.workload(plan, entry["point"]), speedup=entry["speedup"],
            ci=_ci(w, entry["ci"], f"[{WORDS['na']}]"), change_pct=100 * (entry["speedup"] - 1),
            level=w["level"].format(100 * aa["stats"]["confidence"]),
            affected=spec["affected_separator"].join(named) or spec["no_affected"]))
    return lines + [""] if lines else []


def _statistics(w: dict, results: list[dict]) -> list[str]:
    spec, rows = w["statistics"], []
    for r in results:
        st = r["stats"]
        p = spec["p"].format(p=st["wilcoxon_p"], method=st["wilcoxon_method"]) if st["wilcoxon_p"] is not None \
            else WORDS["na"]
        rows.append(spec["row"].format(**{**r, **st, "bca": _ci(w, st["bca_ci"], WORDS["undefined"]), "p": p}))
    return [w["headings"]["statistics"], ""] + _table(w, spec["columns"], rows)


def _checks(w: dict, checks: dict) -> list[str]:
    spec, findings = w["checks"], checks["findings"]
    most = spec["max_findings"]
    lines = [w["headings"]["checks"], "",
             fill(spec["line"], **checks, outcome=WORDS["pass"] if checks["ok"] else WORDS["fail"])]
    lines += [spec["finding"].format(message=f["message"]) for f in findings[:most]]
    if len(findings) > most:
        lines.append(spec["more"].format(n=len(findings) - most))
    return lines + [spec["warning"].format(warning=text) for text in checks.get("warnings", [])]


def _mib(w: dict, values: list) -> str:
    present = [v for v in values if v is not None]
    return w["graph_memory"]["mib"].format(max(present) / 2**20) if present else WORDS["na"]


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


def _graph_memory(w: dict, arm_rows: list[dict], plan: dict | None = None) -> list[str]:
    """Per (device, B, C, arm) (format 5: per point): runs, Graph captures / replays / fallbacks, peak memory, KV blocks."""
    spec, rows = w["graph_memory"], []

    def total(g: list[dict], *keys: str) -> int:
        return int(sum(r[k] or 0 for r in g for k in keys))

    for cell, g in _cell_groups(arm_rows, spec, plan):
        rows.append(spec["row"].format(
            **cell, runs=len(g),
            warmup_captures=total(g, "warmup_captures", "warmup_prefill_captures"),
            captures=total(g, "captures", "prefill_captures"), replays=total(g, "replays"),
            fallbacks=total(g, "fallbacks"), prefill_replays=total(g, "prefill_replays"),
            prefill_fallbacks=total(g, "prefill_fallbacks"),
            peak_allocated_mib=_mib(w, [r["peak_allocated_bytes"] for r in g]),
            peak_reserved_mib=_mib(w, [r["peak_reserved_bytes"] for r in g]),
            kv_blocks=max(r["kv_blocks_used"] for r in g)))
    return [w["headings"]["graph_memory"], ""] + _table(w, spec["columns"], rows)


def _count_text(w: dict, value) -> str:
    return w["coverage"]["list_separator"].join(str(v) for v in value) if isinstance(value, list) else str(value)


def _coverage(w: dict, arm_rows: list[dict], plan: dict | None = None) -> list[str]:
    """Per (device, B, C, arm) (format 5: per point), the coverage counts its runs share ("varies" where not)."""
    spec = w["coverage"]
    if "coverage_routed_reads" not in arm_rows[0]:
        return []
    rows = []
    for cell, g in _cell_groups(arm_rows, spec, plan):
        cells = []
        for key in spec["counts"]:
            texts = {_count_text(w, r[f"coverage_{key}"]) for r in g}
            cells.append(texts.pop() if len(texts) == 1 else WORDS["varies"])
        rows.append(spec["row"].format(**cell, runs=len(g), cells=" | ".join(cells)))
    return ["", w["headings"]["coverage"], "", spec["text"], ""] + _table(w, spec["columns"], rows)


def _children(w: dict, children: list[dict]) -> list[str]:
    """One row per child of every run of the bundle, named by its session id (its name before resume)."""
    spec = w["children"]
    rows = [spec["row"].format(**{**c, "session": c.get("session", c["name"]), "exit_status": exit_status(c),
                                  "wall": WORDS["na"] if c["wall_s"] is None else spec["wall"].format(c["wall_s"])})
            for c in children]   # wall_s None: never started, or its controller died; exit_status: format 8
    return [w["headings"]["children"], ""] + _table(w, spec["columns"], rows)


# ------------------------------------------------------------------- format 4: sessions, drift

def _num(template: str, value) -> str:
    return WORDS["na"] if value is None else template.format(value)


def _rule(w: dict, plan: dict, summary: dict) -> str:
    """The sentence under the result tables (before format 4 it names no sessions: no evidence_rule)."""
    vd = plan["config"]["verdict"]
    return fill(w["result"]["rule"], **vd, **summary.get("evidence_rule", {}),
                level=w["level"].format(100 * vd["confidence"]), verdict_alpha=1 - vd["confidence"])


def _sessions(w: dict, plan: dict, summary: dict) -> list[str]:
    """Per result each session's median, between / within SDs and the pooled median [CI]; the plan's MDE."""
    spec, de = w["sessions"], plan["detectable_effect"]
    noise = de["noise"]
    mde = fill(spec["mde"], **de, sigma=_num(spec["sigma"], noise["sigma_log_ratio"]),
                             source=spec["source"][noise["source"]].format(**noise),
                             mde=_num(spec["mde_value"], de["mde_relative"]))
    rows = []
    for r in summary["results"]:
        ev = r["evidence"]
        medians = spec["median_separator"].join(spec["median"].format(m) for m in ev["session_medians"])
        rows.append(spec["row"].format(**r, n_sessions=len(ev["sessions"]), medians=medians,
                                       between=_num(spec["sd"], ev["between_sd"]), within=_num(spec["sd"], ev["within_sd"]),
                                       speedup=r["stats"]["speedup"], ci=_ci(w, r["stats"]["ci"], f"[{WORDS['na']}]")))
    return ["", w["headings"]["sessions"], "", fill(spec["text"], **summary["evidence_rule"]), "", mde, ""] \
        + _table(w, spec["columns"], rows)


def _drift(w: dict, summary: dict) -> list[str]:
    """Per result the Spearman trend and Mann-Whitney order test; per device the allocator creep."""
    spec, rows = w["drift"], []
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
    # exact_up_to: the contract's documents.summary.trend_exact_up_to, by which audit/evidence.py takes a p exactly
    text = spec["text"].format(**summary["evidence_rule"], exact_up_to=contract.DOCS["summary"]["trend_exact_up_to"])
    return ["", w["headings"]["drift"], "", text, ""] \
        + _table(w, spec["columns"], rows) + [""] + _table(w, spec["creep_columns"], creep)


def _devices_shown(w: dict, rows: list[dict]) -> list[dict]:
    """``rows`` with each device named as the report names it: "CPU" from format 7, else its label."""
    return [{**r, "device": w["device_names"].get(r["device"], r["device"])} for r in rows]


def report(plan: dict, plan_sha256: str, prompts_sha256: str, summary: dict, arm_rows: list[dict],
           environment: dict, version: int = contract.VERSION, online: list[str] = (), roofline: list[str] = (),
           settings: list[str] = (), superseded: list[str] = ()) -> str:
    """The whole ``report.md`` text of a bundle of format ``version`` whose re-derived summary is
    ``summary``: that version's wording and sections in the contract's order (the arm sections only
    with arms); ``online``, ``roofline``, ``settings`` and ``superseded``: those sections' lines, rendered by their
    checks."""
    w = wording(contract.FORMAT["report"], version)
    summary = {**summary, **{key: _devices_shown(w, summary[key])
                             for key in ("results", "memory_creep", "children") if key in summary}}
    arm_rows = _devices_shown(w, arm_rows)
    sections = {
        "header": lambda: _header(w, version, plan, plan_sha256, prompts_sha256, summary, environment),
        "result": lambda: ["", w["headings"]["result"], "", *_noise_floor(w, summary, plan),
                           *_result_tables(w, summary["results"], plan if version >= 5 else None),
                           _rule(w, plan, summary), ""],
        "statistics": lambda: _statistics(w, summary["results"]),
        "sessions": lambda: _sessions(w, plan, summary),
        "drift": lambda: _drift(w, summary),
        "natural": lambda: check_natural.report_lines(plan, summary.get("natural"),
                                                      lambda columns, rows: _table(w, columns, rows)),
        "checks": lambda: ["", *_checks(w, summary["checks"])],
        "graph_memory": lambda: ["", *_graph_memory(w, arm_rows, plan if version >= 5 else None)] if arm_rows else [],
        "coverage": lambda: _coverage(w, arm_rows, plan if version >= 5 else None) if arm_rows else [],
        "graph_coverage": lambda: render_sections.graph_coverage(w, plan, summary["results"]),
        "telemetry": lambda: render_sections.telemetry(w, plan, arm_rows),
        "children": lambda: ["", *_children(w, summary["children"])],
        "superseded": lambda: list(superseded),   # format 15: check_superseded.report_lines
        "online": lambda: list(online),   # format 5: check_online.report_lines
        "roofline": lambda: list(roofline),   # format 7: check_roofline.report_lines
        "runtime_settings": lambda: list(settings),   # format 9: check_settings.report_lines
        "plot": lambda: ["", w["plot"], ""],
    }
    return "\n".join(one_line(line) for name in w["sections_by_version"][str(version)] for line in sections[name]())
