"""Telemetry during measured runs and graph coverage (bundle format 5), re-derived by the auditor.

No GPU here: the honest CPU bundle has no telemetry (its report says so and it audits PASS); the tests
that need telemetry give each raw record the readings a session would have taken through a scripted
fake NVML and republish the bundle with the harness. Changing any new figure, or the raw sample it
comes from, fails the audit naming it. The graph-coverage bar is shown on a bundle whose candidate arm
is forged to have replayed CUDA Graphs while its baseline ran eagerly.
"""
import json

import pytest

from loopbench.audit import check_graphs
from loopbench.audit.auditor import audit
from loopbench.harness import controller, evidence, graph_coverage, telemetry
from loopbench.harness.sampler import Sampler
from tests.audit.tamper import (edit_json, edit_report, edit_table, every_leaf_named, failed, raw, rebind_plan_lines,
                                rewrite_manifest)
from tests.harness.fake_nvml import FakeNVML


def _republish(bundle) -> dict:
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    evidence.unpublish(bundle)
    return controller.publish(bundle, plan, children, env).summary


def _telemetry_of(rec: dict, fake: FakeNVML, spacing_s: float) -> dict:
    """What measure_arm records through ``fake``: start and end readings around evenly spaced samples."""
    start = telemetry.sample(0)
    t0 = rec["wall_clock"]["measured_start_unix_s"]
    samples = [{**telemetry.fast_sample(fake, ("handle", 0)), "time_unix_s": t0 + spacing_s * i} for i in range(6)]
    return {"start": start, "end": telemetry.sample(0), "samples": samples,
            "sampler": {**Sampler(None, 20.0).record(), "samples": len(samples), "cpu_s": 0.0004, "active": True}}


def _add_telemetry(bundle, monkeypatch, spacing_s: float = 0.05) -> None:
    """Every record sampled by a fake NVML; seq 1 throttles (SW power cap) in one reading, seq 2 changes clock."""
    for path in sorted((bundle / "raw" / "cpu0").glob("*.json")):
        rec = json.loads(path.read_text())
        seq = rec["seq"]
        fake = FakeNVML(reasons=lambda k, s=seq: 0x4 if s == 1 and k == 3 else 0x1,
                        sm=lambda k, s=seq: 1755 if s == 2 and k >= 4 else 1980)
        monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
        rec["telemetry"] = _telemetry_of(rec, fake, spacing_s)
        path.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    _republish(bundle)


@pytest.fixture
def tbundle(bundle, monkeypatch):
    _add_telemetry(bundle, monkeypatch)
    return bundle


def test_cpu_bundle_has_no_telemetry_and_passes(bundle):
    assert audit(bundle)["status"] == "pass"
    text = (bundle / "report.md").read_text()
    assert "## Telemetry and energy\n\nNo telemetry: NVML was not available to the sessions" in text
    arms = __import__("pandas").read_parquet(bundle / "tables" / "arms.parquet")
    assert arms["energy_j"].isna().all() and arms["throttled"].isna().all()


def test_sampled_bundle_passes_and_reports_energy_and_flags(tbundle):
    verdict = audit(tbundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    arms = __import__("pandas").read_parquet(tbundle / "tables" / "arms.parquet").set_index("seq")
    rec = json.loads(raw(tbundle, 1).read_text())
    delta_j = (rec["telemetry"]["end"]["energy_mj"] - rec["telemetry"]["start"]["energy_mj"]) / 1000
    assert arms.loc[1, "energy_j"] == pytest.approx(delta_j)
    assert arms.loc[1, "joules_per_token"] == pytest.approx(delta_j / (rec["num_requests"] * rec["output_len"]))
    assert bool(arms.loc[1, "throttled"]) and not bool(arms.loc[0, "throttled"]) and bool(arms.loc[2, "clock_changed"])
    assert arms.loc[0, "sample_rate_hz"] == pytest.approx(20.0)
    text = (tbundle / "report.md").read_text()
    assert "| Device | point | arm | runs | samples per run | lowest rate Hz | mean power W | energy J | J / token |" in text
    assert "THROTTLE 1/" in text and "CLOCKS 1/" in text and "1755-1980" in text
    tele = __import__("pandas").read_parquet(tbundle / "tables" / "telemetry.parquet")
    assert sorted(set(tele["when"])) == ["during", "end", "start"] and len(tele) == len(arms) * 8


@pytest.mark.parametrize("column", ["energy_j", "joules_per_token", "mean_power_w", "throttled", "clock_changed",
                                    "min_sm_clock_mhz", "max_mem_clock_mhz", "throttle_reasons_seen",
                                    "telemetry_samples", "sample_rate_hz", "sampler_cpu_s", "eager_fraction"])
def test_changed_arm_figure_is_named(tbundle, column):
    def change(df):
        v = df.loc[0, column]
        df[column] = df[column].astype(object)
        df.loc[0, column] = (not v) if isinstance(v, (bool,)) or str(type(v)).endswith("bool_'>") else v * 1.5 + 1
        return df
    edit_table(tbundle, "arms", change)
    rewrite_manifest(tbundle)
    assert f"arms.parquet: {column} of" in failed(tbundle)


@pytest.mark.parametrize("edit, named", [
    (lambda t: t["samples"][2].update(power_w=90.0), ["telemetry.parquet: power_w of", "arms.parquet: mean_power_w of"]),
    (lambda t: t["end"].update(energy_mj=t["end"]["energy_mj"] + 777),
     ["arms.parquet: energy_j of", "arms.parquet: joules_per_token of", "telemetry.parquet: energy_mj of"]),
    (lambda t: t["samples"][0].update(throttle_reasons=0x40), ["arms.parquet: throttled of",
                                                               "arms.parquet: throttle_reasons_seen of"]),
    (lambda t: t["samples"][5].update(sm_clock_mhz=1500), ["arms.parquet: clock_changed of",
                                                           "arms.parquet: min_sm_clock_mhz of"]),
])
def test_changed_raw_sample_is_named(tbundle, edit, named):
    edit_json(raw(tbundle, 0), lambda r: edit(r["telemetry"]))
    rewrite_manifest(tbundle)
    text = failed(tbundle)
    for want in named:
        assert want in text, (want, text)


def test_a_sampler_slower_than_10_hz_is_named(bundle, monkeypatch):
    _add_telemetry(bundle, monkeypatch, spacing_s=0.25)   # 4 Hz, everything else consistent
    assert "telemetry: record cpu0 seq 0 (" in failed(bundle) and "below the contract's 10 Hz" in failed(bundle)


@pytest.mark.parametrize("old, new", [("THROTTLE 1/", "THROTTLE 0/"), ("CLOCKS 1/", "CLOCKS 2/")])
def test_edited_telemetry_line_is_named(tbundle, old, new):
    def edit(lines):
        start = lines.index("## Telemetry and energy")
        i = next(j for j in range(start, len(lines)) if old in lines[j])
        lines[i] = lines[i].replace(old, new, 1)
        return lines
    edit_report(tbundle, edit)
    rewrite_manifest(tbundle)
    assert "(## Telemetry and energy)" in failed(tbundle)


def test_no_telemetry_line_cannot_be_dropped(bundle):
    edit_report(bundle, lambda lines: [ln for ln in lines if not ln.startswith("No telemetry:")])
    rewrite_manifest(bundle)
    assert "No telemetry" in failed(bundle)


# ------------------------------------------------------------------------------------ graph coverage

def _run(cuda_graphs, graphs, rows_per_depth, prefill_rows) -> dict:
    return {"arm_config": {"cuda_graphs": cuda_graphs},
            "measured": {"graphs": graphs, "work": {"rows_per_depth": rows_per_depth, "prefill_rows": prefill_rows}}}


def test_eager_fraction_of_a_hand_computed_run():
    """Decode: 100 rows, 2 of 10 launches eager; prefill: 50 rows, 1 of 4 eager: (100*0.2 + 50*0.25) / 150."""
    g = {"captures": 0, "replays": 8, "fallbacks": 2, "prefill_captures": 0, "prefill_replays": 3, "prefill_fallbacks": 1}
    run = _run(True, g, [60, 40], 50)
    assert graph_coverage.record_eager_fraction(run) == pytest.approx(32.5 / 150) == check_graphs.eager_fraction(run)
    eager = _run(False, {}, [60, 40], 50)
    assert graph_coverage.record_eager_fraction(eager) == 1.0 == check_graphs.eager_fraction(eager)
    assert graph_coverage.record_eager_fraction(_run(True, g, [0, 0], 0)) is None
    cov = graph_coverage.result_coverage([(0.2, 0.2), (0.2, 0.25)], 0.001)
    assert cov["differs"] and cov["max_pair_gap"] == pytest.approx(0.05)
    assert not graph_coverage.result_coverage([(1.0, 1.0)], 0.001)["differs"]
    assert graph_coverage.result_coverage([(None, 0.5)], 0.001)["differs"]


def test_every_graph_coverage_figure_is_rederived(bundle):
    named = every_leaf_named(bundle, "summary.json", lambda leaf: f"summary.json: {leaf} ",
                             lambda p: "graph_coverage" in p)
    assert {"results[0].graph_coverage.differs", "results[1].graph_coverage.max_pair_gap",
            "results[0].graph_coverage.baseline_eager_fraction"} <= named


def _forge_graph_candidate(bundle) -> None:
    """The candidate arm alias_prefix as if it had run with CUDA Graphs, replaying every launch: its
    eager fraction 0 against native's 1 (eager), a coverage difference by construction. The reference job's arms
    and the session's plan line are forged with the plan (jobs/*.json and the log are held to it)."""
    def plan(p):
        p["config"]["arms"]["alias_prefix"]["cuda_graphs"] = True
        p["config_sha256"] = evidence.sha256_bytes(evidence.canonical_json(p["config"]).encode())
    edit_json(bundle / "plan.json", plan)
    edit_json(bundle / "jobs" / "reference-cpu0.json",
              lambda job: job["spec"]["arms"]["alias_prefix"].update(cuda_graphs=True))
    rebind_plan_lines(bundle)
    for path in (bundle / "raw" / "cpu0").glob("*.json"):
        def graphs(r):
            if r["arm"] == "alias_prefix":
                r["arm_config"]["cuda_graphs"] = True
                if r.get("engine_settings"):   # what the engine says it ran with agrees with the forged arm
                    r["engine_settings"]["cuda_graphs"] = True
                for phase in ("warmup", "measured"):
                    r[phase]["graphs"].update(replays=r[phase]["work"]["decode_steps"], prefill_replays=3)
        edit_json(path, graphs)
    _republish(bundle)


def test_a_comparison_whose_graph_coverage_differs_is_barred(bundle):
    _forge_graph_candidate(bundle)
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    summary = json.loads((bundle / "summary.json").read_text())
    first = summary["results"][0]
    assert first["comparison"] == "native_vs_alias_prefix" and first["verdict"] == "barred: graph coverage differs"
    assert first["graph_coverage"]["baseline_eager_fraction"] == 1.0 and first["graph_coverage"]["differs"]
    assert summary["results"][1]["verdict"] == "inconclusive"   # the A/A: both eager
    text = (bundle / "report.md").read_text()
    assert "| native_vs_alias_prefix | 1.0000 | 0.0000 | 1.0000 | BARRED |" in text
    assert "| barred: graph coverage differs |" in text
    edit_json(bundle / "summary.json", lambda s: s["results"][0].update(verdict="inconclusive"))
    rewrite_manifest(bundle)
    assert "summary.json: results[0].verdict is 'inconclusive'" in failed(bundle)
