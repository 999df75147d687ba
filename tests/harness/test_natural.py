"""The natural-schedule track's pure parts (harness/natural.py): first divergences on constructed traced
runs, their near-tie classification, the declared equivalence rule, the floor, the config rules; and
the auditor's independent derivation (audit/check_natural.py) agreeing with the harness on them."""
import copy

import pytest

from loopbench.audit import check_natural
from loopbench.harness import conf, natural

EX = {"policy": "ouro_delayed", "threshold": 0.5, "min_loops": 2, "max_loops": 4}
NAT = {"gate_epsilon": 0.01, "logit_epsilon": 0.05, "floor": None}


def _out(tokens, depths, survival, top2):
    return {"token_ids": tokens, "exit_depths": depths, "survival": survival, "top2": top2}


# request of 3 tokens: prefill token (no gate), then two decode tokens; at token 1 the exit test
# (loop >= 2 and 1 - S_r >= 0.5) first holds at loop 2 with 1 - S_2 = 0.501, so ouro_delayed exits at 3
BASE = _out([7, 8, 9], [4, 3, 3], [[], [0.9, 0.499, 0.3], [0.9, 0.4, 0.2]],
            [[3.0, 1.0], [2.0, 1.5], [4.0, 0.0]])


def _near_exit_flip():
    """The candidate's 1 - S_2 = 0.499 misses the threshold by 0.001: it exits one loop later."""
    cand = copy.deepcopy(BASE)
    cand["exit_depths"][1] = 4
    cand["survival"][1] = [0.9, 0.501, 0.45, 0.2]
    cand["token_ids"][2] = 5                    # later tokens may follow from the different depth
    cand["top2"][2] = [4.0, 3.99]
    return cand


def test_exit_divergence_at_a_near_tie_gate_is_a_near_tie():
    d = natural.first_divergence(BASE, _near_exit_flip(), EX, NAT)
    assert (d["position"], d["kind"], d["loop"]) == (1, "exit", 2)
    assert d["baseline_gate_margin"] == pytest.approx(0.001) and d["candidate_gate_margin"] == pytest.approx(0.001)
    assert d["token_position"] == 2 and d["baseline_logit_margin"] == 4.0
    assert d["candidate_logit_margin"] == pytest.approx(0.01)
    assert d["margin"] == pytest.approx(0.001) and d["epsilon"] == 0.01 and d["near_tie"]


def test_exit_divergence_far_from_the_threshold_is_not_a_near_tie():
    cand = _near_exit_flip()
    cand["survival"][1] = [0.9, 0.7, 0.45, 0.2]          # 1 - S_2 = 0.3: 0.2 below the threshold
    d = natural.first_divergence(BASE, cand, EX, NAT)
    assert d["loop"] == 2 and d["margin"] == pytest.approx(0.2) and not d["near_tie"]


def test_gate_tests_before_min_loops_do_not_count():
    base, cand = copy.deepcopy(BASE), _near_exit_flip()
    base["survival"][1][0] = 0.1      # 1 - S_1 = 0.9 >= 0.5, but loop 1 < min_loops 2: no decision
    assert natural.first_divergence(base, cand, EX, NAT)["loop"] == 2


def test_token_divergence_margin_is_the_larger_of_the_two_arms():
    cand = copy.deepcopy(BASE)
    cand["token_ids"][1] = 6
    cand["top2"][1] = [2.0, 1.97]                         # candidate's own margin 0.03 < 0.05 ...
    d = natural.first_divergence(BASE, cand, EX, NAT)
    assert (d["kind"], d["position"], d["token_position"], d["loop"]) == ("token", 1, 1, None)
    assert d["margin"] == pytest.approx(0.5) and not d["near_tie"]   # ... but the baseline's is 0.5
    cand_b = copy.deepcopy(BASE)
    cand_b["top2"][1] = [2.0, 1.97]
    base = copy.deepcopy(BASE)
    base["top2"][1] = [2.0, 1.99]
    cand_b["token_ids"][1] = 6
    d = natural.first_divergence(base, cand_b, EX, NAT)
    assert d["margin"] == pytest.approx(0.03) and d["epsilon"] == 0.05 and d["near_tie"]


def test_equal_runs_have_no_divergence():
    assert natural.first_divergence(BASE, copy.deepcopy(BASE), EX, NAT) is None


def _row(**kw):
    row = {"runs": 8, "runs_reproducing": 8, "divergent": 0, "near_ties": 0, "above_epsilon": 0}
    return {**row, **kw}


@pytest.mark.parametrize("row, floor, verdict, words", [
    (_row(), 0, "equivalent", "0 divergent requests <= the floor's 0"),
    (_row(divergent=2, near_ties=2), 3, "equivalent", "2 near-ties, none above epsilon"),
    (_row(divergent=2, near_ties=2), 1, "not_equivalent", "2 divergent requests > the floor's 1"),
    (_row(divergent=1, above_epsilon=1), 1, "not_equivalent", "1 divergences above epsilon"),
    (_row(runs_reproducing=7), 0, "inconclusive", "1 of 8 runs differ from their arm's traced run"),
])
def test_equivalence_rule(row, floor, verdict, words):
    for fn in (natural.verdict, check_natural._verdict):     # harness and auditor alike
        got, reason = fn(row, floor)
        assert got == verdict and words in reason, (fn, reason)


def _config(comps, floor=None):
    return {"comparisons": comps, "natural": {**NAT, "floor": floor}}


def test_floor_is_declared_else_the_baselines_aa_else_any_aa_else_none():
    aa_n = {"name": "aa_n", "baseline": "native", "candidate": "native", "track": "natural"}
    aa_a = {"name": "aa_a", "baseline": "alias", "candidate": "alias", "track": "natural"}
    comp = {"name": "n_vs_a", "baseline": "native", "candidate": "alias", "track": "natural"}
    replay_aa = {"name": "r", "baseline": "native", "candidate": "native", "track": "replay"}
    assert natural.floor_of(_config([comp, aa_a, aa_n]), comp) == "aa_n"
    assert natural.floor_of(_config([comp, aa_a]), comp) == "aa_a"
    assert natural.floor_of(_config([comp, replay_aa]), comp) is None
    assert natural.floor_of(_config([comp, aa_a, aa_n], floor="aa_a"), comp) == "aa_a"


def test_a_floor_that_is_not_a_natural_aa_is_refused_naming_it():
    cfg = conf.compose("cpu-natural", ["natural.floor=native_vs_alias_prefix_natural"])
    with pytest.raises(ValueError, match="natural.floor = 'native_vs_alias_prefix_natural' is not a natural A/A"):
        conf.validate(cfg)
    with pytest.raises(Exception, match="track"):
        conf.compose("cpu-natural", ["comparisons=[{baseline:native,candidate:native,track:natral}]"])


def test_cpu_natural_declares_its_rule_in_the_plan_entry():
    spec = conf.validate(conf.compose("cpu-natural"))
    entry = natural.plan_entry(spec.to_plain(), ["B3C5"])
    assert entry["comparisons"] == ["native_vs_alias_prefix_natural", "native_aa_natural"]
    assert entry["floors"] == {"native_vs_alias_prefix_natural": "native_aa_natural",
                               "native_aa_natural": "native_aa_natural"}
    assert "gate margin 0.01, top-2 logit margin 0.05" in entry["rule"]
    assert [t["file"] for t in entry["traces"]][:2] == ["natural/B3C5-native_vs_alias_prefix_natural-baseline.json",
                                                         "natural/B3C5-native_vs_alias_prefix_natural-candidate.json"]


@pytest.mark.parametrize("case", ["near", "far", "token", "length"])
def test_auditor_derives_the_same_divergence(case):
    cand = _near_exit_flip() if case in ("near", "far") else copy.deepcopy(BASE)
    if case == "far":
        cand["survival"][1] = [0.9, 0.9, 0.45, 0.2]
    elif case == "token":
        cand["token_ids"][2], cand["top2"][2] = 1, [4.0, 3.0]
    elif case == "length":
        for k in ("token_ids", "exit_depths", "survival", "top2"):
            cand[k] = cand[k][:2]
    assert check_natural.first_divergence(BASE, cand, EX, NAT) == natural.first_divergence(BASE, cand, EX, NAT)
