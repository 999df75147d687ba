"""The natural-schedule track (bundle format 5) end to end on the CPU and under the auditor: a run of the
`cpu-natural` preset (natural native vs alias+prefix and the A/A floor); a bundle whose traced run was
forged to diverge (one near-tie, one far from the threshold) and whose figures the harness re-derived;
every new figure of the tables, summary and report re-derived by the auditor, and changing one of them,
or the traced run it comes from, fails the audit naming it."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from loopbench.audit import contract
from loopbench.audit.auditor import audit
from loopbench.audit.context import MAX_PER_KIND
from loopbench.harness import conf, controller, evidence
from tests.audit.tamper import edit_json, edit_report, edit_table, failed, leaves, rewrite_manifest, set_leaf, tampered

pytestmark = pytest.mark.slow      # its natural-track bundles take about 20 s on 2 cores

NAT = ["name=nat", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=17", "workload.prompt_lens=null",
       "workload.output_len=6", "pairs=2", "executor.poll_s=0.1"]
COMP = "native_vs_alias_prefix_natural"


@pytest.fixture(scope="session")
def natural_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("natural")
    result = controller.run(conf.compose("cpu-natural", NAT + [f"results_dir={root / 'r'}", f"cache_dir={root / 'c'}"]))
    assert result.summary["status"] == "complete" and result.summary["checks"]["ok"], result.summary["checks"]
    return result.bundle


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _json(path: Path):
    return json.loads(path.read_text())


def _trace(bundle: Path, comp: str = COMP, side: str = "candidate") -> Path:
    return bundle / "natural" / f"B2C3-{comp}-{side}.json"


def _chunks(items: list, size: int = MAX_PER_KIND - 2) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _forge_divergences(bundle: Path) -> None:
    """The candidate's traced run of COMP made to diverge, then everything re-derived by the harness (as a
    forger with the harness would): request r0000 flips a token on a near-tie logit margin, request r0001
    exits later although its baseline's gate decided at some loop (candidate S_r = 1: far from a near-tie).
    The baseline's top-2 logits there are made a near-tie too (its tokens stay, so its runs still match)."""
    edit_json(_trace(bundle, side="baseline"), lambda d: d["outputs"]["r0000"]["top2"].__setitem__(2, [5.0, 4.995]))
    base = _json(_trace(bundle, side="baseline"))["outputs"]

    def forge(doc):
        r0 = doc["outputs"]["r0000"]
        r0["token_ids"][2] += 1
        r0["top2"][2] = [r0["top2"][2][0], r0["top2"][2][0] - 0.01]
        r1, b1 = doc["outputs"]["r0001"], base["r0001"]
        i = next(i for i in range(1, len(b1["exit_depths"])) if b1["exit_depths"][i] < 4)
        r1["exit_depths"][i] = b1["exit_depths"][i] + 1
        r1["survival"][i] = [1.0] * r1["exit_depths"][i]
    edit_json(_trace(bundle), forge)
    plan, summary, children, env = (_json(bundle / f"{n}.json") for n in ("plan", "summary", "children", "environment"))
    evidence.finalize(bundle, plan, summary["checks"], children, env)


@pytest.fixture(scope="session")
def forged_bundle(natural_bundle, tmp_path_factory) -> Path:
    bundle = _copy(natural_bundle, tmp_path_factory.mktemp("forged"))
    _forge_divergences(bundle)
    return bundle


def test_cpu_natural_runs_each_arm_on_its_own_exits_and_audits(natural_bundle):
    verdict = audit(natural_bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    plan, summary = _json(natural_bundle / "plan.json"), _json(natural_bundle / "summary.json")
    assert plan["natural"]["comparisons"] == [COMP, "native_aa_natural"]
    jobs = _json(natural_bundle / "jobs" / "reference-cpu0.json")
    assert len(jobs["spec"]["natural_traces"]) == 4          # per position of each natural comparison
    rows = {r["comparison"]: r for r in summary["natural"]["comparisons"]}
    for row in rows.values():    # fp32 CPU: native and alias+prefix compute the same, bitwise
        assert row["divergent"] == 0 and row["runs_reproducing"] == row["runs"] == 2 * 2 * 2, row
        assert row["verdict"] == "equivalent" and row["floor"] == "native_aa_natural"
        assert row["work_ratio"] == 1.0 and row["floor_divergent"] == 0
    domain = contract.layout_domains(plan, set())["optional"]
    traces = [p.relative_to(natural_bundle).as_posix() for p in (natural_bundle / "natural").iterdir()]
    assert sorted(traces) == sorted(t["file"] for t in plan["natural"]["traces"])
    assert all(contract.layout_pattern("natural/{trace}.json", domain).fullmatch(t) for t in traces)
    report = (natural_bundle / "report.md").read_text()
    assert "## Natural schedule" in report and "Equivalence rule (declared in plan.json before measuring)" in report


def test_forged_divergences_are_classified_and_reported(forged_bundle):
    verdict = audit(forged_bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    nat = _json(forged_bundle / "summary.json")["natural"]
    row = next(r for r in nat["comparisons"] if r["comparison"] == COMP)
    assert (row["token_divergent"], row["depth_divergent"], row["divergent"]) == (1, 1, 2)
    assert (row["near_ties"], row["above_epsilon"]) == (1, 1)
    assert row["verdict"] == "inconclusive" and row["runs_reproducing"] == row["runs"] // 2
    d0, d1 = nat["divergences"]
    assert (d0["request_id"], d0["kind"], d0["position"], d0["near_tie"]) == ("r0000", "token", 2, True)
    assert d0["candidate_logit_margin"] == pytest.approx(0.01)
    assert (d1["request_id"], d1["kind"], d1["near_tie"]) == ("r0001", "exit", False)
    assert d1["loop"] is not None and d1["candidate_gate_margin"] == pytest.approx(0.55)
    report = (forged_bundle / "report.md").read_text()
    assert "| r0000 | 2 | token |" in report and "near-tie" in report and "above epsilon |" in report


def test_a_changed_traced_run_is_named_by_the_figures_it_feeds(natural_bundle, tmp_path):
    bundle = _copy(natural_bundle, tmp_path)
    edit_json(_trace(bundle), lambda d: d["outputs"]["r0002"]["token_ids"].__setitem__(1, 0))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "natural.parquet: token_divergent of B2C3 native_vs_alias_prefix_natural is 0, the raw records give 1" \
        in text
    assert "summary.json: natural.comparisons[0].token_divergent is 0, the audit derives 1" in text
    assert "natural_divergences.parquet: has 0 rows, the raw records give 1" in text


def test_a_traced_run_that_breaks_its_contract_is_named(natural_bundle, tmp_path):
    bundle = _copy(natural_bundle, tmp_path)
    edit_json(_trace(bundle, side="baseline"), lambda d: d["outputs"]["r0001"]["survival"][2].append(0.5))
    rewrite_manifest(bundle)
    assert "natural: natural/B2C3-native_vs_alias_prefix_natural-baseline.json: request r0001: a token's survival " \
           "list does not have one S_r per loop it ran" in failed(bundle)
    _trace(bundle, side="baseline").unlink()
    rewrite_manifest(bundle)
    assert "natural: natural/B2C3-native_vs_alias_prefix_natural-baseline.json is missing or unreadable" in failed(bundle)


@pytest.mark.parametrize("table", contract.NATURAL_TABLES)
def test_every_cell_of_the_natural_tables_is_rederived(forged_bundle, tmp_path, table):
    bundle = _copy(forged_bundle, tmp_path)
    keys = contract.TABLE_KEYS[table]
    cols = [c for c in contract.declared_columns(table) if c not in keys]

    original = (bundle / "tables" / f"{table}.parquet").read_bytes()
    for chunk in _chunks(cols):     # the auditor lists up to MAX_PER_KIND discrepancies of one kind

        def forge(df):
            for col in chunk:
                df[col] = df[col].astype(object)
                df.at[0, col] = tampered(df.at[0, col]) if not isinstance(df.at[0, col], np.ndarray) \
                    else [float(v) + 1 for v in df.at[0, col]]
            return df
        edit_table(bundle, table, forge)
        rewrite_manifest(bundle)
        text = failed(bundle)
        for col in chunk:
            assert f"{table}.parquet: {col} of " in text, col
        (bundle / "tables" / f"{table}.parquet").write_bytes(original)


def test_every_natural_summary_figure_is_rederived(forged_bundle, tmp_path):
    bundle = _copy(forged_bundle, tmp_path)
    summary = _json(bundle / "summary.json")
    chosen = [(p, v) for p, v in leaves(summary) if p.startswith(("natural.comparisons[0].", "natural.divergences[1].",
                                                                    "natural.rule", "natural.gate_epsilon"))]
    assert len(chosen) > 40
    for chunk in _chunks(chosen):
        forged = json.loads(json.dumps(summary))
        for path, value in chunk:
            set_leaf(forged, path, "forged" if value is None else tampered(value))
        (bundle / "summary.json").write_text(json.dumps(forged, indent=1, sort_keys=True) + "\n")
        rewrite_manifest(bundle)
        text = failed(bundle)
        for path, _ in chunk:
            assert f"summary.json: {path} is " in text, path


def test_an_edited_natural_report_line_is_named(forged_bundle, tmp_path):
    bundle = _copy(forged_bundle, tmp_path)
    edit_report(bundle, lambda lines: [line.replace("| near-tie |", "| above epsilon |") for line in lines])
    rewrite_manifest(bundle)
    assert "(## Natural schedule) reads" in failed(bundle)


def test_a_natural_record_is_not_held_to_the_frozen_reference(forged_bundle, tmp_path):
    """A natural arm's measured run that differs from the frozen reference is no finding; its coverage is
    re-derived from its own exits (so a forged one is named)."""
    bundle = _copy(forged_bundle, tmp_path)
    rec_path = next(p for p in sorted((bundle / "raw" / "cpu0").glob("*.json")) if COMP in p.name)
    edit_json(rec_path, lambda r: r["coverage"].update(routed_reads=r["coverage"]["routed_reads"] + 1))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "coverage: record cpu0 seq" in text and "routed_reads" in text
    assert "tokens:" not in text and "exit_depths:" not in text


def test_a_natural_run_whose_settings_name_a_replayed_schedule_is_named(natural_bundle, tmp_path):
    """A natural comparison's run runs its own exits, so its engine names no schedule (format 9's
    ``schedule_sha256`` null); one that claims the frozen reference's is named, even with the report re-derived."""
    comparisons = _json(natural_bundle / "plan.json")["config"]["comparisons"]
    natural = {c["name"] for c in comparisons if c.get("track") == "natural"}
    records = sorted((natural_bundle / "raw").glob("*/*.json"))
    assert natural and all(_json(p)["engine_settings"]["schedule_sha256"] is None
                           for p in records if _json(p)["comparison"] in natural)
    bundle = _copy(natural_bundle, tmp_path)
    reference = _json(bundle / "plan.json")["points"][0]["reference"]["sha256"]
    for path in sorted((bundle / "raw").glob("*/*.json")):
        if _json(path)["comparison"] in natural:
            edit_json(path, lambda r: r["engine_settings"].update(schedule_sha256=reference))
    plan, summary, children, env = (_json(bundle / f"{n}.json") for n in ("plan", "summary", "children", "environment"))
    evidence.finalize(bundle, plan, summary["checks"], children, env)
    assert (f"engine_settings.schedule_sha256 is {reference}, where a natural comparison's run replays no schedule"
            in failed(bundle))
