"""The human-readable side of a bundle: the seed-style result table, ``report.md`` and the plot of
paired ratios. Pure rendering from the summary and the tables that ``evidence.py`` builds; the auditor
re-renders the whole report from the raw records with its own code (``audit/render.py``) and requires
``report.md`` to match it line for line, so a wording change here needs the same change there.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd


def fmt_speedup(speedup: float, ci: list | None) -> str:
    ci_text = f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "[n/a]"
    return f"{speedup:.4f}× {ci_text}"


def table_row(res: dict) -> str:
    """One seed-style row (device, B / C, tokens/s of each arm, speedup [CI], change, verdict)."""
    st = res["stats"]
    verdict = res["verdict"] if res["verdict"] is not None else "none"
    return (f"| {res['device']} | {res['max_num_seqs']} / {res['num_requests']} | "
            f"{res['baseline_tokens_per_s']:.2f} | {res['candidate_tokens_per_s']:.2f} | "
            f"{fmt_speedup(st['speedup'], st['ci'])} | {100 * (st['speedup'] - 1):+.2f}% | {verdict} |")


def result_tables(summary: dict) -> str:
    """The seed's table, one per comparison (GPU, B / C, tokens/s of each arm, speedup [CI], change)."""
    out = []
    comps: dict[str, list[dict]] = {}
    for res in summary["results"]:
        comps.setdefault(res["comparison"], []).append(res)
    for comp, rows in comps.items():
        b, c = rows[0]["baseline"], rows[0]["candidate"]
        label = f"{comp} (A/A noise floor)" if b == c else comp
        out += [f"### {label}", "",
                f"| GPU | B / C | {b} tokens/s | {c} tokens/s | Paired speedup [95% CI] | Throughput change | Verdict |",
                "|---|---|---|---|---|---|---|"]
        out += [table_row(r) for r in rows]
        out.append("")
    return "\n".join(out)


def _graph_memory_lines(arms: pd.DataFrame) -> list[str]:
    lines = ["| GPU | B / C | arm | runs | warmup captures | measured captures | measured replays | "
             "measured fallbacks | measured prefill replays / fallbacks | peak allocated MiB | peak reserved MiB | "
             "KV blocks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mib(series) -> str:
        vals = [v for v in series if v is not None and not pd.isna(v)]
        return f"{max(vals) / 2**20:.1f}" if vals else "n/a"

    for (dev, b, c, arm), g in arms.groupby(["device", "max_num_seqs", "num_requests", "arm"], sort=True):
        warm = int(g["warmup_captures"].fillna(0).sum() + g["warmup_prefill_captures"].fillna(0).sum())
        lines.append(f"| {dev} | {b} / {c} | {arm} | {len(g)} | {warm} | "
                     f"{int(g['captures'].sum() + g['prefill_captures'].sum())} | {int(g['replays'].sum())} | "
                     f"{int(g['fallbacks'].sum())} | "
                     f"{int(g['prefill_replays'].sum())} / {int(g['prefill_fallbacks'].sum())} | "
                     f"{mib(g['peak_allocated_bytes'])} | {mib(g['peak_reserved_bytes'])} | "
                     f"{int(g['kv_blocks_used'].max())} |")
    return lines


def _prompt_label(wl: dict) -> str:
    """The header's prompt lengths: one P, a cycled mix ("31,32,63,33 cycled") or "file"."""
    if wl["prompts_file"]:
        return "file"
    if wl.get("prompt_lens"):
        return ",".join(str(n) for n in wl["prompt_lens"]) + " cycled"
    return str(wl["prompt_len"])


COVERAGE_TEXT = (
    "Counts of one measured run, derived on the host from the frozen schedule and the arm's layout "
    "(harness/coverage.py; the checker requires the derivation's row trace to be the run's): decode exits "
    "per depth; key reads from a plane below the query depth, per plane (alias resolves them through the "
    "exit map, native reads the fill's copies; all zero means the layouts never read differently); keys "
    "resolved one by one through the exit map; key tiles read directly by the prefix reader; rows whose "
    "first-alias position lies in their context (a boundary tile), and of those the rows where it is the "
    "tile's last key; token-planes copied by the native fill (K and V of every layer); CUDA-Graph padding "
    "rows. Reads are counted per decode row: every layer repeats them.")


def _per_run(values) -> str:
    """The one value an arm's runs share ("a/b/c" for a list), or "varies"."""
    texts = {"/".join(str(int(x)) for x in v) if isinstance(v, (list, tuple, np.ndarray)) else str(int(v))
             for v in values}
    return texts.pop() if len(texts) == 1 else "varies"


def _coverage_lines(arms: pd.DataFrame) -> list[str]:
    """Per (GPU, B, C, arm): how often each path where the layouts differ ran in one measured run."""
    if not len(arms) or "coverage_routed_reads" not in arms.columns:
        return []
    lines = ["", "## Layout paths per run", "", COVERAGE_TEXT, "",
             "| GPU | B / C | arm | runs | exits per depth | reads below the query depth, per plane | "
             "exit-map reads | direct tiles | boundary tiles | at a tile's last key | fill token-planes | "
             "padding rows |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = ("exits_per_depth", "lower_plane_reads", "routed_reads", "direct_tiles", "boundary_tiles",
            "boundary_last_key", "fill_token_planes", "padding_rows")
    for (dev, b, c, arm), g in arms.groupby(["device", "max_num_seqs", "num_requests", "arm"], sort=True):
        cells = " | ".join(_per_run(g[f"coverage_{k}"]) for k in keys)
        lines.append(f"| {dev} | {b} / {c} | {arm} | {len(g)} | {cells} |")
    return lines


def render_report(plan: dict, summary: dict, arms: pd.DataFrame, environment: dict) -> str:
    cfg = plan["config"]
    code = plan["code"]
    head = "complete" if summary["status"] == "complete" else "INCOMPLETE: no verdict"
    lines = [f"# loopbench: {plan['name']} ({head})", ""]
    if summary["status"] != "complete":
        lines += ["**This run is incomplete and publishes no verdict:** " + "; ".join(summary["incomplete_reasons"]), ""]
    elif not summary["verdicts_published"]:
        lines += ["**Checks failed: every verdict is barred** (see Checks).", ""]
    wl = cfg["workload"]
    ex = cfg["exit"]
    lines += [
        f"- Code: `{code['git_sha'] or 'unknown'}`{' (dirty tree)' if code['git_dirty'] else ''}; plan sha256 `{summary['plan_sha256']}`",
        f"- Model: {plan['checkpoint']['description']}, {cfg['model']['dtype']}, checkpoint sha256 "
        f"`{plan['checkpoint']['sha256']}`",
        f"- Workload: P{_prompt_label(wl)} / D{wl['output_len']}, "
        f"prompts sha256 `{plan['prompts']['sha256']}`; fixed schedule from a natural `{plan['reference_arm']}` run "
        f"({ex['policy']} {ex['threshold']}/min{ex['min_loops']}/max{ex['max_loops']})",
        f"- Protocol: {cfg['pairs']} balanced pairs per point and comparison, order seed {cfg['order_seed']}, "
        f"{'one full untimed warmup per arm' if cfg['warmup'] else 'NO warmup'}, fresh engine per arm",
        f"- Torch {environment.get('torch', {}).get('version')}, triton {environment.get('packages', {}).get('triton')}, "
        f"python {environment.get('python', {}).get('version')}",
        "", "## Result", "",
        result_tables(summary),
        "Tokens/s are medians over an arm's measured runs within the comparison; speedup is the median paired "
        f"ratio baseline_s / candidate_s; the interval is a percentile bootstrap of the median over pairs "
        f"({cfg['verdict']['n_resamples']:,} resamples, seed {cfg['verdict']['bootstrap_seed']}). Verdict rule: "
        f"faster / slower when the whole {cfg['verdict']['confidence']:.0%} CI lies above / below 1 and the "
        f"effect is at least {cfg['verdict']['min_effect']:.2%}, with at least {cfg['verdict']['min_pairs']} pairs; "
        "otherwise inconclusive. The intervals bootstrap "
        "pairs within one persistent session per device, not independent sessions.", "",
        "## Statistics", "",
        "| GPU | B / C | comparison | pairs | BCa CI | Wilcoxon p | distinct resamples | rule outcome |",
        "|---|---|---|---|---|---|---|---|"]
    for r in summary["results"]:
        st = r["stats"]
        bca = f"[{st['bca_ci'][0]:.4f}, {st['bca_ci'][1]:.4f}]" if st["bca_ci"] else "undefined"
        p = f"{st['wilcoxon_p']:.4g} ({st['wilcoxon_method']})" if st["wilcoxon_p"] is not None else "n/a"
        lines.append(f"| {r['device']} | {r['max_num_seqs']} / {r['num_requests']} | {r['comparison']} | "
                     f"{st['n_pairs']} | {bca} | {p} | {st['distinct_resamples']:,} | {st['verdict']}: "
                     f"{st['verdict_reason']} |")
    ch = summary["checks"]
    lines += ["", "## Checks", "",
              f"{'PASS' if ch['ok'] else 'FAIL'}: {ch['arms_checked']} arms, {ch['phases_checked']} runs "
              f"(warmup and measured), {ch['requests_checked']:,} requests and {ch['tokens_checked']:,} output "
              "tokens compared with the frozen references (tokens, exit depths, work counters, row trace); "
              "measured arms must show zero new Graph captures; paired Graph coverage must be equal."]
    for f in ch["findings"][:25]:
        lines.append(f"- {f['message']}")
    if len(ch["findings"]) > 25:
        lines.append(f"- ... and {len(ch['findings']) - 25} more (summary.json)")
    lines += [f"- warning: {w}" for w in ch.get("warnings") or []]
    lines += ["", "## Graph counters and memory", ""] + _graph_memory_lines(arms) if len(arms) else []
    lines += _coverage_lines(arms)
    lines += ["", "## Children", "", "| child | device | state | exit code | wall s |", "|---|---|---|---|---|"]
    for c in summary["children"]:
        wall = f"{c['wall_s']:.1f}" if c["wall_s"] is not None else "n/a"   # a child never started, or lost
        lines.append(f"| {c.get('session', c['name'])} | {c['device']} | {c['state']} | {c['exit_code']} | {wall} |")
    lines += ["", "![paired ratios](pair_ratios.png)", ""]
    return "\n".join(lines)


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
    ax.set_title("Paired ratios, median and 95% CI" + ("" if summary["status"] == "complete" else " (INCOMPLETE)"))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    from .evidence import atomic_write_bytes  # evidence imports this module

    atomic_write_bytes(Path(path), buf.getvalue())


# ------------------------------------------------------------------------------------------ manifest

