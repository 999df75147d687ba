"""``report.md`` as the bundle makes it: the auditor's own rendering, line for line.

The report a bundle carries must be exactly this text: every figure in it (header hashes, result rows,
statistics, the checks line, Graph counters and memory, children) is rendered here from values the
auditor re-derived (:mod:`.derive`) or verified (plan, environment, children), never from the claims
being audited. The layout is the one ``harness/report.py`` writes; any other line, hidden or visible,
is a discrepancy.
"""
from __future__ import annotations

MAX_FINDINGS = 25


def _ci(ci: list | None) -> str:
    return f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "[n/a]"


def result_row(res: dict) -> str:
    """One seed-style row: GPU, B / C, tokens/s of each arm, speedup [CI], change, verdict."""
    st = res["stats"]
    verdict = res["verdict"] if res["verdict"] is not None else "none"
    return (f"| {res['device']} | {res['max_num_seqs']} / {res['num_requests']} | "
            f"{res['baseline_tokens_per_s']:.2f} | {res['candidate_tokens_per_s']:.2f} | "
            f"{st['speedup']:.4f}× {_ci(st['ci'])} | {100 * (st['speedup'] - 1):+.2f}% | {verdict} |")


def _result_tables(results: list[dict]) -> str:
    by_comparison: dict[str, list[dict]] = {}
    for res in results:
        by_comparison.setdefault(res["comparison"], []).append(res)
    lines = []
    for comp, rows in by_comparison.items():
        b, c = rows[0]["baseline"], rows[0]["candidate"]
        lines += [f"### {comp} (A/A noise floor)" if b == c else f"### {comp}", "",
                  f"| GPU | B / C | {b} tokens/s | {c} tokens/s | Paired speedup [95% CI] | Throughput change | "
                  "Verdict |",
                  "|---|---|---|---|---|---|---|"]
        lines += [result_row(r) for r in rows]
        lines.append("")
    return "\n".join(lines)


def _prompt_label(wl: dict) -> str:
    """One P, a cycled mix of ``prompt_lens`` ("31,32,63,33 cycled"), or "file"."""
    if wl["prompts_file"]:
        return "file"
    if wl.get("prompt_lens"):
        return ",".join(str(n) for n in wl["prompt_lens"]) + " cycled"
    return str(wl["prompt_len"])


def _header(plan: dict, plan_sha256: str, prompts_sha256: str, summary: dict, environment: dict) -> list[str]:
    cfg, code, ckpt = plan["config"], plan["code"], plan["checkpoint"]
    wl, ex = cfg["workload"], cfg["exit"]
    head = "complete" if summary["status"] == "complete" else "INCOMPLETE: no verdict"
    lines = [f"# loopbench: {plan['name']} ({head})", ""]
    if summary["status"] != "complete":
        reasons = "; ".join(summary["incomplete_reasons"])
        lines += [f"**This run is incomplete and publishes no verdict:** {reasons}", ""]
    elif not summary["verdicts_published"]:
        lines += ["**Checks failed: every verdict is barred** (see Checks).", ""]
    dirty = " (dirty tree)" if code["git_dirty"] else ""
    prompt = _prompt_label(wl)
    return lines + [
        f"- Code: `{code['git_sha'] or 'unknown'}`{dirty}; plan sha256 `{plan_sha256}`",
        f"- Model: {ckpt['description']}, {cfg['model']['dtype']}, checkpoint sha256 `{ckpt['sha256']}`",
        f"- Workload: P{prompt} / D{wl['output_len']}, prompts sha256 `{prompts_sha256}`; fixed schedule from a "
        f"natural `{plan['reference_arm']}` run "
        f"({ex['policy']} {ex['threshold']}/min{ex['min_loops']}/max{ex['max_loops']})",
        f"- Protocol: {cfg['pairs']} balanced pairs per point and comparison, order seed {cfg['order_seed']}, "
        f"{'one full untimed warmup per arm' if cfg['warmup'] else 'NO warmup'}, fresh engine per arm",
        f"- Torch {environment.get('torch', {}).get('version')}, triton "
        f"{environment.get('packages', {}).get('triton')}, python {environment.get('python', {}).get('version')}",
    ]


def _rule_paragraph(vd: dict) -> str:
    return ("Tokens/s are medians over an arm's measured runs within the comparison; speedup is the median paired "
            "ratio baseline_s / candidate_s; the interval is a percentile bootstrap of the median over pairs "
            f"({vd['n_resamples']:,} resamples, seed {vd['bootstrap_seed']}). Verdict rule: faster / slower when "
            f"the whole {vd['confidence']:.0%} CI lies above / below 1 and the effect is at least "
            f"{vd['min_effect']:.2%}, with at least {vd['min_pairs']} pairs; otherwise inconclusive. The intervals "
            "bootstrap pairs within one persistent session per device, not independent sessions.")


def _statistics(results: list[dict]) -> list[str]:
    lines = ["## Statistics", "",
             "| GPU | B / C | comparison | pairs | BCa CI | Wilcoxon p | distinct resamples | rule outcome |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        st = r["stats"]
        bca = f"[{st['bca_ci'][0]:.4f}, {st['bca_ci'][1]:.4f}]" if st["bca_ci"] else "undefined"
        p = f"{st['wilcoxon_p']:.4g} ({st['wilcoxon_method']})" if st["wilcoxon_p"] is not None else "n/a"
        lines.append(f"| {r['device']} | {r['max_num_seqs']} / {r['num_requests']} | {r['comparison']} | "
                     f"{st['n_pairs']} | {bca} | {p} | {st['distinct_resamples']:,} | {st['verdict']}: "
                     f"{st['verdict_reason']} |")
    return lines


def _checks(checks: dict) -> list[str]:
    lines = ["## Checks", "",
             f"{'PASS' if checks['ok'] else 'FAIL'}: {checks['arms_checked']} arms, {checks['phases_checked']} runs "
             f"(warmup and measured), {checks['requests_checked']:,} requests and {checks['tokens_checked']:,} "
             "output tokens compared with the frozen references (tokens, exit depths, work counters, row trace); "
             "measured arms must show zero new Graph captures; paired Graph coverage must be equal."]
    findings = checks["findings"]
    lines += [f"- {f['message']}" for f in findings[:MAX_FINDINGS]]
    if len(findings) > MAX_FINDINGS:
        lines.append(f"- ... and {len(findings) - MAX_FINDINGS} more (summary.json)")
    return lines + [f"- warning: {w}" for w in checks.get("warnings", [])]


def _mib(values: list) -> str:
    present = [v for v in values if v is not None]
    return f"{max(present) / 2**20:.1f}" if present else "n/a"


def _graph_memory(arm_rows: list[dict]) -> list[str]:
    """Per (GPU, B, C, arm): runs, Graph captures / replays / fallbacks, peak memory, KV blocks."""
    groups: dict[tuple, list[dict]] = {}
    for a in arm_rows:
        groups.setdefault((a["device"], a["max_num_seqs"], a["num_requests"], a["arm"]), []).append(a)
    lines = ["## Graph counters and memory", "",
             "| GPU | B / C | arm | runs | warmup captures | measured captures | measured replays | "
             "measured fallbacks | measured prefill replays / fallbacks | peak allocated MiB | peak reserved MiB | "
             "KV blocks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def total(rows: list[dict], key: str) -> int:
        return int(sum(r[key] or 0 for r in rows))

    for (dev, b, c, arm), g in sorted(groups.items()):
        warm = total(g, "warmup_captures") + total(g, "warmup_prefill_captures")
        lines.append(f"| {dev} | {b} / {c} | {arm} | {len(g)} | {warm} | "
                     f"{total(g, 'captures') + total(g, 'prefill_captures')} | {total(g, 'replays')} | "
                     f"{total(g, 'fallbacks')} | {total(g, 'prefill_replays')} / {total(g, 'prefill_fallbacks')} | "
                     f"{_mib([r['peak_allocated_bytes'] for r in g])} | "
                     f"{_mib([r['peak_reserved_bytes'] for r in g])} | "
                     f"{max(r['kv_blocks_used'] for r in g)} |")
    return lines


def _wall(wall_s: float | None) -> str:
    return "n/a" if wall_s is None else f"{wall_s:.1f}"   # None: never started, or its controller died


COVERAGE_KEYS = ("exits_per_depth", "lower_plane_reads", "routed_reads", "direct_tiles", "boundary_tiles",
                 "boundary_last_key", "fill_token_planes", "padding_rows")
COVERAGE_TEXT = (
    "Counts of one measured run, derived on the host from the frozen schedule and the arm's layout "
    "(harness/coverage.py; the checker requires the derivation's row trace to be the run's): decode exits "
    "per depth; key reads from a plane below the query depth, per plane (alias resolves them through the "
    "exit map, native reads the fill's copies; all zero means the layouts never read differently); keys "
    "resolved one by one through the exit map; key tiles read directly by the prefix reader; rows whose "
    "first-alias position lies in their context (a boundary tile), and of those the rows where it is the "
    "tile's last key; token-planes copied by the native fill (K and V of every layer); CUDA-Graph padding "
    "rows. Reads are counted per decode row: every layer repeats them.")


def _count_text(value) -> str:
    return "/".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _coverage(arm_rows: list[dict]) -> list[str]:
    """Per (GPU, B, C, arm), the coverage counts its runs share ("varies" where they do not)."""
    if "coverage_routed_reads" not in arm_rows[0]:
        return []
    groups: dict[tuple, list[dict]] = {}
    for a in arm_rows:
        groups.setdefault((a["device"], a["max_num_seqs"], a["num_requests"], a["arm"]), []).append(a)
    lines = ["", "## Layout paths per run", "", COVERAGE_TEXT, "",
             "| GPU | B / C | arm | runs | exits per depth | reads below the query depth, per plane | exit-map reads "
             "| direct tiles | boundary tiles | at a tile's last key | fill token-planes | padding rows |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (dev, b, c, arm), g in sorted(groups.items()):
        cells = []
        for key in COVERAGE_KEYS:
            texts = {_count_text(r[f"coverage_{key}"]) for r in g}
            cells.append(texts.pop() if len(texts) == 1 else "varies")
        lines.append(f"| {dev} | {b} / {c} | {arm} | {len(g)} | {' | '.join(cells)} |")
    return lines


def _children(children: list[dict]) -> list[str]:
    """One row per child of every run of the bundle, named by its session id (its name before resume)."""
    return ["## Children", "", "| child | device | state | exit code | wall s |", "|---|---|---|---|---|"] + [
        f"| {c.get('session', c['name'])} | {c['device']} | {c['state']} | {c['exit_code']} | {_wall(c['wall_s'])} |"
        for c in children]


def report(plan: dict, plan_sha256: str, prompts_sha256: str, summary: dict, arm_rows: list[dict],
           environment: dict) -> str:
    """The whole ``report.md`` text of a bundle whose re-derived summary is ``summary``."""
    lines = _header(plan, plan_sha256, prompts_sha256, summary, environment)
    lines += ["", "## Result", "", _result_tables(summary["results"]), _rule_paragraph(plan["config"]["verdict"]), ""]
    lines += _statistics(summary["results"])
    lines += [""] + _checks(summary["checks"])
    if arm_rows:
        lines += [""] + _graph_memory(arm_rows)
        lines += _coverage(arm_rows)
    lines += [""] + _children(summary["children"])
    lines += ["", "![paired ratios](pair_ratios.png)", ""]
    return "\n".join(lines)
