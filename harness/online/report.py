"""The report's Online section and the latency plot, rendered from ``online/summary.json``'s figures by the
templates of the contract (bundle_format.json ``online.report``); audit/check_online.py renders the same
section from its own re-derived figures and requires every line to match."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ..evidence import FORMAT, atomic_write_bytes
from . import metrics

R = FORMAT["online"]["report"]


def _num(value, template: str = R["number"]) -> str:
    return R["na"] if value is None else template.format(value)


def _table(columns: list[str], rows: list[str]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows]


def _trace_line(online: dict, summary: dict) -> str:
    slo, src = summary["slo"], R["source"][summary["slo"]["source"]]
    return R["trace"].format(
        num_requests=online["num_requests"], max_tokens=online["max_tokens"], point=online["point"],
        seed=online["trace"]["seed"], sha256=online["trace"]["sha256"], capacity=_num(summary["capacity_rps"]),
        arm=online["calibration"]["arm"], concurrency=online["calibration"]["concurrency"],
        ttft=_num(slo.get("ttft_s")), tpot=_num(slo.get("tpot_s")),
        source=src.format(factor=slo["factor"]) if slo["source"] == "calibration" else src,
        method=summary["percentile_method"])


def _run_row(run: dict) -> str:
    cells = {k: _num(run[k]) for k in ("p50_ttft_s", "p99_ttft_s", "p99_itl_s", "throughput_tokens_per_s", "goodput_rps")}
    multiple = R["closed"] if run["rate_multiple"] is None else _num(run["rate_multiple"], R["multiple"])
    return R["runs_row"].format(seq=run["seq"], arm=run["arm"], completed=run["completed"], failed=run["failed"],
                                rate_multiple=multiple,
                                rate_rps=R["closed"] if run["rate_rps"] is None else _num(run["rate_rps"]), **cells)


def _paired(rate: dict) -> list[str]:
    b, c = rate["baseline"], rate["candidate"]
    lines = ["", R["paired_subheading"].format(rate_multiple=_num(rate["rate_multiple"], R["multiple"]),
                                               rate_rps=_num(rate["rate_rps"]), baseline=b, candidate=c,
                                               n=len(rate["pairs"])), ""]
    rows = [R["paired_row"].format(figure=fig, baseline_median=_num(v["baseline_median"]),
                                   candidate_median=_num(v["candidate_median"]), ratio_median=_num(v["ratio_median"]))
            for fig, v in rate["figures"].items()]
    return lines + _table([h.format(baseline=b, candidate=c) for h in R["paired_columns"]], rows)


def _check_line(checks: dict) -> str:
    if checks["ok"]:
        return R["check_ok"].format(checked=checks["requests_checked"], failed=checks["requests_failed"])
    return R["check_failed"].format(n=len(checks["mismatches"]), checked=checks["requests_checked"],
                                    failed=checks["requests_failed"], **checks["mismatches"][0])


def report_lines(online: dict, summary: dict, settings: list[str] = ()) -> list[str]:
    """The Online section of report.md (its lines, led by an empty one); ``settings``: the lines of the online
    runs' engine settings (format 10), after the served-token check."""
    lines = ["", R["heading"], ""]
    if summary["status"] != "complete":
        lines += [R["incomplete"].format(recorded=summary["runs_recorded"], planned=summary["runs_planned"]), ""]
    lines += [_trace_line(online, summary), "", *_table(R["runs_columns"], [_run_row(r) for r in summary["runs"]])]
    for rate in summary["rates"]:
        lines += _paired(rate)
    return lines + ["", _check_line(summary["checks"]), *settings, "", R["plot"]]


def status_line(bundle: Path) -> str | None:
    """``loopbench bench``'s line about the online track of ``bundle`` (None without one)."""
    import json

    path = Path(bundle) / "online" / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    ch = s["checks"]
    first = ch["mismatches"][0] if ch["mismatches"] else None
    tokens = ("served tokens equal the frozen reference" if ch["ok"] else
              f"served tokens DIFFER from the frozen reference in {len(ch['mismatches'])} run{'s' * (len(ch['mismatches']) != 1)}, first run "
              f"{first['seq']} request {first['request_index']} token {first['position']}")
    return (f"online: {s['status']}, {s['runs_recorded']} of {s['runs_planned']} runs, capacity "
            f"{_num(s['capacity_rps'])} requests/s; {tokens}; {ch['requests_failed']} failed requests")


def plot_latency(records: list[dict], summary: dict, path: Path) -> None:
    """Per run: each request's TTFT (dots) and its inter-token gaps (small dots), with the SLO lines."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_i) = plt.subplots(1, 2, figsize=(10, 0.45 * max(len(records), 1) + 1.6), sharey=True)
    labels, positive = [], {ax_t: False, ax_i: False}
    for y, rec in enumerate(records):
        lats = [metrics.request_latencies(r) for r in rec["requests"]]
        ttft = [lat["ttft_s"] for lat in lats if lat["ttft_s"] is not None]
        itl = [g for lat in lats for g in lat["itl_s"]]
        ax_t.scatter(ttft, np.full(len(ttft), y), s=10, color="C0" if rec["position"] != "candidate" else "C1")
        ax_i.scatter(itl, np.full(len(itl), y) + np.random.default_rng(y).uniform(-0.2, 0.2, len(itl)), s=2,
                     color="0.4")
        positive[ax_t] |= any(t > 0 for t in ttft)
        positive[ax_i] |= any(g > 0 for g in itl)
        rate = "closed" if rec["rate_multiple"] is None else f"{rec['rate_multiple']:.2f}x"
        labels.append(f"{rec['seq']} {rec['arm']} {rate}")
    slo = summary["slo"]
    for ax, key in ((ax_t, "ttft_s"), (ax_i, "tpot_s")):
        if slo.get(key) is not None:
            ax.axvline(slo[key], color="C3", lw=0.8)
        if positive[ax] or slo.get(key):   # log of nothing (no request completed) cannot be drawn
            ax.set_xscale("log", nonpositive="clip")   # gaps of tokens that came in one chunk are 0
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_t.set_yticks(range(len(records)))
    ax_t.set_yticklabels(labels, fontsize=7)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("TTFT from planned arrival (s); red: SLO")
    ax_i.set_xlabel("inter-token gaps (s); red: TPOT SLO")
    fig.suptitle("Online latency per run" + ("" if summary["status"] == "complete" else " (INCOMPLETE)"))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())
