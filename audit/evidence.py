"""Evidence beyond one session (bundle format 4), re-derived with the auditor's own code.

From the raw records and the plan alone, following the contract (audit/FORMAT.md, "Sessions, drift and
detectable effect") and the methods harness/stats.py documents, re-implemented here:

- a pair's session is its planned restart, pair // pairs (the plan's ``config.pairs`` per session);
- the interval of a comparison over k > 1 sessions: the two-stage bootstrap (sessions with
  replacement, then pairs within each drawn session; Davison & Hinkley 1997, 3.8) from a fresh
  ``default_rng(bootstrap_seed)``, drawn as the contract states, and numpy's percentiles of its medians;
  one session: scipy's percentile bootstrap of the median, as before sessions (derive.bootstrap_ci);
- spread: each session's median, the SD of those medians (ddof 1), the pooled within-session SD;
- drift: Spearman's rho of the ratio against pair order, its p from format ``trend_exact_since`` (12) by
  enumerating every order of up to ``trend_exact_up_to`` values (before: scipy's t approximation at every n);
  order: two-sided Mann-Whitney U of baseline-first against candidate-first ratios; creep: Spearman of peak
  allocated bytes over seq;
- the plan's minimum detectable effect, (z_{1-alpha/2} + z_power) * sigma / sqrt(n) on log ratios.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from pathlib import Path

import numpy as np
import scipy.stats

from . import contract
from .context import Audit

PLAN = contract.DOCS["plan"]
SUMMARY = contract.DOCS["summary"]
HIERARCHICAL = "hierarchical percentile (sessions, then pairs)"


def sessions_of(plan: dict) -> int:
    """Restarts per device: the config's ``sessions`` (a bundle before format 4 has one)."""
    return plan["config"].get("sessions", 1)


def two_stage_medians(groups: list[np.ndarray], n_resamples: int, seed: int) -> np.ndarray:
    """Medians of the two-stage resamples, drawn as the contract states: session indices
    ``integers(0, k, (B, k))``, then ``random((B, k, n_max))`` floored into each drawn session's pairs."""
    rng = np.random.default_rng(seed)
    k = len(groups)
    sizes = np.array([g.size for g in groups])
    chosen = rng.integers(0, k, size=(n_resamples, k))
    u = rng.random(size=(n_resamples, k, int(sizes.max())))
    medians = np.empty(n_resamples)
    for b in range(n_resamples):   # plain loops: a second, obvious implementation of the same draws
        pooled = [groups[s][int(math.floor(u[b, j, i] * sizes[s]))] for j, s in enumerate(chosen[b])
                  for i in range(sizes[s])]
        medians[b] = np.median(pooled)
    return medians


def interval(groups: list[np.ndarray], vd: dict, one_session_ci) -> list | None:
    """The comparison's CI: ``one_session_ci`` for one session, else the two-stage percentile interval."""
    if len(groups) == 1:
        return one_session_ci(groups[0])
    if sum(g.size for g in groups) < 2:
        return None
    alpha = 1 - vd["confidence"]
    low, high = np.percentile(two_stage_medians(groups, vd["n_resamples"], vd["bootstrap_seed"]),
                              [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return [float(low), float(high)]


def _rank_correlation(ranks: tuple[float, ...] | list[float]) -> float:
    """Pearson's r of ``ranks`` with their positions 0..n-1."""
    n = len(ranks)
    pos_mean, rank_mean = (n - 1) / 2, sum(ranks) / n
    num = sum((i - pos_mean) * (r - rank_mean) for i, r in enumerate(ranks))
    den = math.sqrt(sum((i - pos_mean) ** 2 for i in range(n)) * sum((r - rank_mean) ** 2 for r in ranks))
    return num / den


def exact_spearman_p(values: list[float]) -> float:
    """The share of all n! orders of ``values`` whose rank correlation with position is at least as far from 0 as
    theirs (two-sided), by enumeration; a tolerance of 1e-9 counts orders tied with the observed one."""
    ranks = scipy.stats.rankdata(values).tolist()   # 1-based, ties at their average rank
    observed = abs(_rank_correlation(ranks))
    hits = sum(abs(_rank_correlation(order)) >= observed - 1e-9 for order in itertools.permutations(ranks))
    return hits / math.factorial(len(values))


def _spearman(values: list[float], alpha: float, version: int) -> dict:
    x = np.asarray(values, dtype=float)
    if x.size < 3 or np.all(x == x[0]):
        return {"method": "spearman", "n": int(x.size), "statistic": None, "p": None, "flag": False}
    res = scipy.stats.spearmanr(np.arange(x.size), x)
    exact = version >= SUMMARY["trend_exact_since"] and x.size <= SUMMARY["trend_exact_up_to"]
    p = exact_spearman_p([float(v) for v in x]) if exact else float(res.pvalue)
    return {"method": "spearman", "n": int(x.size), "statistic": float(res.statistic), "p": p, "flag": bool(p < alpha)}


def _order(ratios: list[float], firsts: list[str], alpha: float) -> dict:
    a = [r for r, f in zip(ratios, firsts) if f == "baseline"]
    b = [r for r, f in zip(ratios, firsts) if f == "candidate"]
    out = {"method": "mann-whitney u", "n_baseline_first": len(a), "n_candidate_first": len(b)}
    if not a or not b:
        return {**out, "statistic": None, "p": None, "flag": False}
    res = scipy.stats.mannwhitneyu(a, b, alternative="two-sided")
    return {**out, "statistic": float(res.statistic), "p": float(res.pvalue), "flag": bool(res.pvalue < alpha)}


def comparison_evidence(plan: dict, rows: list[dict], version: int = contract.VERSION) -> dict:
    """A result's ``evidence`` from its pair rows (derive.pair_rows, in pair order), as format ``version`` tests."""
    cfg = plan["config"]
    alpha, n = cfg["evidence"]["alpha"], cfg["pairs"]
    ratios = [p["ratio"] for p in rows]
    by_session: dict[int, list[float]] = {}
    for p in rows:
        by_session.setdefault(p["pair"] // n, []).append(p["ratio"])
    medians = [float(np.median(v)) for v in by_session.values()]
    dof = sum(len(v) - 1 for v in by_session.values())
    within = math.sqrt(sum(float(np.var(v, ddof=1)) * (len(v) - 1) for v in by_session.values() if len(v) > 1) / dof) \
        if dof else None
    return {"sessions": sorted(by_session), "session_medians": medians,
            "session_pairs": [len(v) for v in by_session.values()],
            "between_sd": float(np.std(medians, ddof=1)) if len(medians) > 1 else None, "within_sd": within,
            "trend": _spearman(ratios, alpha, version), "order": _order(ratios, [p["first"] for p in rows], alpha)}


def session_groups(plan: dict, rows: list[dict]) -> list[np.ndarray]:
    """The comparison's ratios per session, sessions in order of their first pair."""
    groups: dict[int, list[float]] = {}
    for p in rows:
        groups.setdefault(p["pair"] // plan["config"]["pairs"], []).append(p["ratio"])
    return [np.asarray(v, dtype=float) for v in groups.values()]


def memory_creep(plan: dict, records: list[dict], version: int = contract.VERSION) -> list[dict]:
    """Per device with records: Spearman of measured peak allocated bytes over seq, flagged when rising (as format
    ``version`` tests)."""
    alpha, out = plan["config"]["evidence"]["alpha"], []
    for dev in plan["devices"]:
        mine = sorted((r for r in records if r["job"] == dev["name"]), key=lambda r: r["seq"])
        if not mine:
            continue
        peaks = [float(p) for r in mine if (p := r["measured"]["memory"]["peak_allocated_bytes"]) is not None]
        t = _spearman(peaks, alpha, version)
        out.append({"job": dev["name"], "device": mine[0]["device"]["label"], **t,
                    "first": peaks[0] if peaks else None, "last": peaks[-1] if peaks else None,
                    "flag": bool(t["flag"] and t["statistic"] > 0)})
    return out


def evidence_rule(plan: dict) -> dict:
    cfg = plan["config"]
    return {"sessions": sessions_of(plan), "pairs_per_session": cfg["pairs"], "alpha": cfg["evidence"]["alpha"],
            "ci_method": "percentile" if sessions_of(plan) == 1 else HIERARCHICAL}


# ------------------------------------------------------------------------------ detectable effect

def expected_detectable_effect(plan: dict) -> dict:
    """plan.json ``detectable_effect`` from the config and the noise ratios the plan carries."""
    cfg, de = plan["config"], plan["detectable_effect"]
    noise = dict(de["noise"])
    if noise["source"] == "bundle":
        d = np.log(np.asarray(noise["ratios"], dtype=float))
        noise["sigma_log_ratio"] = float(np.std(d, ddof=1)) if d.size > 1 else None
    elif noise["source"] == "declared":
        noise["sigma_log_ratio"] = cfg["evidence"]["noise_sigma"]
    else:
        noise["sigma_log_ratio"] = None
    alpha, power, n = 1 - cfg["verdict"]["confidence"], cfg["evidence"]["power"], cfg["pairs"] * sessions_of(plan)
    mde = None
    if noise["sigma_log_ratio"] is not None:
        mde = (scipy.stats.norm.ppf(1 - alpha / 2) + scipy.stats.norm.ppf(power)) * noise["sigma_log_ratio"] / math.sqrt(n)
    return {"method": de["method"], "alpha": alpha, "power": power, "pairs_per_session": cfg["pairs"],
            "sessions": sessions_of(plan), "n_pairs": n, "mde_log_ratio": None if mde is None else float(mde),
            "mde_relative": None if mde is None else math.expm1(float(mde)), "noise": noise}


def _noise_source_problem(plan: dict) -> str | None:
    """Why the noise source disagrees with the config, or a noise bundle still at its path with another summary."""
    ev, noise = plan["config"]["evidence"], plan["detectable_effect"]["noise"]
    want = "bundle" if ev["noise_bundle"] is not None else "declared" if ev["noise_sigma"] is not None else "unknown"
    if noise["source"] != want or (want == "bundle" and noise["bundle"] != ev["noise_bundle"]):
        return f"detectable_effect.noise.source is {noise['source']!r}, the config gives {want!r}"
    if want != "bundle" and any(noise[k] is not None for k in ("bundle", "summary_sha256", "ratios")):
        return f"detectable_effect.noise names a bundle or ratios, but its source is {want!r}"
    summary = Path(ev["noise_bundle"]).expanduser() / "summary.json" if want == "bundle" else None
    if summary is not None and summary.is_file() and hashlib.sha256(summary.read_bytes()).hexdigest() != noise["summary_sha256"]:
        return f"detectable_effect.noise.summary_sha256 is not that of {summary}"
    return None


def check_detectable_effect(ctx: Audit, plan: dict) -> None:
    """Format 4: the plan's detectable effect has the contract's fields and is the one its config and
    noise ratios give (each differing field named); before format 4 a plan has none."""
    if ctx.version < PLAN["sessions_since"]:
        return
    de = plan.get("detectable_effect")
    problem = contract.fields_problem(de, PLAN["detectable_effect_fields"], "plan.json: detectable_effect.", closed=True) \
        if isinstance(de, dict) else f"plan.json: detectable_effect is {de!r}"
    if problem is None:
        problem = contract.fields_problem(de["noise"], PLAN["noise_fields"], "plan.json: detectable_effect.noise.",
                                          closed=True) if isinstance(de["noise"], dict) else "noise is not an object"
    if problem is not None:
        ctx.fail("plan", problem)
        return
    problem = _noise_source_problem(plan)
    if problem is not None:
        ctx.fail("plan", problem)
    want = expected_detectable_effect(plan)
    for key in sorted(want):
        got, exp = de.get(key), want[key]
        same = got == exp or (isinstance(got, float) and isinstance(exp, float) and math.isclose(got, exp, rel_tol=1e-12))
        if key == "noise":
            same = all(got.get(k) == v or (isinstance(v, float) and isinstance(got.get(k), float)
                                           and math.isclose(got[k], v, rel_tol=1e-12)) for k, v in exp.items())
        if not same:
            ctx.fail("plan", f"detectable_effect.{key} is {got!r}, the audit derives {exp!r}")
    ctx.count("detectable_effect")


def check_session_restarts(ctx: Audit, plan: dict, records: list[dict]) -> None:
    """Format 4: each session measured pairs of one restart only, so that the sessions the statistics
    treat as independent were separate processes."""
    if ctx.version < PLAN["sessions_since"]:
        if sessions_of(plan) != 1:   # a downgrade: older formats have one session per device
            ctx.fail("sessions", f"config sessions = {sessions_of(plan)!r}: format version {ctx.version} has one "
                                 f"session per device (sessions are version {PLAN['sessions_since']} content)")
        return
    n, seen = plan["config"]["pairs"], {}
    for r in records:
        sid = r.get("session", r["job"])
        seen.setdefault((r["job"], sid), set()).add(r["pair"] // n)
    for (job, sid), restarts in sorted(seen.items()):
        if len(restarts) > 1:
            ctx.fail("sessions", f"{job}: session {sid} measured pairs of restarts {sorted(restarts)}; each restart "
                                 "is a session of its own")
    ctx.count("session_restarts", len(seen))
