"""Evidence beyond one session (issue 12), as summary.json carries it: per comparison the spread within
and between independent sessions and the drift and order tests; per device the allocator's peak creep.

Inputs are the bundle's tables (evidence.build_tables); the statistics are :mod:`stats`'s pure
functions. A session here is a planned restart of a device (``stats.restart_of``: restart s holds pairs
s * pairs .. (s + 1) * pairs - 1), so with ``sessions: 1`` there is one, whatever resumes happened.
"""
from __future__ import annotations

import pandas as pd

from . import stats
from .stats import restart_of


def pair_sessions(pairs: list[int], cfg: dict) -> list[int]:
    """The restart index of each pair index (the plan's config: ``pairs`` per session)."""
    return [restart_of(int(p), cfg["pairs"]) for p in pairs]


def comparison_evidence(grp: pd.DataFrame, cfg: dict) -> dict:
    """A result's ``evidence``: its pairs' sessions, spread within and between them, Spearman trend of the
    ratio over pair order and the Mann-Whitney order effect (baseline-first vs candidate-first pairs).

    ``grp``: the comparison's pairs.parquet rows sorted by pair.
    """
    alpha = cfg["evidence"]["alpha"]
    sessions = pair_sessions(grp["pair"].tolist(), cfg)
    ratios = [float(r) for r in grp["ratio"]]
    groups = [[r for r, s in zip(ratios, sessions) if s == k] for k in dict.fromkeys(sessions)]
    return {"sessions": sorted(set(sessions)), **stats.session_spread(groups),
            "trend": stats.trend_test(ratios, alpha), "order": stats.order_test(ratios, grp["first"].tolist(), alpha)}


def memory_creep(plan: dict, arms: pd.DataFrame) -> list[dict]:
    """Per device of the plan with arms: the Spearman trend of measured peak allocated bytes over run order
    (seq), flagged when rising at ``evidence.alpha`` (``stats.creep_test``; no test without device memory)."""
    alpha, out = plan["config"]["evidence"]["alpha"], []
    for dev in plan["devices"]:
        rows = arms[arms["job"] == dev["name"]].sort_values("seq") if len(arms) else arms
        if not len(rows):
            continue
        peaks = [None if pd.isna(v) else int(v) for v in rows["peak_allocated_bytes"]]
        out.append({"job": dev["name"], "device": rows.iloc[0]["device"], **stats.creep_test(peaks, alpha)})
    return out


def evidence_rule(cfg: dict) -> dict:
    """The summary's ``evidence_rule``: sessions per device and the declared level of the drift tests."""
    return {"sessions": cfg["sessions"], "pairs_per_session": cfg["pairs"], "alpha": cfg["evidence"]["alpha"],
            "ci_method": stats.CI_PERCENTILE if cfg["sessions"] == 1 else stats.CI_HIERARCHICAL}


NOISE_FLOOR_VERDICTS = ("faster", "slower")   # bundle_format.json documents.summary.noise_floor_verdicts


def noise_floor(results: list[dict]) -> list[dict]:
    """The summary's ``noise_floor`` (format 15): per (job, point) whose A/A comparison (baseline arm = candidate
    arm) has a rule outcome of faster or slower, that result's figures and the other comparisons of the same job
    and point (``affected``). Both arms of an A/A run one configuration, so such an outcome says the point's
    between-arm noise (order, drift, machine load) is larger than its interval admits. It is a flag, never a
    verdict (STYLE rule 7): the rule's verdicts stay, and the report warns next to them; the rule runs at level
    ``1 - confidence``, so one A/A in twenty reads a change on a sound set-up, and withdrawing verdicts on it would
    make a statistic into a gate and hide what was measured."""
    out = []
    for aa in results:
        if aa["baseline"] != aa["candidate"] or aa["stats"]["verdict"] not in NOISE_FLOOR_VERDICTS:
            continue
        affected = [r["comparison"] for r in results if r["job"] == aa["job"] and r["point"] == aa["point"]
                    and r["comparison"] != aa["comparison"] and r["baseline"] != r["candidate"]]
        out.append({"job": aa["job"], "device": aa["device"], "point": aa["point"], "comparison": aa["comparison"],
                    "verdict": aa["stats"]["verdict"], "speedup": aa["stats"]["speedup"], "ci": aa["stats"]["ci"],
                    "affected": affected})
    return out
