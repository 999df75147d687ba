"""harness/compare.py: the unpaired change between two bundles, its interval, and what makes them comparable."""
import copy
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

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


def _bundle(name: str, tokens_per_s: float, pairs: int, **summary) -> compare.Bundle:
    """A small synthetic bundle of the committed GPU plan: ``pairs`` runs of native and alias at B16C32 around
    ``tokens_per_s``, and a complete summary with ``pairs`` pairs per comparison unless ``summary`` says otherwise."""
    plan = compare.Bundle.load(RESULTS / "2026-12-01-ouro-1.4b-c16d2c0").plan
    runs = tokens_per_s * (1 + 0.001 * np.arange(pairs))
    arms = pd.DataFrame([{"point": "B16C32", "arm": arm, "tokens_per_s": t}
                         for arm in ("native", "alias") for t in runs])
    return compare.Bundle(Path(name), plan, {
        "status": "complete", "incomplete_reasons": [], "verdicts_published": True, "verdicts_barred_by": None,
        "verdict_rule": {"min_pairs": 6}, "results": [{"stats": {"n_pairs": pairs}}], **summary}, arms)


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| 16 / 32 |")]


def test_two_complete_bundles_of_enough_pairs_give_verdicts_and_no_warning():
    text, comparable = compare.compare_text(_bundle("a", 100.0, 7), _bundle("b", 120.0, 7))
    assert comparable and "warning" not in text
    assert [r.split(" | ")[-1] for r in _table_rows(text)] == ["1.2000x faster |"] * 2
    assert compare.withheld(_bundle("a", 100.0, 6)) == []     # the minimum itself is enough, as in stats.verdict


def test_an_incomplete_bundle_is_named_before_the_table_and_its_rows_are_withheld():
    reasons = [{"code": "stopped", "by": "SIGINT"}, {"code": "arms_missing", "recorded": 10, "planned": 28}]
    b = _bundle("b", 120.0, 7, status="incomplete", incomplete_reasons=reasons, verdicts_published=False,
                verdicts_barred_by="run incomplete")
    text, comparable = compare.compare_text(_bundle("a", 100.0, 7), b)
    lines = text.splitlines()
    warning = ("warning: B is incomplete (the controller received SIGINT and stopped its children; 10 of 28 planned "
               "arms recorded); its rows read withheld, not faster or slower")
    assert comparable and warning in lines and lines.index(warning) < lines.index(_table_rows(text)[0])
    assert [line for line in lines if line.startswith("warning")] == [warning]
    rows = _table_rows(text)      # the change and its interval are still shown; the words are not a verdict
    assert len(rows) == 2 and all(r.endswith("| +20.00% [+19.64%, +20.36%] | withheld: B incomplete |")
                                  for r in rows), rows


def test_a_format_1_incomplete_reason_is_a_sentence_and_checks_failed_is_named():
    old = _bundle("a", 100.0, 7, status="incomplete", incomplete_reasons=["the child died"])
    assert compare.withheld(old) == [("incomplete", "is incomplete (the child died)")]
    failed = _bundle("b", 100.0, 7, verdicts_published=False, verdicts_barred_by="checks failed")
    assert compare.withheld(failed) == [("verdicts barred (checks failed)", "has its verdicts barred (checks failed)")]


def test_a_bundle_with_fewer_pairs_than_its_minimum_is_named_and_its_rows_are_withheld():
    a = _bundle("a", 100.0, 2)
    two = a.arms["tokens_per_s"].to_numpy()[:2]       # two runs a side: the bootstrap interval alone says "faster"
    assert compare.change_words(1.2, compare.ratio_interval(two, 1.2 * two, 0.95)) == "1.2000x faster"
    text, _ = compare.compare_text(a, _bundle("b", 120.0, 7))
    assert ("warning: A has 2 pairs in its smallest comparison, fewer than its verdict rule's minimum of 6 "
            "(verdict.min_pairs); its rows read withheld, not faster or slower") in text.splitlines()
    assert all(r.endswith("| withheld: A 2 pairs < min 6 |") for r in _table_rows(text)), text
    both = compare.compare_rows(_bundle("a", 100.0, 3, status="incomplete", incomplete_reasons=[]), a, 0.95)
    assert {r["words"] for r in both} == {"withheld: A incomplete; A 3 pairs < min 6; B 2 pairs < min 6"}
    assert compare.withheld(_bundle("c", 100.0, 1))[0][0] == "1 pair < min 6"    # once "1 pairs"


def test_the_line_after_the_table_counts_the_intervals_and_says_they_are_uncorrected():
    a = compare.Bundle.load(RESULTS / "2026-12-01-ouro-1.4b-c16d2c0")
    text, _ = compare.compare_text(compare.Bundle.load(RESULTS / "2026-11-30-ouro-1.4b-nogit"), a)
    lines = text.splitlines()
    last_row = max(i for i, line in enumerate(lines) if line.startswith("| ") and "---" not in line)
    assert lines[last_row + 1] == ""
    assert lines[last_row + 2] == ("6 intervals shown, each a 95% interval on its own with no multiplicity correction: "
                                   "with no real change anywhere, the expected number of them that exclude no change "
                                   "(0%) by chance alone is 0.3 "
                                   "(--confidence 0.9917 makes them a Bonferroni family at 95%)")
    assert compare.multiplicity_note(1, 0.9) == "1 interval shown, a 90% interval"
    assert "20 intervals shown, each a 90% interval" in compare.multiplicity_note(20, 0.9)
    assert "the expected number of them that exclude no change (0%) by chance alone is 2.0 " in \
        compare.multiplicity_note(20, 0.9)


def test_a_bundle_with_no_measured_arm_leaves_nothing_to_compare(tmp_path, capsys):
    """An empty table read as a comparison (exit 0): now one line says there is nothing to compare, exit 1."""
    from loopbench.harness import cli

    full = RESULTS / "2026-12-01-cpu-smoke-0b0b425c"
    empty = tmp_path / "empty"
    shutil.copytree(full, empty)
    arms = pd.read_parquet(empty / "tables" / "arms.parquet")
    arms.iloc[:0].to_parquet(empty / "tables" / "arms.parquet")
    assert cli.main(["compare", str(full), str(empty)]) == 1
    out = capsys.readouterr().out
    assert f"nothing to compare: no point and arm has measured runs in both bundles (A {len(arms)} measured runs, B 0 " \
           "measured runs)" in out, out
    assert "| B / C |" not in out


def test_the_interval_takes_a_seed_on_every_scipy_the_project_allows(monkeypatch):
    # pyproject allows scipy >= 1.11; scipy.stats.bootstrap takes ``rng`` only from 1.15, ``random_state`` before
    real = compare.sps.bootstrap

    def bootstrap_before_1_15(data, statistic, *, n_resamples=9999, confidence_level=0.95, method="BCa",
                              paired=False, vectorized=None, random_state=None):
        return real(data, statistic, n_resamples=n_resamples, confidence_level=confidence_level, method=method,
                    paired=paired, vectorized=vectorized, rng=random_state)

    a = np.array([100.0, 101.0, 99.0, 100.5, 100.2])
    want = compare.ratio_interval(a, a * 1.10, 0.95, seed=4)
    monkeypatch.setattr(compare.sps, "bootstrap", bootstrap_before_1_15)
    assert compare.ratio_interval(a, a * 1.10, 0.95, seed=4) == want


@pytest.mark.parametrize("shown, level", [(3, 0.95), (6, 0.95), (7, 0.9), (100, 0.999), (2, 0.5)])
def test_the_bonferroni_level_suggested_is_rounded_up_so_the_family_reaches_its_level(shown, level):
    note = compare.multiplicity_note(shown, level)
    suggested = float(note.split("--confidence ")[1].split(" ")[0])
    assert suggested < 1
    # k intervals each at c cover together with at least 1 - k (1 - c): the suggestion must reach the family level
    assert 1 - shown * (1 - suggested) >= level - 1e-12, note
    assert suggested - (1 - (1 - level) / shown) < 1e-4, note
