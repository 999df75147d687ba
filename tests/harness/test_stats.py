"""Paired statistics: balanced order, bootstrap CI against a hand-computed case, degenerate inputs."""
import hashlib
import itertools
import math

import numpy as np
import pytest
import scipy.stats

from loopbench.harness import stats
from loopbench.harness.evidence import FORMAT


@pytest.mark.parametrize("n", range(1, 21))
def test_balanced_order_is_balanced_for_1_to_20_pairs(n):
    for seed in (0, 1, [7, 0, 2]):
        order = stats.balanced_first(n, seed)
        assert len(order) == n
        assert order.count("baseline") == math.ceil(n / 2)
        assert order.count("candidate") == n // 2
        assert order == stats.balanced_first(n, seed)  # seeded: the same order again


def test_balanced_order_is_shuffled_by_the_seed():
    orders = {stats.balanced_first(10, s) for s in range(20)}
    assert len(orders) > 5
    with pytest.raises(ValueError, match="n_pairs"):
        stats.balanced_first(0, 0)


def _order_rule(n, seed):
    """documents.plan.order_rule as its text reads: indices by the SHA-256 digest of 'loopbench order <seeds joined by
    ','> <index>', ascending; pair j runs baseline first when permutation[j] < ceil(n / 2)."""
    digest = {i: hashlib.sha256(f"loopbench order {','.join(map(str, seed))} {i}".encode()).digest() for i in range(n)}
    return tuple("baseline" if i < math.ceil(n / 2) else "candidate" for i in sorted(range(n), key=digest.get))


def test_the_balanced_order_follows_the_contracts_rule_without_numpys_generator(monkeypatch):
    """Format 15 (contract documents.plan.order_rule): numpy's Generator, whose stream numpy does not promise across
    its versions, is not used (a default_rng that raises changes nothing)."""
    def no_generator(*args, **kwargs):
        raise AssertionError("the order drew from numpy.random.default_rng")
    monkeypatch.setattr(np.random, "default_rng", no_generator)
    rule = FORMAT["documents"]["plan"]
    assert rule["order_rule_since"] == 15 <= FORMAT["version"]
    assert rule["order_message"].format(seed="0,1,2", index=3) == "loopbench order 0,1,2 3"
    for n, seed in [(1, 0), (2, [0, 0, 1]), (7, [3, 1, 0]), (8, [0, 2, 1, 1]), (20, 5)]:
        got = stats.balanced_first(n, seed)
        assert got == _order_rule(n, [seed] if isinstance(seed, int) else seed), (n, seed)
        assert got.count("baseline") == math.ceil(n / 2) and got.count("candidate") == n // 2
    assert stats.balanced_first(7, [3, 1, 0]) != stats.balanced_first(7, [3, 1, 1])   # another comparison's seed


def test_bootstrap_matches_hand_computed_case():
    """Seven distinct ratios: the 95% percentile CI of the median is [2nd smallest, 2nd largest].

    By hand: a resample's median is <= x_(k) iff at least 4 of its 7 draws are <= x_(k), so
    P(median <= x_(k)) = P(Binomial(7, k/7) >= 4). For k = 1 that is 0.0101 < 0.025, for k = 2 it is
    0.1083 > 0.025, so the 2.5% quantile of the bootstrap distribution is x_(2); by symmetry the
    97.5% quantile is x_(6). 10,000 resamples put ~101 medians at x_(1), far from the 250th order
    statistic, so the Monte Carlo interval equals the exact one.
    """
    p_le_x1 = sum(math.comb(7, j) * (1 / 7) ** j * (6 / 7) ** (7 - j) for j in range(4, 8))
    p_le_x2 = sum(math.comb(7, j) * (2 / 7) ** j * (5 / 7) ** (7 - j) for j in range(4, 8))
    assert p_le_x1 == pytest.approx(0.01015, abs=1e-4) and p_le_x2 == pytest.approx(0.1083, abs=1e-3)
    ratios = [1.031, 0.987, 1.012, 1.044, 0.995, 1.020, 1.003]
    x = sorted(ratios)
    low, high = stats.bootstrap_median_ci(ratios, 0.95, 10_000, seed=0)
    assert (low, high) == (x[1], x[5])
    for seed in range(1, 6):
        assert stats.bootstrap_median_ci(ratios, 0.95, 10_000, seed=seed) == (x[1], x[5])
    res = stats.compare([r * 2.0 for r in ratios], [2.0] * 7)
    assert res.speedup == pytest.approx(np.median(ratios))
    assert res.distinct_resamples == 1716 == math.comb(13, 7)



def test_seven_pair_interval_is_nominally_95_but_covers_87_5_percent():
    """The module docstring's coverage: [x_(2), x_(6)] holds a continuous median with probability
    P(2 <= Binomial(7, 1/2) <= 5) = 112/128; the code's own intervals, on normal log ratios around a
    known median of 1, cover about that, far from 0.95; and 6 of 7 ratios above 1 already give a
    "faster" verdict where the exact sign test has p = 0.125."""
    exact = sum(math.comb(7, j) for j in range(2, 6)) / 2**7
    assert exact == 0.875
    rng = np.random.default_rng(12)
    trials = 400
    hits = 0
    for i in range(trials):
        low, high = stats.bootstrap_median_ci(np.exp(rng.normal(0.0, 0.02, 7)), 0.95, 2_000, seed=i)
        hits += low <= 1.0 <= high
    assert 0.82 < hits / trials < 0.92           # binomial SE of 400 trials at 0.875: 0.017
    six_of_seven = [1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 0.5]
    res = stats.compare(six_of_seven, [1.0] * 7, min_pairs=6)
    assert res.ci == (1.02, 1.06)                 # the interval alone would say faster ...
    assert scipy.stats.binomtest(6, 7).pvalue == pytest.approx(0.125)
    # ... where neither the sign test nor the signed-rank test is near 0.05: the verdict rule's test holds it back
    assert res.wilcoxon_p == pytest.approx(38 / 128)
    assert (res.verdict, res.verdict_reason) == ("inconclusive", "CI [1.0200, 1.0600] above 1 but signed-rank p "
                                                                 "0.2969 >= 0.05")


@pytest.mark.parametrize("ratios, word, reason", [
    # every pair one way: the exact two-sided p is 2 / 2^7
    ([1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08], "faster",
     "CI [1.0300, 1.0700] above 1, signed-rank p 0.01562 < 0.05 and effect +5.00% >= 1.00%"),
    ([1 / r for r in (1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08)], "slower",
     "CI [0.9346, 0.9709] below 1, signed-rank p 0.01562 < 0.05 and effect -4.76% <= -1.00%"),
    # one small pair the other way: W- = 1, p = 2 * 2 / 128
    ([1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 0.999], "faster",
     "CI [1.0200, 1.0600] above 1, signed-rank p 0.03125 < 0.05 and effect +4.00% >= 1.00%"),
    # the test passes but the effect is below the minimum: the effect's reason, as before the test
    ([1.001, 1.002, 1.003, 1.004, 1.005, 1.006, 1.007], "inconclusive", "effect +0.40% smaller than the minimum 1.00%"),
])
def test_the_verdict_needs_the_interval_the_signed_rank_test_and_the_effect(ratios, word, reason):
    res = stats.compare(ratios, [1.0] * len(ratios), min_pairs=6)
    assert (res.verdict, res.verdict_reason) == (word, reason)


def test_the_verdict_without_a_test_level_is_the_interval_and_the_effect_alone():
    """``alpha`` None: formats up to 10 decided so, in these words."""
    assert stats.verdict(1.04, (1.02, 1.06), 0.01, 7, 6) == (
        "faster", "CI [1.0200, 1.0600] above 1 and effect +4.00% >= 1.00%")
    assert stats.verdict(1.04, (1.02, 1.06), 0.01, 7, 6, p=0.5) == (
        "faster", "CI [1.0200, 1.0600] above 1 and effect +4.00% >= 1.00%")
    assert stats.verdict(1.04, (1.02, 1.06), 0.01, 7, 6, p=None, alpha=0.05) == (
        "inconclusive", "CI [1.0200, 1.0600] above 1 but signed-rank p undefined")

def test_bootstrap_is_scipy_percentile_with_the_seed():
    ratios = np.array([0.98, 0.97, 0.99, 0.985, 0.975, 0.99, 0.96, 0.995])
    res = scipy.stats.bootstrap((ratios,), np.median, n_resamples=10_000, method="percentile",
                                vectorized=True, **stats.rng_kwargs(3))
    assert stats.bootstrap_median_ci(ratios, seed=3) == (res.confidence_interval.low, res.confidence_interval.high)


def test_equal_ratios_and_single_pair_never_crash():
    same = stats.compare([2.0] * 7, [2.0] * 7)
    assert same.speedup == 1.0 and same.ci == (1.0, 1.0) and same.bca_ci is None
    assert same.wilcoxon_p == 1.0 and same.verdict == "inconclusive"
    one = stats.compare([1.0], [0.5])
    assert one.speedup == 2.0 and one.ci is None and one.bca_ci is None
    assert one.verdict == "inconclusive" and "undefined" in one.verdict_reason
    two = stats.compare([1.0, 1.0], [0.5, 0.5])
    assert two.ci == (2.0, 2.0) and two.distinct_resamples == 3


def test_wilcoxon_exact_and_tied_cases():
    r = [1.1, 0.95, 1.2, 1.3, 1.05, 1.15, 1.01]
    p, method = stats.wilcoxon_p(r)
    assert method == "exact" and p == pytest.approx(scipy.stats.wilcoxon(np.log(r), method="exact").pvalue)
    # Three equal positive log-ratios: mid-ranks (2, 2, 2), W+ = 6; of the 8 sign patterns only
    # W+ = 0 and W+ = 6 are as far from the centre 3, so p = 2/8.
    p, method = stats.wilcoxon_p([1.1, 1.1, 1.1])
    assert p == 0.25 and method.startswith("exact conditional")
    assert stats.wilcoxon_p([1.0, 1.0]) == (1.0, "all ratios equal 1")


def test_verdict_rule():
    assert stats.verdict(1.05, (1.02, 1.08), 0.01)[0] == "faster"
    assert stats.verdict(0.95, (0.92, 0.98), 0.01)[0] == "slower"
    assert stats.verdict(1.05, (0.99, 1.08), 0.01)[0] == "inconclusive"
    assert stats.verdict(1.005, (1.001, 1.009), 0.01)[0] == "inconclusive"   # below the minimum effect
    assert stats.verdict(1.05, None, 0.01)[0] == "inconclusive"
    assert stats.verdict(1.05, (1.02, 1.08), 0.01, n_pairs=3, min_pairs=6)[0] == "inconclusive"


def test_verdict_reason_counts_pairs_in_their_number():
    assert stats.verdict(1.05, None, 0.01, n_pairs=1, min_pairs=6)[1].startswith("1 pair, fewer than the minimum 6")
    assert stats.verdict(1.05, None, 0.01, n_pairs=3, min_pairs=6)[1].startswith("3 pairs, fewer than the minimum 6")


def test_bad_inputs_name_the_values():
    with pytest.raises(ValueError, match="elapsed seconds must be > 0"):
        stats.pair_ratios([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="equal-length"):
        stats.pair_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="elapsed_s"):
        stats.tokens_per_s(4, 8, 0.0)
    assert stats.tokens_per_s(32, 128, 2.0) == 2048.0


def test_bootstrap_resamples_pairs_not_the_two_series_apart():
    """Baseline times that vary 64-fold, candidates a steady 1-4% faster: the bootstrap must resample
    whole pairs. Its CI is then a function of the seven ratios alone, by the hand-computed case above
    [2nd smallest, 2nd largest] ratio, so it lies inside [min, max] ratio; resampling baseline and candidate
    independently would mix a 1 s baseline with a 64 s candidate and give a wide interval instead."""
    ratios = [1.031, 1.012, 1.044, 1.020, 1.003, 1.037, 1.026]
    baseline = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    candidate = [b / r for b, r in zip(baseline, ratios)]
    x = sorted(ratios)
    for seed in range(4):
        res = stats.compare(baseline, candidate, n_resamples=10_000, seed=seed)
        assert res.ratios == pytest.approx(ratios, rel=1e-12)
        assert res.ci == pytest.approx((x[1], x[5]), rel=1e-12)
        assert x[0] <= res.bca_ci[0] <= res.bca_ci[1] <= x[-1]
        assert res.verdict == "faster"
    # the same ratios from a constant baseline give the same interval: only the pairs' ratios matter
    flat = stats.compare([2.0] * 7, [2.0 / r for r in ratios], n_resamples=10_000, seed=0)
    assert flat.ci == pytest.approx(stats.compare(baseline, candidate, n_resamples=10_000, seed=0).ci, rel=1e-12)


# ------------------------------------------------------------------- sessions, drift, power (issue 12)

def test_hierarchical_bootstrap_of_one_session_is_the_pair_bootstrap():
    """k = 1: resampling sessions always draws the one session, so the numbers are today's exactly."""
    ratios = [1.031, 0.987, 1.012, 1.044, 0.995, 1.020, 1.003, 0.97]
    for seed in (0, 3):
        assert stats.hierarchical_median_ci([ratios], 0.95, 10_000, seed) == stats.bootstrap_median_ci(ratios, 0.95, 10_000, seed)
    b, c = [r * 2.0 for r in ratios], [2.0] * len(ratios)
    assert stats.compare(b, c, sessions=[0] * len(ratios)).to_dict() == stats.compare(b, c).to_dict()
    assert stats.compare(b, c).to_dict()["ci_method"] == "percentile"


def test_hierarchical_bootstrap_matches_hand_computed_case():
    """Two sessions of two equal pairs each, A = (1, 1) and B = (3, 3). A resample draws AA, AB, BA or BB
    with probability 1/4 each; within a session every draw is its one value, so the pooled median is 1
    (AA), 2 (AB, BA) or 3 (BB): P = 1/4, 1/2, 1/4. The 95% interval is [1, 3]; the central 40% one
    (30th and 70th percentiles) is [2, 2]."""
    groups = [[1.0, 1.0], [3.0, 3.0]]
    medians = stats.hierarchical_medians(groups, 20_000, seed=1)
    freq = {v: float(np.mean(medians == v)) for v in (1.0, 2.0, 3.0)}
    assert sum(freq.values()) == 1.0
    assert freq[1.0] == pytest.approx(0.25, abs=0.01) and freq[2.0] == pytest.approx(0.5, abs=0.01)
    assert stats.hierarchical_median_ci(groups, 0.95, 20_000, seed=1) == (1.0, 3.0)
    assert stats.hierarchical_median_ci(groups, 0.40, 20_000, seed=1) == (2.0, 2.0)
    res = stats.compare([1.0, 1.0, 3.0, 3.0], [1.0] * 4, sessions=[0, 0, 1, 1], n_resamples=20_000, seed=1)
    assert res.ci == (1.0, 3.0) and res.bca_ci is None and res.ci_method == stats.CI_HIERARCHICAL


def test_hierarchical_bootstrap_draws_within_each_session():
    """Sessions of unequal size: each drawn session contributes its own number of draws, from its own pairs.

    A = (1.0, 1.2, 1.4), B = (2.0). AA pools 6 draws of A: medians 1.0 .. 1.4 in steps of 0.1; BB pools
    (2.0, 2.0): 2.0; AB and BA pool 3 draws of A and 2.0: the mean of the 2nd and 3rd of 4, 1.1 .. 1.7.
    """
    groups = [[1.0, 1.2, 1.4], [2.0]]
    medians = stats.hierarchical_medians(groups, 5_000, seed=0)
    assert set(np.round(np.unique(medians), 9)) <= {1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 2.0}
    assert float(np.mean(medians == 2.0)) == pytest.approx(0.25, abs=0.02)
    assert stats.hierarchical_median_ci([[1.0, 1.0], [1.0]], 0.95, 1_000, 0) == (1.0, 1.0)
    with pytest.raises(ValueError, match="groups"):
        stats.hierarchical_medians([[1.0], []], 10, 0)


def test_session_spread_within_and_between():
    spread = stats.session_spread([[1.0, 1.2], [2.0, 2.4]])
    assert spread["session_medians"] == [1.1, 2.2] and spread["session_pairs"] == [2, 2]
    assert spread["between_sd"] == pytest.approx(np.std([1.1, 2.2], ddof=1))
    # pooled within: variances 0.02 and 0.08 with one degree of freedom each
    assert spread["within_sd"] == pytest.approx(math.sqrt((0.02 + 0.08) / 2))
    # unequal sessions: weights are degrees of freedom (2 and 1), not pairs (3 and 2)
    uneven = stats.session_spread([[1.0, 1.2, 1.4], [2.0, 2.4]])
    assert uneven["within_sd"] == pytest.approx(math.sqrt((2 * 0.04 + 1 * 0.08) / 3))
    one = stats.session_spread([[1.0]])
    assert one["between_sd"] is None and one["within_sd"] is None


def test_trend_test_flags_a_drift_and_not_noise():
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.01, 20)
    drift = stats.trend_test(1.0 + 0.005 * np.arange(20) + noise, alpha=0.05)
    assert drift["flag"] and drift["statistic"] > 0.8 and drift["p"] < 1e-4
    flat = stats.trend_test(1.0 + noise, alpha=0.05)
    assert not flat["flag"] and flat["p"] > 0.05
    res = scipy.stats.spearmanr(np.arange(20), 1.0 + noise)
    assert (flat["statistic"], flat["p"]) == (float(res.statistic), float(res.pvalue))
    assert stats.trend_test([1.0, 1.0, 1.0, 1.0], 0.05)["p"] is None
    assert stats.trend_test([1.0, 2.0], 0.05)["statistic"] is None


@pytest.mark.parametrize("values, p", [
    ([1.0, 2.0, 3.0], 1 / 3),               # 2 of the 3! orders reach |rho| = 1; the t approximation says 0
    ([3.0, 2.0, 1.0], 1 / 3),
    ([1.0, 2.0, 3.0, 4.0], 1 / 12),
    ([1.0, 3.0, 2.0], 1.0),                 # |rho| 0.5: every order reaches it
    (list(range(7)), 2 / 5040),
    ([1.0, 1.1, 0.9, 1.2, 1.3, 1.25, 1.4], 120 / 5040),   # rho 0.857: 60 orders at least that far from 0 a side
    ([1.0, 1.0, 2.0, 2.0, 3.0], 8 / 120),   # ties at their average rank
])
def test_trend_p_is_exact_for_few_values(values, p):
    """Up to 8 values the p counts every order of the values (the t approximation gives 3 or 4 in order p = 0 and
    so a DRIFT flag at any alpha); the count is checked against a plain enumeration here."""
    got = stats.trend_test(values, alpha=0.05)
    assert got["p"] == pytest.approx(p, rel=1e-12)
    assert got["statistic"] == pytest.approx(float(scipy.stats.spearmanr(np.arange(len(values)), values).statistic))
    ranks = scipy.stats.rankdata(values)
    observed = abs(np.corrcoef(np.arange(len(values)), ranks)[0, 1])
    orders = list(itertools.permutations(ranks))
    hits = sum(abs(np.corrcoef(np.arange(len(values)), o)[0, 1]) >= observed - 1e-9 for o in orders)
    assert got["p"] == pytest.approx(hits / len(orders), rel=1e-12)
    assert not stats.trend_test([1.0, 2.0, 3.0], alpha=0.05)["flag"]


def test_trend_p_beyond_eight_values_is_the_t_approximation():
    x = [1.0, 1.3, 1.1, 1.2, 1.5, 1.4, 1.6, 1.45, 1.7]
    res = scipy.stats.spearmanr(np.arange(9), x)
    assert stats.trend_test(x, 0.05)["p"] == float(res.pvalue)
    with pytest.raises(ValueError, match="an exact Spearman p takes 2 to 8 values, got 9"):
        stats.spearman_exact_p(x)


def test_the_exact_trend_bound_is_the_contracts():
    assert stats.TREND_EXACT_UP_TO == FORMAT["documents"]["summary"]["trend_exact_up_to"]


def test_order_test_flags_an_order_effect_and_not_noise():
    rng = np.random.default_rng(1)
    firsts = ["baseline", "candidate"] * 8
    with_effect = [1.05 + rng.normal(0, 0.005) if f == "baseline" else 0.95 + rng.normal(0, 0.005) for f in firsts]
    hit = stats.order_test(with_effect, firsts, alpha=0.05)
    assert hit["flag"] and hit["p"] < 0.001 and (hit["n_baseline_first"], hit["n_candidate_first"]) == (8, 8)
    assert hit["statistic"] == 64.0   # every baseline-first ratio above every candidate-first one: U = 8 * 8
    miss = stats.order_test(1.0 + rng.normal(0, 0.01, 16), firsts, alpha=0.05)
    assert not miss["flag"] and miss["p"] > 0.05
    assert stats.order_test([1.0, 1.1], ["baseline", "baseline"], 0.05)["p"] is None
    with pytest.raises(ValueError, match="firsts"):
        stats.order_test([1.0], ["sideways"], 0.05)



@pytest.mark.parametrize("n_pairs, smallest_p, can_flag", [(6, 2 / 20, False), (7, 2 / 35, False), (8, 2 / 70, True)])
def test_the_order_test_of_one_session_of_7_pairs_can_never_flag_at_0_05(n_pairs, smallest_p, can_flag):
    # the most extreme split (every baseline-first ratio above every candidate-first one), balanced_first's counts
    firsts = sorted(stats.balanced_first(n_pairs, 0))
    ratios = [1.1 + 0.01 * i if f == "baseline" else 0.9 + 0.01 * i for i, f in enumerate(firsts)]
    most = stats.order_test(ratios, firsts, alpha=0.05)
    assert most["p"] == pytest.approx(smallest_p) and most["flag"] is can_flag

def test_creep_test_flags_only_a_rising_peak():
    rising = stats.creep_test([100 + 10 * i for i in range(8)], 0.05)
    assert rising["flag"] and rising["first"] == 100 and rising["last"] == 170
    assert not stats.creep_test([170 - 10 * i for i in range(8)], 0.05)["flag"]   # falling: not creep
    cpu = stats.creep_test([None] * 6, 0.05)
    assert cpu["p"] is None and not cpu["flag"] and cpu["n"] == 0


def test_detectable_effect_is_the_paired_normal_formula():
    """(z_0.975 + z_0.8) * sigma / sqrt(n): 1.959964 + 0.841621 = 2.801585; sigma 0.02, n 14 -> 0.014975."""
    de = stats.detectable_effect(0.02, 14, alpha=0.05, power=0.8)
    assert de["mde_log_ratio"] == pytest.approx(2.801585 * 0.02 / math.sqrt(14), rel=1e-6)
    assert de["mde_relative"] == pytest.approx(math.expm1(de["mde_log_ratio"]))
    assert stats.detectable_effect(0.02, 56, 0.05, 0.8)["mde_log_ratio"] == pytest.approx(de["mde_log_ratio"] / 2)
    assert stats.detectable_effect(None, 14, 0.05, 0.8)["mde_relative"] is None
    with pytest.raises(ValueError, match="n_pairs"):
        stats.detectable_effect(0.02, 0, 0.05, 0.8)
    assert stats.log_ratio_sd([1.0, math.e]) == pytest.approx(math.sqrt(0.5))


@pytest.mark.parametrize("call, named", [
    (lambda: stats.wilcoxon_p([float("nan"), 1.0]), "ratios must be a 1-D series of finite ratios > 0"),
    (lambda: stats.wilcoxon_p([1.1, -1.0]), "ratios must be a 1-D series of finite ratios > 0"),
    (lambda: stats.wilcoxon_p([]), "ratios is empty"),
    (lambda: stats.log_ratio_sd([-1.0, 1.0]), "ratios must be a 1-D series of finite ratios > 0"),
    (lambda: stats.detectable_effect(-0.1, 5, 0.05, 0.8), "sigma must be a finite SD >= 0 or None, got -0.1"),
    (lambda: stats.restart_of(0, 0), "pairs_per_session >= 1, got 0 and 0"),
    (lambda: stats.trend_test([1.0, 2.0, 3.0], alpha=2.0), r"alpha must be in \(0, 1\), got 2.0"),
    (lambda: stats.trend_test([1.0, float("nan"), 2.0, 3.0], 0.05), r"values must be numbers, got a NaN in \[1.0, nan"),
    (lambda: stats.trend_test([float("nan")] * 9, 0.05), "values must be numbers, got a NaN"),
    (lambda: stats.creep_test([None, 1.0, float("nan"), 2.0], 0.05), "values must be numbers, got a NaN"),
    (lambda: stats.order_test([1.0], ["baseline"], alpha=0.0), r"alpha must be in \(0, 1\), got 0.0"),
    (lambda: stats.balanced_first(3, -1), "seed must be a non-negative integer or a sequence of them, got -1"),
    (lambda: stats.balanced_first(3, [1, -2]), r"seed must be .*, got \[1, -2\]"),
    (lambda: stats.balanced_first(3, 0.5), r"seed must be .*, got 0.5"),
    (lambda: stats.balanced_first(3, None), r"seed must be .*, got None"),
])
def test_bad_input_is_a_value_error_naming_it_not_a_number(call, named):
    """Each of these once returned a figure (a 'significant' p from a NaN, a negative effect, a flag at alpha 2)
    or failed deep inside numpy."""
    with pytest.raises(ValueError, match=named):
        call()


def test_a_numpy_integer_seed_is_a_seed():
    assert stats.balanced_first(5, np.int64(3)) == stats.balanced_first(5, 3)


def test_the_auditors_exact_spearman_p_is_the_writers():
    """Two implementations of the exact trend p (the writer's scipy permutation test, the auditor's enumeration)
    agree on random values of 3-8, ties included; a format-11 bundle's p stays spearmanr's t approximation."""
    from loopbench.audit import evidence as audit_evidence
    from loopbench.harness import stats
    rng = np.random.default_rng(12)
    for case in range(60):
        n = 3 + case % 6
        values = [float(v) for v in (rng.integers(0, 4, n) if case % 3 == 0 else rng.normal(1, 0.05, n))]
        if len(set(values)) == 1:
            continue
        assert audit_evidence.exact_spearman_p(values) == stats.trend_test(values, 0.05)["p"], values
    in_order = [1.0, 2.0, 3.0]
    assert audit_evidence._spearman(in_order, 0.05, 12)["p"] == 1 / 3
    old = audit_evidence._spearman(in_order, 0.05, 11)
    assert old["p"] == float(scipy.stats.spearmanr(range(3), in_order).pvalue) and old["flag"]


def test_the_exact_trend_p_of_every_order_of_four_values_ties_and_rho_zero_included():
    """Every arrangement of up to 4 distinct levels over 4 positions (75 with ties or none): the writer's two-sided
    permutation_test p (2 x the smaller one-sided p, clipped at 1) is the auditor's P(|rho| >= |observed|) and a
    rational enumeration's, exactly; the null is symmetric (reversing an order negates rho) even with ties, so at
    rho = 0 both are 1."""
    import itertools
    from fractions import Fraction

    from loopbench.audit import evidence as audit_evidence
    cases = rho_zero = 0
    for levels in itertools.product(range(4), repeat=4):
        if sorted(set(levels)) != list(range(len(set(levels)))) or len(set(levels)) == 1:
            continue
        ranks = [Fraction(int(2 * r), 2) for r in scipy.stats.rankdata(levels)]
        centre = Fraction(5, 2)
        num = lambda order: sum((i - Fraction(3, 2)) * (r - centre) for i, r in enumerate(order))   # noqa: E731
        want = Fraction(sum(abs(num(o)) >= abs(num(ranks)) for o in itertools.permutations(ranks)), 24)
        values = [float(v) for v in levels]
        assert stats.trend_test(values, 0.05)["p"] == audit_evidence.exact_spearman_p(values) == float(want), levels
        cases += 1
        rho_zero += num(ranks) == 0
    assert cases == 74 and rho_zero > 0
