"""harness/compare.py: the unpaired change between two bundles, its interval, and what makes them comparable."""
import copy
from pathlib import Path

import numpy as np

from loopbench.harness import compare

RESULTS = Path(__file__).resolve().parents[2] / "results"


def test_interval_of_a_clear_change_excludes_one_and_words_follow_pyperf():
    a = np.array([100.0, 101.0, 99.0, 100.5, 100.2])
    ci = compare.ratio_interval(a, a * 1.10, 0.95)
    assert ci[0] > 1.05 and ci[1] < 1.15
    assert compare.change_words(1.10, ci) == "1.1000x faster"
    assert compare.change_words(0.8, (0.7, 0.9)) == "1.2500x slower"
    assert compare.change_words(1.01, (0.99, 1.03)) == "not significant"
    assert compare.ratio_interval(a[:1], a, 0.95) is None
    assert compare.change_words(1.2, None).startswith("no interval")


def test_interval_is_seeded_and_follows_the_level():
    rng = np.random.default_rng(1)
    a, b = rng.normal(100, 3, 9), rng.normal(102, 3, 9)
    assert compare.ratio_interval(a, b, 0.95) == compare.ratio_interval(a, b, 0.95)
    wide, narrow = compare.ratio_interval(a, b, 0.99), compare.ratio_interval(a, b, 0.5)
    assert wide[0] < narrow[0] and wide[1] > narrow[1]


def test_differences_name_every_field_and_defaults_fill_keys_added_later():
    plan = compare.Bundle.load(RESULTS / "2026-12-01-ouro-1.4b-c16d2c0").plan
    assert compare.differences(plan, plan) == []
    other = copy.deepcopy(plan)
    other["config"]["model"]["dtype"] = "float16"
    other["checkpoint"]["sha256"] = "f" * 64
    other["config"]["exit"]["threshold"] = 0.7
    diffs = compare.differences(plan, other)
    assert [d.split(":")[0] for d in diffs] == ["config.model.dtype", "checkpoint.sha256", "config.exit.threshold"]
    old = copy.deepcopy(plan)
    del old["config"]["workload"]["prompt_lens"]       # older bundles lack keys added since, at their default
    assert compare.differences(plan, old) == []


def test_committed_gpu_bundles_compare_per_point_and_arm():
    a, b = (compare.Bundle.load(RESULTS / n) for n in ("2026-11-30-ouro-1.4b-nogit", "2026-12-01-ouro-1.4b-c16d2c0"))
    text, comparable = compare.compare_text(a, b)
    assert comparable
    rows = compare.compare_rows(a, b, 0.95)
    assert {(r["point"], r["arm"]) for r in rows} == {(p, arm) for p in ("B16C32", "B32C64")
                                                       for arm in ("native", "alias", "alias_prefix")}
    assert all(r["ci"][0] <= r["ratio"] <= r["ci"][1] for r in rows)
    assert all(r["runs_a"] >= 7 and r["runs_b"] >= 7 for r in rows) and "| 16 / 32 |" in text


def test_an_arm_whose_config_differs_is_not_compared():
    a = compare.Bundle.load(RESULTS / "2026-12-01-ouro-1.4b-c16d2c0")
    plan = copy.deepcopy(a.plan)
    plan["config"]["arms"]["alias"]["tile_size"] = 64
    b = compare.Bundle(a.path, plan, a.summary, a.arms)
    rows = {r["arm"]: r for r in compare.compare_rows(a, b, 0.95)}
    assert rows["alias"]["ratio"] is None and "arms.alias.tile_size: 32 vs 64" in rows["alias"]["words"]
    assert rows["native"]["ratio"] == 1.0
