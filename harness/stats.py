"""Statistics of paired A/B timings: pure functions with the method and source of each.

The seed's protocol (BRIEF section 2): per point and comparison, n pairs; each pair times the baseline
arm and the candidate arm once, in an order balanced over the pairs. Then

- pair ratio  r_i = baseline_s_i / candidate_s_i   (> 1: the candidate is faster),
- speedup     = median(r_1..r_n),
- 95% CI      = percentile bootstrap of the median over pairs (Efron & Tibshirani 1993, "An Introduction
  to the Bootstrap", ch. 13), 10,000 resamples, seeded; computed by ``scipy.stats.bootstrap``. BCa
  (ibid. ch. 14) is reported beside it where it is defined (it is not for degenerate data).
- tokens/s    = C * D / elapsed_s, reported per arm as the median over its measured runs.

With n pairs a bootstrap can draw only C(2n-1, n) distinct resamples (multisets of size n from n
items; Feller 1968, vol. 1, II.5), 1,716 for n = 7, so 10,000 resamples cannot make a 7-pair CI finer
than that; :func:`distinct_resamples` reports the count beside every CI.

The level is nominal, not the coverage. With few pairs the percentile interval of the median is a pair
of order statistics: for n = 7 it is [x_(2), x_(6)] (tests/harness/test_stats.py derives it), and for
continuous ratios P(x_(2) <= true median <= x_(6)) = 1 - 2 P(Binomial(7, 1/2) <= 1) = 1 - 16/128 =
0.875 (the order-statistic interval of a median; Conover 1999, "Practical Nonparametric Statistics",
3.2), so the "95%" interval of the seed's 7 pairs covers 87.5%. It excludes 1 as soon as 6 of 7 ratios
lie above it, where the exact two-sided sign test gives p = 16/128 = 0.125. By n the coverage is 0.94 at
5, 0.875 at 7, 0.96 at 9, 0.93 at 11 and 0.91 at 13 (exact, odd n), about 0.93 at 6 and 8 (simulated).

Independent restarts (``sessions: k``, issue 12): each device runs k fresh session processes one after
another, each with its own balanced pairs. Pairs of one session share its process state (allocator,
caches, clocks at load time), so they are not independent draws; :func:`hierarchical_median_ci`
resamples sessions, then pairs within each drawn session (the two-stage bootstrap of Davison & Hinkley
1997, "Bootstrap Methods and their Application", 3.8; Ren et al. 2010, "Nonparametric bootstrapping for
hierarchical data", J. Appl. Stat. 37(9)). With one session it is the pair bootstrap above, exactly.
Drift and order effects are tested per comparison (:func:`trend_test`, :func:`order_test`,
:func:`creep_test`) and the plan states the minimum detectable effect (:func:`detectable_effect`).

Nothing here raises on equal ratios or a single pair: the CI of one pair is undefined (reported as
None), and a verdict is then "inconclusive". An exception is never a verdict (STYLE rule 7).
"""
from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from itertools import product
from typing import Sequence

import numpy as np
import scipy
import scipy.stats

from . import draws

FIRST_BASELINE = "baseline"
FIRST_CANDIDATE = "candidate"


def balanced_first(n_pairs: int, seed: int | Sequence[int]) -> tuple[str, ...]:
    """Which arm runs first in each of ``n_pairs`` pairs: balanced, then shuffled with ``seed``.

    The baseline goes first in ceil(n/2) pairs and the candidate in floor(n/2) (the seed's 4 native-first
    and 3 alias-first for 7 pairs), so each arm is first equally often, up to one; the order of those
    first-movers is a seeded permutation (the contract's ``documents.plan.order_rule``, format 15: indices
    sorted by SHA-256, :func:`draws.permutation`; formats up to 14 took numpy's ``default_rng(seed).permutation``,
    whose stream numpy does not promise across its versions), which keeps a slow drift (heating, clocks) from
    lining up with one arm.
    """
    if isinstance(n_pairs, bool) or not isinstance(n_pairs, int) or n_pairs < 1:
        raise ValueError(f"n_pairs must be a positive integer, got {n_pairs!r}")
    parts = [seed] if isinstance(seed, (int, np.integer)) else list(seed) if isinstance(seed, Sequence) else [None]
    if any(isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 0 for p in parts):
        raise ValueError(f"seed must be a non-negative integer or a sequence of them, got {seed!r}")
    firsts = [FIRST_BASELINE] * math.ceil(n_pairs / 2) + [FIRST_CANDIDATE] * (n_pairs // 2)
    return tuple(firsts[i] for i in draws.permutation(n_pairs, parts))


def tokens_per_s(num_requests: int, output_len: int, elapsed_s: float) -> float:
    """Output tokens per second of one measured run: C * D / elapsed_s (BRIEF section 2)."""
    if not elapsed_s > 0:
        raise ValueError(f"elapsed_s must be > 0, got {elapsed_s!r}")
    return num_requests * output_len / elapsed_s


def pair_ratios(baseline_s: Sequence[float], candidate_s: Sequence[float]) -> np.ndarray:
    """r_i = baseline_s_i / candidate_s_i for each pair; > 1 means the candidate took less time."""
    b, c = np.asarray(baseline_s, dtype=float), np.asarray(candidate_s, dtype=float)
    if b.shape != c.shape or b.ndim != 1 or b.size == 0:
        raise ValueError(f"need two equal-length non-empty series, got {b.shape} and {c.shape}")
    if not (np.all(b > 0) and np.all(c > 0)):
        raise ValueError(f"elapsed seconds must be > 0, got baseline {b.tolist()} candidate {c.tolist()}")
    return b / c


def _log_ratios(ratios: Sequence[float]) -> np.ndarray:
    """log of ``ratios``, a 1-D series of finite ratios > 0; ValueError naming the series otherwise."""
    x = np.asarray(ratios, dtype=float)
    if x.ndim != 1 or not np.all(np.isfinite(x)) or not np.all(x > 0):
        raise ValueError(f"ratios must be a 1-D series of finite ratios > 0, got {ratios!r}")
    return np.log(x)


def _level(key: str, value: float) -> None:
    if not 0 < value < 1:
        raise ValueError(f"{key} must be in (0, 1), got {value!r}")


def distinct_resamples(n: int) -> int:
    """Number of distinct bootstrap resamples of n items, C(2n-1, n) (multisets; Feller 1968, II.5)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return math.comb(2 * n - 1, n)


def rng_kwargs(seed: int) -> dict:
    """The seed argument of ``scipy.stats.bootstrap``: a fresh ``numpy.random.default_rng(seed)`` as ``rng``
    (scipy >= 1.15) or as ``random_state`` (older releases, which pyproject allows); the same draws either way."""
    rng = np.random.default_rng(seed)
    params = inspect.signature(scipy.stats.bootstrap).parameters
    return {"rng": rng} if "rng" in params else {"random_state": rng}


def bootstrap_median_ci(ratios: Sequence[float], confidence: float = 0.95, n_resamples: int = 10_000,
                        seed: int = 0, method: str = "percentile") -> tuple[float, float] | None:
    """Bootstrap CI of the median of ``ratios`` by ``scipy.stats.bootstrap`` (``method``: percentile | BCa).

    Each call draws from a fresh ``numpy.random.default_rng(seed)``, so anyone with the ratios, the seed
    and the same scipy can recompute it exactly. Returns None where the interval is undefined: fewer
    than 2 pairs, or BCa on degenerate data (scipy then returns NaN).
    """
    x = np.asarray(ratios, dtype=float)
    if x.ndim != 1 or not np.all(np.isfinite(x)):
        raise ValueError(f"ratios must be a finite 1-D series, got {ratios!r}")
    _level("confidence", confidence)
    if x.size < 2:
        return None
    with warnings.catch_warnings():  # degenerate data: scipy warns and returns NaN, handled below
        warnings.simplefilter("ignore")
        res = scipy.stats.bootstrap((x,), np.median, n_resamples=n_resamples, confidence_level=confidence,
                                    method=method, vectorized=True, **rng_kwargs(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    return low, high


def wilcoxon_p(ratios: Sequence[float]) -> tuple[float, str]:
    """Two-sided Wilcoxon signed-rank p of H0 "median log-ratio = 0" (Wilcoxon 1945), and the method.

    Tested on log ratios so that a pair 10% faster and one 10% slower weigh alike. Without ties or zero
    differences, the exact null distribution (``scipy.stats.wilcoxon(method="exact")``). With ties or
    zeros, zeros are dropped (Wilcoxon's convention) and the p is exact conditional on the mid-ranks:
    all 2^m sign assignments are enumerated (m <= 16; beyond, the normal approximation, so named), as
    ``scipy.stats.permutation_test`` does for paired samples. Where every ratio equals 1 there is no difference
    to test: (1.0, "all ratios equal 1"). ValueError for an empty series or a ratio that is not finite and > 0.
    """
    d = _log_ratios(ratios)
    if d.size == 0:
        raise ValueError("ratios is empty: no pair to test")
    nonzero = d[d != 0]
    m = nonzero.size
    if m == 0:
        return 1.0, "all ratios equal 1"
    ranks = scipy.stats.rankdata(np.abs(nonzero))
    if len(np.unique(np.abs(nonzero))) == m and m == d.size:
        return float(scipy.stats.wilcoxon(d, method="exact").pvalue), "exact"
    if m > 16:
        return float(scipy.stats.wilcoxon(d, method="approx").pvalue), "normal approximation (ties, m > 16)"
    observed = ranks[nonzero > 0].sum()
    centre = ranks.sum() / 2
    signs = np.array(list(product((0.0, 1.0), repeat=m)))          # [2^m, m]
    w_plus = signs @ ranks
    extreme = np.abs(w_plus - centre) >= abs(observed - centre) - 1e-12
    return float(extreme.mean()), "exact conditional (ties or zeros)"


def verdict(speedup: float, ci: tuple[float, float] | None, min_effect: float, n_pairs: int | None = None,
            min_pairs: int = 1, p: float | None = None, alpha: float | None = None) -> tuple[str, str]:
    """The predeclared rule: ("faster" | "slower" | "inconclusive", why).

    faster: the whole CI lies above 1, the signed-rank test rejects "no difference" (``p`` < ``alpha``) and
    speedup - 1 >= min_effect; slower: the whole CI lies below 1, ``p`` < ``alpha`` and 1 - speedup >=
    min_effect; anything else (CI touching 1, p >= alpha or undefined, an effect below the minimum, an
    undefined CI, fewer than ``min_pairs`` pairs) is inconclusive. The CI says where the median lies, the
    test whether the direction is credible at the stated level, the minimum effect whether it is worth
    reporting; pyperf's "not significant" plays the same role. ``alpha`` None leaves the test out (bundle
    formats up to 10 decided on the CI alone).

    Why the test: with few pairs the percentile interval of the median is a pair of order statistics and
    covers less than its level: at n = 7 the "95%" interval is [x_(2), x_(6)], which holds the median with
    probability 87.5% and excludes 1 once 6 of 7 ratios lie above it, where the exact two-sided sign test
    gives p = 0.125 (module docstring). The exact signed-rank test (:func:`wilcoxon_p`, p = 2 / 2^n at
    best) holds the verdict's two-sided error to ``alpha`` = 1 - confidence; with ``alpha`` 0.05 it needs
    n >= 6 pairs (Wilcoxon 1945, "Individual comparisons by ranking methods"). ``min_pairs`` still rules out
    the smallest samples on its own."""
    if n_pairs is not None and n_pairs < min_pairs:
        noun = "pair" if n_pairs == 1 else "pairs"
        return "inconclusive", f"{n_pairs} {noun}, fewer than the minimum {min_pairs} for a verdict"
    if ci is None:
        return "inconclusive", "confidence interval undefined (fewer than 2 pairs or degenerate data)"
    low, high = ci
    span = f"CI [{low:.4f}, {high:.4f}]"
    side = "above" if low > 1 else "below" if high < 1 else None
    if side is None:
        return "inconclusive", f"{span} contains 1"
    effect = speedup - 1 if side == "above" else 1 - speedup
    if effect < min_effect:
        return "inconclusive", f"effect {speedup - 1:+.2%} smaller than the minimum {min_effect:.2%}"
    bound = f">= {min_effect:.2%}" if side == "above" else f"<= -{min_effect:.2%}"
    word = "faster" if side == "above" else "slower"
    if alpha is None:
        return word, f"{span} {side} 1 and effect {speedup - 1:+.2%} {bound}"
    if p is None or not p < alpha:
        shown = "undefined" if p is None else f"{p:.4g} >= {alpha:g}"
        return "inconclusive", f"{span} {side} 1 but signed-rank p {shown}"
    return word, f"{span} {side} 1, signed-rank p {p:.4g} < {alpha:g} and effect {speedup - 1:+.2%} {bound}"


@dataclass(frozen=True)
class ComparisonStats:
    """Everything reported for one (device, point, comparison)."""

    n_pairs: int
    ratios: tuple[float, ...]
    speedup: float
    ci: tuple[float, float] | None
    bca_ci: tuple[float, float] | None
    confidence: float
    n_resamples: int
    bootstrap_seed: int
    distinct_resamples: int
    wilcoxon_p: float | None
    wilcoxon_method: str
    verdict: str
    verdict_reason: str
    ci_method: str = "percentile"

    @property
    def throughput_change(self) -> float:
        """speedup - 1 (the seed's "throughput change" column)."""
        return self.speedup - 1

    def to_dict(self) -> dict:
        return {
            "n_pairs": self.n_pairs, "ratios": list(self.ratios), "speedup": self.speedup,
            "ci": list(self.ci) if self.ci else None, "bca_ci": list(self.bca_ci) if self.bca_ci else None,
            "ci_method": self.ci_method, "confidence": self.confidence, "n_resamples": self.n_resamples,
            "bootstrap_seed": self.bootstrap_seed, "distinct_resamples": self.distinct_resamples,
            "wilcoxon_p": self.wilcoxon_p, "wilcoxon_method": self.wilcoxon_method,
            "throughput_change": self.throughput_change, "verdict": self.verdict,
            "verdict_reason": self.verdict_reason,
        }


CI_PERCENTILE = "percentile"
CI_HIERARCHICAL = "hierarchical percentile (sessions, then pairs)"


def compare(baseline_s: Sequence[float], candidate_s: Sequence[float], *, confidence: float = 0.95,
            n_resamples: int = 10_000, seed: int = 0, min_effect: float = 0.01,
            min_pairs: int = 1, sessions: Sequence[int] | None = None) -> ComparisonStats:
    """Paired statistics of one comparison at one point (pairs in measurement order).

    ``sessions``: the session (restart) index of each pair; with more than one session the CI is
    :func:`hierarchical_median_ci` and BCa is not defined (it has no two-stage form here). Without it,
    or with one session, every number is the single-session pair bootstrap's.
    """
    ratios = pair_ratios(baseline_s, candidate_s)
    speedup = float(np.median(ratios))
    labels = [0] * ratios.size if sessions is None else list(sessions)
    if len(labels) != ratios.size:
        raise ValueError(f"sessions must give one index per pair, got {len(labels)} for {ratios.size} pairs")
    groups = [ratios[np.asarray(labels) == s] for s in dict.fromkeys(labels)]
    if len(groups) == 1:
        ci = bootstrap_median_ci(ratios, confidence, n_resamples, seed, "percentile")
        bca = bootstrap_median_ci(ratios, confidence, n_resamples, seed, "BCa") if ratios.size >= 2 else None
    else:
        ci, bca = hierarchical_median_ci(groups, confidence, n_resamples, seed), None
    p, p_method = wilcoxon_p(ratios)
    word, why = verdict(speedup, ci, min_effect, int(ratios.size), min_pairs, p, 1 - confidence)
    return ComparisonStats(
        n_pairs=int(ratios.size), ratios=tuple(float(r) for r in ratios), speedup=speedup, ci=ci, bca_ci=bca,
        confidence=confidence, n_resamples=n_resamples, bootstrap_seed=seed,
        distinct_resamples=distinct_resamples(int(ratios.size)), wilcoxon_p=p, wilcoxon_method=p_method,
        verdict=word, verdict_reason=why, ci_method=CI_PERCENTILE if len(groups) == 1 else CI_HIERARCHICAL)


# ------------------------------------------------------------------------- sessions, drift, power

def restart_of(pair: int, pairs_per_session: int) -> int:
    """The session (restart of a device, 0-based) of pair index ``pair``: the plan numbers pairs on over
    restarts, ``pairs_per_session`` to each (harness/plan.py). ValueError unless ``pair`` >= 0 and
    ``pairs_per_session`` >= 1."""
    if pair < 0 or pairs_per_session < 1:
        raise ValueError(f"need pair >= 0 and pairs_per_session >= 1, got {pair!r} and {pairs_per_session!r}")
    return pair // pairs_per_session


def hierarchical_medians(groups: Sequence[Sequence[float]], n_resamples: int, seed: int) -> np.ndarray:
    """[n_resamples] medians of two-stage bootstrap resamples of ``groups`` (one group = one session).

    Each resample draws k of the k sessions with replacement, then within each drawn session as many
    pairs as it has, with replacement, and takes the median of the pooled draws (Davison & Hinkley
    1997, 3.8). Drawn from ``numpy.random.default_rng(seed)``: session indices [n_resamples, k] first,
    then per session slot the pair indices [n_resamples, n_max] scaled to each drawn session's size.
    """
    xs = [np.asarray(g, dtype=float) for g in groups]
    if not xs or any(x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)) for x in xs):
        raise ValueError(f"groups must be non-empty finite 1-D series, got {groups!r}")
    rng = np.random.default_rng(seed)
    k, sizes = len(xs), np.array([x.size for x in xs])
    n_max = int(sizes.max())
    padded = np.full((k, n_max), np.nan)
    for i, x in enumerate(xs):
        padded[i, :x.size] = x
    chosen = rng.integers(0, k, size=(n_resamples, k))                       # [B, k] sessions
    u = rng.random(size=(n_resamples, k, n_max))                             # [B, k, n_max]
    picks = np.floor(u * sizes[chosen][..., None]).astype(int)              # pair index within session
    draws = padded[chosen[..., None], picks]                                 # [B, k, n_max]
    keep = np.arange(n_max)[None, None, :] < sizes[chosen][..., None]        # a session draws its own n
    return np.nanmedian(np.where(keep, draws, np.nan).reshape(n_resamples, -1), axis=1)


def hierarchical_median_ci(groups: Sequence[Sequence[float]], confidence: float = 0.95, n_resamples: int = 10_000,
                           seed: int = 0) -> tuple[float, float] | None:
    """Percentile interval of the median pair ratio over sessions, then pairs (:func:`hierarchical_medians`).

    With one session, resampling sessions always draws that session, so the interval is the pair
    bootstrap's: it is computed by :func:`bootstrap_median_ci` itself (``scipy.stats.bootstrap``,
    same seed), the numbers of a bundle before sessions existed. Percentiles are numpy's default
    (linear) ones, as scipy's percentile method takes them. None when fewer than 2 pairs in all.
    """
    if len(groups) == 1:
        return bootstrap_median_ci(groups[0], confidence, n_resamples, seed, "percentile")
    _level("confidence", confidence)
    if sum(len(g) for g in groups) < 2:
        return None
    medians = hierarchical_medians(groups, n_resamples, seed)
    alpha = 1 - confidence
    low, high = np.percentile(medians, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(low), float(high)


def session_spread(groups: Sequence[Sequence[float]]) -> dict:
    """Within- and between-session spread of pair ratios: each session's median and n, the SD of the
    session medians (between; None below 2 sessions) and the pooled within-session SD, sqrt of the
    sessions' variances (ddof 1) averaged with weights n_i - 1, their degrees of freedom (the one-way
    ANOVA within-group mean square; a one-pair session adds nothing); None when no session has 2 pairs."""
    xs = [np.asarray(g, dtype=float) for g in groups]
    medians = [float(np.median(x)) for x in xs]
    dof = sum(x.size - 1 for x in xs)
    within = math.sqrt(sum(float(np.var(x, ddof=1)) * (x.size - 1) for x in xs if x.size > 1) / dof) if dof else None
    return {"session_medians": medians, "session_pairs": [int(x.size) for x in xs],
            "between_sd": float(np.std(medians, ddof=1)) if len(xs) > 1 else None, "within_sd": within}


# Spearman's p by every order of the values up to this many (documents.summary.trend_exact_up_to of the bundle
# contract; 8! = 40,320 orders), beyond it scipy.stats.spearmanr's t approximation.
TREND_EXACT_UP_TO = 8


def trend_test(values: Sequence[float], alpha: float) -> dict:
    """Monotone trend of ``values`` over their index: Spearman's rank correlation rho (``scipy.stats.spearmanr``;
    Spearman 1904) and its two-sided p, flagged when p < ``alpha``.

    Up to :data:`TREND_EXACT_UP_TO` values the p is exact: the share of all n! orders of the values whose rho is
    at least as far from 0 as the observed one (the permutation null of Spearman's rho, ties at their average
    rank; Hollander & Wolfe 1999, "Nonparametric Statistical Methods", 8.5), computed by
    ``scipy.stats.permutation_test`` over every permutation. Beyond, spearmanr's t approximation, which is far
    off for few values: 3 values in order get p = 0 from it (rho = 1, t infinite) where the exact p is 1/3, the
    smallest possible at n = 3 (bundle format 12; earlier formats took the approximation at every n).
    rho and p are None (no test) below 3 values or for constant values. ValueError for ``alpha`` outside (0, 1), and
    for a NaN among ``values`` (no rank: the exact p of such values was 0, a flag at any alpha)."""
    _level("alpha", alpha)
    x = np.asarray(values, dtype=float)
    if np.isnan(x).any():
        raise ValueError(f"values must be numbers, got a NaN in {list(values)!r}")
    if x.size < 3 or np.all(x == x[0]):
        return {"method": "spearman", "n": int(x.size), "statistic": None, "p": None, "flag": False}
    res = scipy.stats.spearmanr(np.arange(x.size), x)
    rho = float(res.statistic)
    p = spearman_exact_p(x) if x.size <= TREND_EXACT_UP_TO else float(res.pvalue)
    return {"method": "spearman", "n": int(x.size), "statistic": rho, "p": p, "flag": bool(p < alpha)}


def spearman_exact_p(values: Sequence[float]) -> float:
    """Two-sided exact p of Spearman's rho of ``values`` against their index, over all n! orders of the values
    (:func:`trend_test`; n at most :data:`TREND_EXACT_UP_TO`, else ValueError: the enumeration grows as n!)."""
    x = np.asarray(values, dtype=float)
    if not 2 <= x.size <= TREND_EXACT_UP_TO:
        raise ValueError(f"an exact Spearman p takes 2 to {TREND_EXACT_UP_TO} values, got {x.size}")
    index = np.arange(x.size, dtype=float)
    index -= index.mean()

    def rho(ranks, axis=-1):      # Pearson's r of the ranks with the index: Spearman's rho with average ranks
        centred = ranks - ranks.mean(axis=axis, keepdims=True)
        return (centred * index).sum(axis=axis) / np.sqrt((centred ** 2).sum(axis=axis) * (index ** 2).sum())

    res = scipy.stats.permutation_test((scipy.stats.rankdata(x),), rho, permutation_type="pairings",
                                       vectorized=True, n_resamples=np.inf, alternative="two-sided")
    return float(res.pvalue)


def order_test(ratios: Sequence[float], firsts: Sequence[str], alpha: float) -> dict:
    """Order effect: pair ratios of baseline-first pairs against candidate-first pairs, two-sided
    Mann-Whitney U (``scipy.stats.mannwhitneyu``, method "auto": exact for small samples without ties;
    Mann & Whitney 1947), flagged when p < ``alpha``. The exact p is at least 2 / C(n, n_candidate_first), so up
    to 7 pairs in all nothing can flag at 0.05 (balanced: 6, 3 against 3, 2 / 20 = 0.1; 7, 4 against 3, 2 / 35 =
    0.057; 8 pairs can, 2 / 70 = 0.029); with tied ratios "auto" takes the normal approximation, which can fall
    below that bound. None when either group is empty. ValueError for ``alpha`` outside (0, 1) or ``firsts`` that
    do not name one of the two arms per ratio."""
    _level("alpha", alpha)
    x = np.asarray(ratios, dtype=float)
    f = np.asarray(firsts)
    if x.shape != f.shape or not set(f.tolist()) <= {FIRST_BASELINE, FIRST_CANDIDATE}:
        raise ValueError(f"firsts must name {FIRST_BASELINE!r} or {FIRST_CANDIDATE!r} per ratio, got {firsts!r}")
    a, b = x[f == FIRST_BASELINE], x[f == FIRST_CANDIDATE]
    out = {"method": "mann-whitney u", "n_baseline_first": int(a.size), "n_candidate_first": int(b.size)}
    if a.size == 0 or b.size == 0:
        return {**out, "statistic": None, "p": None, "flag": False}
    res = scipy.stats.mannwhitneyu(a, b, alternative="two-sided")
    p = float(res.pvalue)
    return {**out, "statistic": float(res.statistic), "p": p, "flag": bool(p < alpha)}


def creep_test(peaks: Sequence[float | None], alpha: float) -> dict:
    """Allocator peak creep: a rising trend of the arms' peak allocated bytes over run order, Spearman
    (:func:`trend_test`), flagged only when rho > 0 and p < ``alpha``. None entries (no device memory:
    the CPU) are left out; with fewer than 3 there is no test."""
    x = [float(v) for v in peaks if v is not None]
    t = trend_test(x, alpha)
    return {**t, "first": x[0] if x else None, "last": x[-1] if x else None,
            "flag": bool(t["flag"] and t["statistic"] > 0)}


def log_ratio_sd(ratios: Sequence[float]) -> float | None:
    """Sample SD (ddof 1) of log pair ratios, the noise of one pair; None below 2 ratios. ValueError for a ratio
    that is not finite and > 0."""
    d = _log_ratios(ratios)
    return float(np.std(d, ddof=1)) if d.size > 1 else None


def detectable_effect(sigma: float | None, n_pairs: int, alpha: float, power: float) -> dict:
    """Minimum detectable effect of a paired design with ``n_pairs`` pairs, normal approximation:

        MDE = (z_{1-alpha/2} + z_{power}) * sigma / sqrt(n)

    on the log pair ratio, where sigma is the SD of one pair's log ratio (Cohen 1988, "Statistical Power
    Analysis for the Behavioral Sciences", 2.3; Chow, Shao & Wang 2008, "Sample Size Calculations in
    Clinical Research", 3.1, the one-sample / paired case). ``relative`` = exp(MDE) - 1, the speedup
    the design would detect with probability ``power`` at two-sided level ``alpha``. A normal
    approximation: with few pairs the t quantiles are larger, so it flatters small designs. It is the
    MDE of a test of the mean log ratio, while the verdict takes the median's interval (the median's asymptotic
    variance is pi / 2 times the mean's under normal noise), the signed-rank test and ``min_effect``; so the
    predeclared rule detects this effect less often than ``power`` says (simulated with normal noise, sigma 0.02
    to 0.05, power 0.8, min_effect 0.01: about 0.6 at n = 7 and at n = 14; format 10's rule, the interval and
    the effect alone, about 0.7 and 0.65).
    ``sigma`` None: the effect is unknown. ValueError for ``sigma`` not finite and >= 0, ``n_pairs`` < 1 or a level
    outside (0, 1).
    """
    bad_n = isinstance(n_pairs, bool) or not isinstance(n_pairs, int) or n_pairs < 1
    if bad_n or not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"need n_pairs >= 1, alpha and power in (0, 1); got {n_pairs!r}, {alpha!r}, {power!r}")
    if sigma is not None and not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite SD >= 0 or None, got {sigma!r}")
    if sigma is None:
        return {"n_pairs": n_pairs, "mde_log_ratio": None, "mde_relative": None}
    z = float(scipy.stats.norm.ppf(1 - alpha / 2) + scipy.stats.norm.ppf(power))
    mde = z * sigma / math.sqrt(n_pairs)
    return {"n_pairs": n_pairs, "mde_log_ratio": mde, "mde_relative": math.expm1(mde)}


def environment() -> dict:
    """Library versions the numbers depend on (recorded so an audit knows what to recompute with)."""
    return {"numpy": np.__version__, "scipy": scipy.__version__}
