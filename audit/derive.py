"""What a bundle must say, re-derived from its raw records and plan with the auditor's own code.

Every function here is pure: raw arm records (the JSON the sessions write, one per measured arm) and
the frozen plan in, the rows of each table, the statistics of each comparison and the summary out.
Nothing is imported from ``loopbench.harness``; the formulas follow the bundle format contract
(``loopbench/bundle_format.json``, audit/FORMAT.md) and the statistics documented in ``harness/stats.py``
(their sources cited there), re-implemented independently so that a bug in the harness cannot vouch for
itself:

- tokens/s = C * D / elapsed_s; pair ratio = baseline_s / candidate_s; speedup = median ratio;
- CI: ``scipy.stats.bootstrap`` of the median, percentile and BCa, a fresh ``default_rng(seed)`` each;
- distinct resamples C(2n-1, n) (Feller 1968, II.5);
- Wilcoxon signed-rank p of the log ratios (Wilcoxon 1945): scipy's exact null without ties or zeros;
  with them, the exact distribution conditional on the mid-ranks, here counted by dynamic programming
  over the doubled ranks (the harness enumerates the 2^m sign vectors; both are the same distribution);
- the predeclared verdict rule and its reason text;
- why a run is incomplete, as the contract's status codes (worded as sentences in version-1 summaries).
"""
from __future__ import annotations

import inspect
import math
import warnings
import numpy as np
import pandas as pd
import scipy
import scipy.stats

from . import check_graphs, check_natural, check_telemetry, contract
from . import evidence as _evidence

PHASES = tuple(contract.DOCS["record"]["phases"])
GRAPH_KEYS = ("captures", "replays", "fallbacks", "prefill_captures", "prefill_replays", "prefill_fallbacks")
MEMORY_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes")


# ------------------------------------------------------------------------------------------- tables

def tokens_per_s(record: dict) -> float:
    """C * D / elapsed_s of the measured run."""
    return record["num_requests"] * record["output_len"] / record["measured"]["elapsed_s"]


def _phase_columns(prefix: str, phase: dict | None) -> dict:
    cols = {f"{prefix}elapsed_s": None if phase is None else phase["elapsed_s"]}
    for key in GRAPH_KEYS:
        cols[prefix + key] = None if phase is None else phase["graphs"].get(key, 0)
    for key in MEMORY_KEYS:
        cols[prefix + key] = None if phase is None else phase["memory"][key]
    return cols


def arm_row(r: dict) -> dict:
    """One arms.parquet row: identity, the arm's config, timing, Graph and memory counters, work."""
    m = r["measured"]
    row = {k: r[k] for k in ("job", "seq")}
    if "session" in r:  # bundles before resume (issue 8) have no session ids
        row["session"] = r["session"]
    row["device"] = r["device"]["label"]
    row.update({k: r[k] for k in ("point", "max_num_seqs", "num_requests", "output_len", "comparison", "pair",
                                  "position", "slot", "arm")})
    row.update({f"arm_{k}": v for k, v in r["arm_config"].items()})
    row["tokens_per_s"] = r["tokens_per_s"]
    row.update(_phase_columns("", m))
    row.update({k: (r.get("wall_clock") or {}).get(k) for k in ("measured_start_unix_s", "measured_end_unix_s")})
    row.update(_phase_columns("warmup_", r.get("warmup")))
    row.update({f"work_{k}": v for k, v in m["work"].items()})
    row["kv_blocks_used"] = m["kv_blocks_used"]
    row["trace_sha256"] = m.get("trace_sha256")
    row.update({f"coverage_{k}": v for k, v in (r.get("coverage") or {}).items()})
    row["eager_fraction"] = check_graphs.eager_fraction(r)   # format 5
    row.update(check_telemetry.arm_columns(r))               # format 5
    return row


def request_rows(r: dict) -> list[dict]:
    """requests.parquet rows of one record: one per (phase, request)."""
    rows = []
    for phase in PHASES:
        data = r.get(phase)
        for rid, out in ((data or {}).get("outputs") or {}).items():
            depths = out["exit_depths"]
            rows.append({"job": r["job"], "seq": r["seq"], "arm": r["arm"], "point": r["point"], "phase": phase,
                         "request_id": rid, "num_tokens": len(out["token_ids"]),
                         "finish_reason": out["finish_reason"],
                         "mean_exit_depth": sum(depths) / len(depths) if depths else None})
    return rows


def token_tuples(r: dict) -> list[tuple]:
    """tokens.parquet rows of one record: (job, seq, point, comparison, arm, phase, request_id, position,
    token_id, exit_depth)."""
    out = []
    for phase in PHASES:
        data = r.get(phase)
        for rid, o in ((data or {}).get("outputs") or {}).items():
            out += [(r["job"], r["seq"], r["point"], r["comparison"], r["arm"], phase, rid, pos, t, d)
                    for pos, (t, d) in enumerate(zip(o["token_ids"], o["exit_depths"]))]
    return out


telemetry_rows = check_telemetry.telemetry_rows


def pair_rows(records: list[dict]) -> list[dict]:
    """pairs.parquet rows: one per (job, point, comparison, pair) with exactly one baseline and one candidate."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["job"], r["point"], r["comparison"], r["pair"]), []).append(r)
    rows = []
    for (job, point, comparison, pair), members in sorted(groups.items()):
        by_position = {m["position"]: m for m in members}
        if len(members) != 2 or set(by_position) != {"baseline", "candidate"}:
            continue
        b, c = by_position["baseline"], by_position["candidate"]
        bs, cs = b["measured"]["elapsed_s"], c["measured"]["elapsed_s"]
        rows.append({"job": job, "device": b["device"]["label"], "point": point, "max_num_seqs": b["max_num_seqs"],
                     "num_requests": b["num_requests"], "output_len": b["output_len"], "comparison": comparison,
                     "pair": pair, "first": "baseline" if b["slot"] == 0 else "candidate",
                     "baseline_arm": b["arm"], "candidate_arm": c["arm"], "baseline_seq": b["seq"],
                     "candidate_seq": c["seq"], "baseline_s": bs, "candidate_s": cs, "ratio": bs / cs})
    return rows


def expected_tables(records: list[dict]) -> dict[str, pd.DataFrame]:
    """Every table of the bundle as the raw records make it (column order is not a claim)."""
    tokens = [t for r in records for t in token_tuples(r)]
    return {
        "arms": pd.DataFrame([arm_row(r) for r in records]),
        "pairs": pd.DataFrame(pair_rows(records)),
        "requests": pd.DataFrame([q for r in records for q in request_rows(r)]),
        "tokens": pd.DataFrame(tokens, columns=list(contract.declared_columns("tokens"))),
        "telemetry": pd.DataFrame([t for r in records for t in telemetry_rows(r)]),
    }


# --------------------------------------------------------------------------------------- statistics

def _rng_kwargs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"rng": rng} if "rng" in inspect.signature(scipy.stats.bootstrap).parameters else {"random_state": rng}


def bootstrap_ci(ratios: np.ndarray, confidence: float, n_resamples: int, seed: int, method: str):
    """scipy.stats.bootstrap of the median, fresh default_rng(seed) per call; None where undefined."""
    if ratios.size < 2:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = scipy.stats.bootstrap((ratios,), np.median, n_resamples=n_resamples, confidence_level=confidence,
                                    method=method, vectorized=True, **_rng_kwargs(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return [low, high] if math.isfinite(low) and math.isfinite(high) else None


def _conditional_signed_rank_p(nonzero: np.ndarray) -> float:
    """Two-sided p of W+ given the mid-ranks: the null puts each rank's sign + or - with probability 1/2.

    Mid-ranks are multiples of 1/2, so the doubled ranks are integers and the null distribution of
    2 W+ is a polynomial product, counted exactly: counts[s] = number of sign vectors with 2 W+ = s.
    """
    doubled = np.rint(2 * scipy.stats.rankdata(np.abs(nonzero))).astype(int)
    counts = np.zeros(int(doubled.sum()) + 1, dtype=object)
    counts[0] = 1
    for d in doubled:
        shifted = np.zeros_like(counts)
        shifted[d:] = counts[:-d]
        counts = counts + shifted
    observed, total = int(doubled[nonzero > 0].sum()), int(doubled.sum())
    sums = np.arange(total + 1)
    extreme = np.abs(2 * sums - total) >= abs(2 * observed - total)   # |W+ - E W+| >= observed, doubled twice
    return float(counts[extreme].sum() / 2 ** doubled.size)


def wilcoxon(ratios: np.ndarray) -> tuple[float, str]:
    """(p, method) of the signed-rank test on log ratios, named as the summary names its method."""
    d = np.log(ratios)
    nonzero = d[d != 0]
    if nonzero.size == 0:
        return 1.0, "all ratios equal 1"
    if nonzero.size == d.size and np.unique(np.abs(nonzero)).size == nonzero.size:
        return float(scipy.stats.wilcoxon(d, method="exact").pvalue), "exact"
    if nonzero.size > 16:
        return float(scipy.stats.wilcoxon(d, method="approx").pvalue), "normal approximation (ties, m > 16)"
    return _conditional_signed_rank_p(nonzero), "exact conditional (ties or zeros)"


def verdict(speedup: float, ci: list | None, min_effect: float, n_pairs: int, min_pairs: int,
            version: int = contract.VERSION, p: float | None = None, confidence: float = 0.95) -> tuple[str, str]:
    """The predeclared rule: faster / slower only when the whole CI is past 1 and the effect is big enough, and
    from format ``verdict_test_since`` (11) only when the signed-rank ``p`` is below 1 - ``confidence`` too; the
    reason as a bundle of format ``version`` words it (one pair in the singular from ``singular_count_since``)."""
    if n_pairs < min_pairs:
        singular = n_pairs == 1 and version >= contract.DOCS["summary"]["singular_count_since"]
        noun = "pair" if singular else "pairs"
        return "inconclusive", f"{n_pairs} {noun}, fewer than the minimum {min_pairs} for a verdict"
    if ci is None:
        return "inconclusive", "confidence interval undefined (fewer than 2 pairs or degenerate data)"
    low, high = ci
    span = f"CI [{low:.4f}, {high:.4f}]"
    if low <= 1 <= high:
        return "inconclusive", f"{span} contains 1"
    faster = low > 1
    if (speedup - 1 if faster else 1 - speedup) < min_effect:
        return "inconclusive", f"effect {speedup - 1:+.2%} smaller than the minimum {min_effect:.2%}"
    side, word = ("above", "faster") if faster else ("below", "slower")
    bound = f">= {min_effect:.2%}" if faster else f"<= -{min_effect:.2%}"
    if version < contract.DOCS["summary"]["verdict_test_since"]:
        return word, f"{span} {side} 1 and effect {speedup - 1:+.2%} {bound}"
    alpha = 1 - confidence
    if p is None or not p < alpha:
        return "inconclusive", f"{span} {side} 1 but signed-rank p " + ("undefined" if p is None else f"{p:.4g} >= {alpha:g}")
    return word, f"{span} {side} 1, signed-rank p {p:.4g} < {alpha:g} and effect {speedup - 1:+.2%} {bound}"


def comparison_stats(ratios: list[float], vd: dict, groups: list[np.ndarray] | None = None,
                     version: int = contract.VERSION) -> dict:
    """The summary's ``stats`` of one (job, point, comparison) of a bundle of format ``version``, ratios in
    pair order; ``groups``: the ratios per session (format 4), whose CI with more than one is the two-stage
    bootstrap's and whose BCa is undefined."""
    x = np.asarray(ratios, dtype=float)
    speedup = float(np.median(x))
    groups = groups if groups is not None else [x]

    def pair_ci(g: np.ndarray):
        return bootstrap_ci(g, vd["confidence"], vd["n_resamples"], vd["bootstrap_seed"], "percentile")

    ci = _evidence.interval(groups, vd, pair_ci)
    bca = bootstrap_ci(x, vd["confidence"], vd["n_resamples"], vd["bootstrap_seed"], "BCa") if len(groups) == 1 else None
    p, p_method = wilcoxon(x)
    word, why = verdict(speedup, ci, vd["min_effect"], x.size, vd["min_pairs"], version, p, vd["confidence"])
    return {"n_pairs": int(x.size), "ratios": [float(v) for v in x], "speedup": speedup, "ci": ci, "bca_ci": bca,
            "ci_method": "percentile" if len(groups) == 1 else _evidence.HIERARCHICAL, "confidence": vd["confidence"], "n_resamples": vd["n_resamples"],
            "bootstrap_seed": vd["bootstrap_seed"], "distinct_resamples": math.comb(2 * x.size - 1, x.size),
            "wilcoxon_p": p, "wilcoxon_method": p_method, "throughput_change": speedup - 1,
            "verdict": word, "verdict_reason": why}


def results(plan: dict, pairs: list[dict], publish: bool, version: int = contract.VERSION) -> list[dict]:
    """The summary's ``results``, in plan order (device, point, comparison), for groups with a complete pair."""
    cfg = plan["config"]
    groups: dict[tuple, list[dict]] = {}
    for p in pairs:
        groups.setdefault((p["job"], p["point"], p["comparison"]), []).append(p)
    out = []
    for dev in plan["devices"]:
        for pt in plan["points"]:
            for comp in cfg["comparisons"]:
                rows = sorted(groups.get((dev["name"], pt["key"], comp["name"]), []), key=lambda p: p["pair"])
                if not rows:
                    continue
                first = rows[0]
                sessions = version >= contract.DOCS["plan"]["sessions_since"]
                st = comparison_stats([p["ratio"] for p in rows], cfg["verdict"],
                                      _evidence.session_groups(plan, rows) if sessions else None, version)
                cd = first["num_requests"] * first["output_len"]
                out.append({
                    "job": dev["name"], "device": first["device"], "point": pt["key"],
                    "max_num_seqs": first["max_num_seqs"], "num_requests": first["num_requests"],
                    "output_len": first["output_len"], "comparison": comp["name"],
                    "baseline": comp["baseline"], "candidate": comp["candidate"], "pairs": [p["pair"] for p in rows],
                    "baseline_tokens_per_s": float(np.median([cd / p["baseline_s"] for p in rows])),
                    "candidate_tokens_per_s": float(np.median([cd / p["candidate_s"] for p in rows])),
                    "stats": st, "verdict": st["verdict"] if publish else None,
                    **({"evidence": _evidence.comparison_evidence(plan, rows, version)} if sessions else {})})
    return out


# ------------------------------------------------------------------------------------------ summary

def check_counts(records: list[dict], reference_points: set[str], plan: dict | None = None) -> dict:
    """What the reference check covers: arms, and the runs, requests and tokens of arms with a reference
    (not of natural-track arms, which are not compared with it: format 5)."""
    phases = requests = tokens = 0
    for r in records:
        if r["point"] not in reference_points or (plan is not None and check_natural.is_natural(plan, r)):
            continue
        for phase in PHASES:
            data = r.get(phase)
            if data is not None:
                phases += 1
                requests += len(data["outputs"])
                tokens += sum(len(o["token_ids"]) for o in data["outputs"].values())
    return {"arms_checked": len(records), "phases_checked": phases, "requests_checked": requests,
            "tokens_checked": tokens}


def planned_arms(plan: dict) -> int:
    return sum(len(v) for v in plan["order"].values())


def child_session(child: dict) -> str:
    """A child's session id; a bundle from before resume has none, and its child's name is its id."""
    return child.get("session", child["name"])


def record_session(record: dict) -> str:
    return record.get("session", record["job"])


def current_children(children: list[dict]) -> list[dict]:
    """The latest children.json entry per child name: a resume appends its sessions after earlier ones."""
    latest: dict[str, dict] = {}
    for c in children:
        latest[c["name"]] = c
    return list(latest.values())


def stop_code(interrupted_by: str) -> dict:
    """The status code of a child's structured ``interrupted_by``: a signal the controller got, or ``lost``."""
    return {"code": "lost"} if interrupted_by == "lost" else {"code": "stopped", "by": interrupted_by}


def incomplete_reasons(plan: dict, records: list[dict], children: list[dict], interrupted: dict | None) -> list[dict]:
    """The status codes, in the contract's order: how the controller stopped (from the current children),
    ``interrupted`` (a failed reference capture), each child that did not complete, the count of arms."""
    current = current_children(children)
    reasons = [stop_code(by) for by in dict.fromkeys(c.get("interrupted_by") for c in current) if by]
    reasons += [interrupted] if interrupted else []
    reasons += [{"code": "child_failed", "child": child_session(c), "state": c["state"], "exit_code": c["exit_code"]}
                for c in current if c["exit_code"] != 0 or c["state"] != "completed"]
    if len(records) != planned_arms(plan):
        reasons.append({"code": "arms_missing", "recorded": len(records), "planned": planned_arms(plan)})
    return reasons


def summary(plan: dict, plan_sha256: str, records: list[dict], children: list[dict], *, complete: bool,
            checks_ok: bool, reference_points: set[str], findings: list, interrupted: dict | None,
            version: int = contract.VERSION, natural: dict | None = None) -> dict:
    """summary.json as the bundle's records, plan and children make it, in format ``version``.

    ``findings`` (the harness checker's messages) cannot be re-derived from files; the caller passes what
    it can vouch for, and ``interrupted`` (a failed reference capture's code) as it derived it.
    """
    vd = plan["config"]["verdict"]
    publish = complete and checks_ok
    pairs = pair_rows(records)
    planned = planned_arms(plan)
    n_requests = sum(len(request_rows(r)) for r in records)
    n_tokens = sum(len(token_tuples(r)) for r in records)
    reasons = [] if complete else incomplete_reasons(plan, records, children, interrupted)
    derived = results(plan, pairs, publish, version)
    check_graphs.apply(plan, derived, pairs, records, version)
    return {
        "schema_version": contract.DOCS["summary"]["schema_version"] if version >= 2 else 1, "name": plan["name"],
        "status": "complete" if complete else "incomplete",
        "incomplete_reasons": reasons if version >= 2 else [contract.reason_text(r) for r in reasons],
        "verdicts_published": publish,
        "verdicts_barred_by": None if publish else ("run incomplete" if not complete else "checks failed"),
        "plan_sha256": plan_sha256,
        "verdict_rule": {"min_effect": vd["min_effect"], "confidence": vd["confidence"], "min_pairs": vd["min_pairs"],
                         "ci_method": "percentile bootstrap of the median", "n_resamples": vd["n_resamples"],
                         "bootstrap_seed": vd["bootstrap_seed"]},
        "counts": {"arms_planned": planned, "arms_recorded": len(records), "pairs_planned": planned // 2,
                   "pairs_complete": len(pairs), "requests": n_requests, "tokens": n_tokens},
        "checks": {"ok": checks_ok, **check_counts(records, reference_points, plan), "findings": findings,
                   **coverage_warnings(records)},
        "children": children,
        "results": derived,
        **({"evidence_rule": _evidence.evidence_rule(plan), "memory_creep": _evidence.memory_creep(plan, records, version)}
           if version >= contract.DOCS["plan"]["sessions_since"] else {}),
        # format 5: the natural track, as audit/check_natural.py re-derives it
        **({"natural": natural} if version >= contract.DOCS["summary"]["fields_since"]["natural"] else {}),
        # format 15: an A/A control whose rule outcome reads a change flags its point's other comparisons
        **({"noise_floor": noise_floor(derived)} if version >= contract.DOCS["summary"]["fields_since"]["noise_floor"]
           else {}),
    }


def noise_floor(results: list[dict]) -> list[dict]:
    """summary.json ``noise_floor`` as documents.summary.noise_floor_what states it: for each result whose baseline
    arm is its candidate arm and whose ``stats.verdict`` is one of ``noise_floor_verdicts``, its job, device, point,
    comparison, that outcome, speedup and CI, and the comparisons of its job and point whose arms differ."""
    flagged = [r for r in results if r["baseline"] == r["candidate"]
               and r["stats"]["verdict"] in contract.DOCS["summary"]["noise_floor_verdicts"]]
    return [{"job": aa["job"], "device": aa["device"], "point": aa["point"], "comparison": aa["comparison"],
             "verdict": aa["stats"]["verdict"], "speedup": aa["stats"]["speedup"], "ci": aa["stats"]["ci"],
             "affected": [r["comparison"] for r in results if (r["job"], r["point"]) == (aa["job"], aa["point"])
                          and r["baseline"] != r["candidate"]]}
            for aa in flagged]


def coverage_warnings(records: list[dict]) -> dict:
    """``{"warnings": [...]}`` when the records carry coverage, else ``{}`` (bundles before it).

    A comparison of arms that differ in kv_layout is flagged when no key was read from a plane below its
    query depth or its alias arm read no key through the exit map; one of arms that differ in
    prefix_tiles when its prefix arm read no tile directly or met no boundary tile. Each arm's counts are
    those of its first record in the comparison (they depend on point and arm only).
    """
    if not any("coverage" in r for r in records):
        return {}
    first: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if "coverage" in r:
            first.setdefault((r["job"], r["point"], r["comparison"]), {}).setdefault(r["position"], r)
    lines = []
    for (job, point, comp), pos in first.items():
        if len(pos) != 2:
            continue
        b, c = pos["baseline"], pos["candidate"]
        gaps = []
        if b["arm_config"]["kv_layout"] != c["arm_config"]["kv_layout"]:
            al = b if b["arm_config"]["kv_layout"] == "alias" else c
            if sum(al["coverage"]["lower_plane_reads"]) == 0:
                gaps.append("no decode row read a key from a plane below its depth")
            if not al["coverage"]["routed_reads"]:
                gaps.append(f"arm {al['arm']!r} read no key through the exit map")
        if bool(b["arm_config"]["prefix_tiles"]) != bool(c["arm_config"]["prefix_tiles"]):
            pf = b if b["arm_config"]["prefix_tiles"] else c
            if not pf["coverage"]["direct_tiles"]:
                gaps.append(f"arm {pf['arm']!r} read no key tile directly")
            if not pf["coverage"]["boundary_tiles"]:
                gaps.append(f"arm {pf['arm']!r} met no boundary tile")
        if gaps:
            lines.append(f"{job} {point} {comp}: {'; '.join(gaps)}: this comparison does not exercise where its "
                         "arms differ")
    return {"warnings": lines}
