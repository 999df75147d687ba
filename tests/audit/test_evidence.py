"""Evidence beyond one session (bundle format 3): the `cpu-evidence` preset end to end (2 independent
sessions per device, the drift and order tests, the plan's detectable effect), and every new figure
re-derived by the auditor: changing any one of them, or the raw input it comes from, fails the audit
naming it."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import scipy.stats

from loopbench.audit.auditor import audit
from loopbench.harness import conf, controller, evidence
from tests.audit.tamper import (REPO, edit_json, edit_report, every_leaf_named, failed, numpy_draws, passes_as_version,
                                rewrite_manifest, strip_version_12)

pytestmark = pytest.mark.slow      # its bundles take about 2 min together on 2 cores


@pytest.fixture(scope="session")
def evidence_run(tmp_path_factory):
    """`python -m loopbench.harness.bench --config-name cpu-evidence`, as CI runs it: (bundle, stdout)."""
    root = tmp_path_factory.mktemp("evidence")
    proc = subprocess.run([sys.executable, "-m", "loopbench.harness.bench", "--config-name", "cpu-evidence",
                           f"results_dir={root / 'r'}", f"cache_dir={root / 'c'}", f"hydra.run.dir={root / 'h'}",
                           "executor.poll_s=0.1"], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (bundle,) = (root / "r").iterdir()
    return bundle, proc.stdout


@pytest.fixture
def ebundle(evidence_run, tmp_path) -> Path:
    copy = tmp_path / evidence_run[0].name
    shutil.copytree(evidence_run[0], copy)
    return copy


@pytest.fixture
def older_ebundle(tmp_path_factory) -> Path:
    """A `cpu-evidence` bundle whose pair orders and prompts were drawn as a format-14 writer drew them (numpy's
    Generator, tamper.numpy_draws), run in this process so that the draws can be patched: for a test that claims an
    older format."""
    root = tmp_path_factory.mktemp("evidence-numpy-draws")
    cfg = conf.compose("cpu-evidence", [f"results_dir={root / 'r'}", f"cache_dir={root / 'c'}", "executor.poll_s=0.1"])
    with numpy_draws():
        result = controller.run(cfg)
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    return result.bundle


def _json(path: Path):
    return json.loads(path.read_text())


def test_two_sessions_per_device_each_its_own_process_and_balanced_pairs(evidence_run):
    bundle, stdout = evidence_run
    assert "audit PASS" in stdout and _json(bundle / "audit.json")["status"] == "pass"
    children = _json(bundle / "children.json")
    assert [(c["session"], c["state"]) for c in children] == \
        [("reference", "completed"), ("cpu0", "completed"), ("cpu0.s1", "completed")]
    plan = _json(bundle / "plan.json")
    order = plan["order"]["cpu0"]
    for sid, restart in (("cpu0", 0), ("cpu0.s1", 1)):
        job = _json(bundle / "jobs" / f"session-{sid}.json")
        mine = [it for it in order if it["seq"] in set(job["seqs"])]
        assert {it["pair"] // plan["config"]["pairs"] for it in mine} == {restart}
        for comp in plan["config"]["comparisons"]:   # each session balances its own pairs: 2 + 2 of 4
            firsts = [it["position"] for it in mine if it["comparison"] == comp["name"] and it["slot"] == 0]
            assert sorted(firsts) == ["baseline"] * 2 + ["candidate"] * 2
    summary = _json(bundle / "summary.json")
    assert summary["evidence_rule"] == {"sessions": 2, "pairs_per_session": 4, "alpha": 0.05,
                                        "ci_method": "hierarchical percentile (sessions, then pairs)"}
    for res in summary["results"]:
        ev = res["evidence"]
        assert ev["sessions"] == [0, 1] and ev["session_pairs"] == [4, 4] and res["stats"]["bca_ci"] is None
        assert ev["trend"]["n"] == 8 and ev["order"]["n_baseline_first"] == ev["order"]["n_candidate_first"] == 4
        assert ev["trend"]["p"] is not None and ev["order"]["p"] is not None
    de = plan["detectable_effect"]
    assert (de["n_pairs"], de["noise"]["source"], de["noise"]["sigma_log_ratio"]) == (8, "declared", 0.05)


def test_report_shows_sessions_drift_and_the_detectable_effect(evidence_run):
    text = (evidence_run[0] / "report.md").read_text()
    for line in ("## Sessions", "## Drift and order", "Each device ran 2 independent sessions, one after another",
                 "n = 8 pairs per comparison and device, alpha 0.05, power 80%, noise sigma 0.05 (declared): +5.08% speedup",
                 "| Device | B / C | comparison | sessions | median ratio per session | between-session SD |",
                 "| Device | B / C | comparison | trend rho | trend p | order U | order p |",
                 "| Device | runs with memory | first peak MiB | last peak MiB | trend rho | trend p | flag |",
                 "| CPU | 0 | n/a | n/a | n/a | n/a | none |", "hierarchical percentile (sessions, then pairs) bootstrap"):
        assert line in text, line
    assert text.index("## Statistics") < text.index("## Sessions") < text.index("## Drift and order") < text.index("## Checks")


NEW = ("evidence", "memory_creep", "evidence_rule", "stats.ci", "ci_method")


def test_every_new_summary_figure_is_rederived(ebundle):
    """Each leaf of what format 3 added to summary.json (and the hierarchical CI) changed in turn."""
    named = every_leaf_named(ebundle, "summary.json", lambda leaf: f"summary.json: {leaf} ",
                             lambda p: any(k in p for k in NEW))
    for want in ("results[0].evidence.session_medians[1]", "results[1].evidence.between_sd", "results[0].evidence.within_sd",
                 "results[0].evidence.trend.p", "results[1].evidence.order.statistic", "results[0].evidence.order.flag",
                 "memory_creep[0].n", "evidence_rule.sessions", "results[0].stats.ci[0]", "results[0].stats.ci_method"):
        assert want in named


def _mde_message(leaf: str) -> str:
    key = leaf.removeprefix("detectable_effect.")
    return "detectable_effect.noise.source is" if key == "noise.source" else f"detectable_effect.{key.split('.')[0]} is"


def test_every_detectable_effect_field_is_rederived(ebundle):
    skip = ("method", "noise.bundle", "noise.summary_sha256", "noise.ratios")
    named = every_leaf_named(ebundle, "plan.json", _mde_message,
                             lambda p: p.startswith("detectable_effect.") and p.removeprefix("detectable_effect.") not in skip)
    assert {p.removeprefix("detectable_effect.") for p in named} >= \
        {"mde_relative", "mde_log_ratio", "n_pairs", "noise.sigma_log_ratio", "alpha", "noise.source"}


def test_noise_ratios_of_a_noise_bundle_are_the_raw_input_of_the_mde(evidence_run, tmp_path):
    """A plan whose noise comes from a bundle's A/A pairs: the auditor recomputes sigma and the MDE from
    the ratios the plan carries, and checks them against that bundle's summary while it is there."""
    from loopbench.harness import conf, plan as plan_mod

    noise = evidence_run[0]
    spec = conf.validate(conf.compose("cpu-evidence", [f"evidence.noise_bundle={noise}", "evidence.noise_sigma=null"]))
    de = plan_mod.detectable_effect(spec)
    aa = [r for res in _json(noise / "summary.json")["results"] if res["baseline"] == res["candidate"]
          for r in res["stats"]["ratios"]]
    assert de["noise"]["ratios"] == aa and de["noise"]["source"] == "bundle" and de["mde_relative"] > 0
    from loopbench.audit import evidence as audit_evidence

    plan = {"config": spec.to_plain(), "detectable_effect": de}
    assert audit_evidence.expected_detectable_effect(plan) == de
    forged = json.loads(json.dumps(plan))
    forged["detectable_effect"]["noise"]["ratios"][0] *= 1.5
    assert audit_evidence.expected_detectable_effect(forged)["mde_relative"] != de["mde_relative"]
    assert audit_evidence._noise_source_problem(plan) is None
    forged["detectable_effect"]["noise"]["summary_sha256"] = "0" * 64
    assert "summary_sha256 is not that of" in audit_evidence._noise_source_problem(forged)
    with pytest.raises(ValueError, match="evidence.noise_bundle"):
        conf.validate(conf.compose("cpu-evidence", [f"evidence.noise_bundle={tmp_path}"]))


def _raw(bundle: Path, seq: int) -> Path:
    return next((bundle / "raw" / "cpu0").glob(f"{seq:05d}-*.json"))


def _spearman_rho(values: list[float]) -> float:
    return float(scipy.stats.spearmanr(range(len(values)), values).statistic)


def test_changed_raw_input_of_a_session_figure_is_named(ebundle):
    """The measured times of session 1's candidate runs scaled in their raw records alone: every pair ratio
    of session 1 (baseline_s / candidate_s) scales by one factor, so its median no longer matches what the
    summary claims, and neither does the Spearman trend over all pairs. The factor puts session 1's ratios
    above every other pair's or, when they already are, below them: the two rank orders differ by a block
    move of session 1 past session 0, whose rho differ, so at least one of them is not the claimed rho.
    (Doubling alone left the trend unchanged on a CI run whose session 1 ratios were already the highest.)"""
    plan, summary = _json(ebundle / "plan.json"), _json(ebundle / "summary.json")
    n = plan["config"]["pairs"]
    ratios = summary["results"][0]["stats"]["ratios"]
    s0, s1 = ratios[:n], ratios[n:2 * n]
    above, below = 2 * max(ratios) / min(s1), min(ratios) / (2 * max(s1))
    factor = above if _spearman_rho(s0 + [r * above for r in s1]) != _spearman_rho(ratios) else below
    assert _spearman_rho(s0 + [r * factor for r in s1]) != _spearman_rho(ratios)
    items = [it for it in plan["order"]["cpu0"] if it["pair"] // n == 1 and it["position"] == "candidate"]
    for item in items:
        edit_json(_raw(ebundle, item["seq"]), lambda r: (r["measured"].update(elapsed_s=r["measured"]["elapsed_s"] / factor),
                                                        r.update(tokens_per_s=r["tokens_per_s"] * factor)))
    rewrite_manifest(ebundle)
    text = failed(ebundle)
    assert "summary.json: results[0].evidence.session_medians[1] is" in text
    assert "summary.json: results[0].evidence.trend.statistic is" in text


def test_changed_peak_memory_is_named_by_the_creep_figure(ebundle):
    for seq in range(3):
        edit_json(_raw(ebundle, seq), lambda r: r["measured"]["memory"].update(peak_allocated_bytes=2**20 * (seq + 1)))
    rewrite_manifest(ebundle)
    assert "summary.json: memory_creep[0].n is 0, the audit derives 3" in failed(ebundle)


def test_session_that_measured_two_restarts_is_named(ebundle):
    plan = _json(ebundle / "plan.json")
    item = next(it for it in plan["order"]["cpu0"] if it["pair"] // plan["config"]["pairs"] == 1)
    edit_json(_raw(ebundle, item["seq"]), lambda r: r.update(session="cpu0"))
    rewrite_manifest(ebundle)
    assert "sessions: cpu0: session cpu0 measured pairs of restarts [0, 1]" in failed(ebundle)


@pytest.mark.parametrize("section, old, new", [
    ("## Sessions", "| 2 |", "| 3 |"),
    ("## Sessions", "noise sigma 0.05 (declared)", "noise sigma 0.01 (declared)"),
    ("## Drift and order", "| none |", "| DRIFT |"),
])
def test_edited_sessions_and_drift_lines_are_named(ebundle, section, old, new):
    def edit(lines):
        start = lines.index(section)
        i = next(j for j in range(start, len(lines)) if old in lines[j])
        lines[i] = lines[i].replace(old, new, 1)
        return lines
    edit_report(ebundle, edit)
    rewrite_manifest(ebundle)
    assert f"({section})" in failed(ebundle)


def test_order_of_a_later_restart_is_its_own_seeded_order(ebundle):
    """The plan's order of restart 1 swapped to restart 0's seeds: not the seeded balanced order."""
    def swap(p):
        n_items = len(p["order"]["cpu0"]) // 2
        first, second = p["order"]["cpu0"][:n_items], p["order"]["cpu0"][n_items:]
        for a, b in zip(first, second):
            b.update(position=a["position"], slot=a["slot"], arm=a["arm"])
    edit_json(ebundle / "plan.json", swap)
    rewrite_manifest(ebundle)
    assert "order: cpu0: plan.json's measurement order is not the seeded balanced order" in failed(ebundle)


def test_a_version_2_claim_with_sessions_is_a_downgrade(ebundle):
    edit_json(ebundle / "manifest.json", lambda m: m.update(format_version=2))
    assert "sessions: config sessions = 2: format version 2 has one session per device" in failed(ebundle)
    assert evidence.FORMAT_VERSION == 15



def test_a_format_12_bundle_worded_as_format_11_audits_as_format_11(older_ebundle):
    """Format 12 changed the Spearman p's and the drift sentence only: with the t approximation's p's and format 11's
    sentence the same bundle (8 pairs a comparison: exact p's; its orders numpy's, as format 11 drew them) is a
    format-11 bundle, and claiming 12 is named."""
    ebundle = older_ebundle
    summary = _json(ebundle / "summary.json")
    trends = [r["evidence"]["trend"] for r in summary["results"]]
    assert trends and all(t["p"] is not None and t["n"] == 8 for t in trends)
    assert "A Spearman p of up to 8 values is exact (every order of the values)" in (ebundle / "report.md").read_text()
    strip_version_12(ebundle)
    stripped = _json(ebundle / "summary.json")
    assert [r["evidence"]["trend"]["p"] for r in stripped["results"]] != [t["p"] for t in trends]
    assert "A Spearman p of up to 8 values" not in (ebundle / "report.md").read_text()
    passes_as_version(ebundle, 11)
    edit_json(ebundle / "manifest.json", lambda m: m.update(format_version=12))
    rewrite_manifest(ebundle)
    named = failed(ebundle)
    assert "report.md" in named and "summary.json" in named
