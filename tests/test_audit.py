"""The independent auditor: passes an honest bundle, names every tampered token, timing and exit depth,
and never imports the harness."""
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from loopbench.audit.auditor import audit
from loopbench.harness import conf, controller, evidence

REPO = Path(__file__).resolve().parent.parent
MINI = ["name=mini", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=17", "workload.output_len=4",
        "pairs=2", "comparisons=[{baseline:native,candidate:alias_prefix},{baseline:native,candidate:native}]",
        "executor.poll_s=0.1"]


@pytest.fixture(scope="module")
def honest_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("audit")
    cfg = conf.compose("cpu-smoke", MINI + [f"results_dir={root / 'results'}", f"cache_dir={root / 'cache'}"])
    result = controller.run(cfg)
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    assert result.summary["checks"]["ok"], result.summary["checks"]["findings"]
    return result.bundle


@pytest.fixture
def bundle(honest_bundle, tmp_path) -> Path:
    copy = tmp_path / honest_bundle.name
    shutil.copytree(honest_bundle, copy)
    return copy


def _edit_table(bundle: Path, name: str, fn) -> None:
    df = pd.read_parquet(bundle / "tables" / f"{name}.parquet")
    evidence.write_table(bundle / "tables" / f"{name}.parquet", fn(df))


def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _raw(bundle: Path, seq: int) -> Path:
    return next((bundle / "raw" / "cpu0").glob(f"{seq:05d}-*.json"))


def _failed(bundle: Path) -> str:
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    return "\n".join(verdict["discrepancies"])


def test_honest_bundle_passes(bundle):
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"]["records"] == 8 and verdict["checked"]["results"] == 2
    manifest = json.loads((bundle / "manifest.json").read_text())["files"]
    for rel in ("plan.json", "environment.json", "prompts.json", "summary.json", "report.md", "pair_ratios.png",
                "children.json", "references/B2C3.schedule.json", *(f"tables/{t}.parquet" for t in evidence.TABLES)):
        assert rel in manifest


@pytest.mark.parametrize("rewrite_manifest", [False, True])
def test_changed_token_in_tokens_table_is_named(bundle, rewrite_manifest):
    def change(df):
        i = df.index[(df["seq"] == 3) & (df["phase"] == "measured") & (df["request_id"] == "r0001")
                     & (df["position"] == 2)][0]
        df.loc[i, "token_id"] = (df.loc[i, "token_id"] + 1) % 256
        return df
    _edit_table(bundle, "tokens", change)
    if rewrite_manifest:
        evidence.write_manifest(bundle)
    text = _failed(bundle)
    assert "token_id of cpu0 seq 3 measured request r0001 position 2" in text
    assert ("manifest: tables/tokens.parquet changed" in text) != rewrite_manifest


@pytest.mark.parametrize("rewrite_manifest", [False, True])
def test_changed_exit_depth_is_named(bundle, rewrite_manifest):
    def change(rec):
        d = rec["measured"]["outputs"]["r0002"]["exit_depths"]
        d[1] = 4 if d[1] != 4 else 3
    _edit_json(_raw(bundle, 5), change)
    if rewrite_manifest:
        evidence.write_manifest(bundle)
    text = _failed(bundle)
    assert "exit_depths: cpu0 seq 5" in text and "request 'r0002' position 1" in text
    assert "exit_depth of cpu0 seq 5 measured request r0002 position 1" in text
    assert ("manifest: raw/cpu0/" in text) != rewrite_manifest


@pytest.mark.parametrize("rewrite_manifest", [False, True])
def test_changed_timing_in_arms_table_is_named(bundle, rewrite_manifest):
    def change(df):
        df.loc[df["seq"] == 2, "elapsed_s"] *= 0.9
        return df
    _edit_table(bundle, "arms", change)
    if rewrite_manifest:
        evidence.write_manifest(bundle)
    text = _failed(bundle)
    assert "arms.parquet elapsed_s of cpu0 seq 2" in text
    assert ("manifest: tables/arms.parquet changed" in text) != rewrite_manifest


def test_changed_timing_in_raw_record_is_named(bundle):
    _edit_json(_raw(bundle, 6), lambda rec: rec["measured"].update(elapsed_s=rec["measured"]["elapsed_s"] * 1.5))
    evidence.write_manifest(bundle)
    text = _failed(bundle)
    assert "record cpu0 seq 6" in text and "tokens_per_s" in text
    assert "arms.parquet elapsed_s of cpu0 seq 6" in text


def test_changed_token_in_raw_record_and_table_is_caught_by_the_reference(bundle):
    """A forger who edits the raw record and the table alike still differs from the frozen reference."""
    def change_rec(rec):
        rec["warmup"]["outputs"]["r0000"]["token_ids"][3] = (rec["warmup"]["outputs"]["r0000"]["token_ids"][3] + 1) % 256
    _edit_json(_raw(bundle, 1), change_rec)
    _edit_table(bundle, "tokens", lambda df: df.assign(token_id=df["token_id"].where(
        ~((df["seq"] == 1) & (df["phase"] == "warmup") & (df["request_id"] == "r0000") & (df["position"] == 3)),
        (df["token_id"] + 1) % 256)))
    evidence.write_manifest(bundle)
    text = _failed(bundle)
    assert "tokens: cpu0 seq 1 B2C3" in text and "request 'r0000' position 3" in text
    assert "checks: summary says checks ok = True" in text


def test_changed_numbers_in_summary_and_report_are_named(bundle):
    _edit_json(bundle / "summary.json", lambda s: s["results"][0]["stats"].update(speedup=1.25))
    report = (bundle / "report.md").read_text().replace("| cpu | 2 / 3 |", "| cpu | 2 / 3 | ", 1)
    (bundle / "report.md").write_text(report)
    evidence.write_manifest(bundle)
    text = _failed(bundle)
    assert "speedup 1.25 != recomputed median" in text
    assert "report.md lacks the recomputed row" in text


def test_changed_plan_is_named(bundle):
    _edit_json(bundle / "plan.json", lambda p: p["config"].update(pairs=3))
    text = _failed(bundle)
    assert "manifest: plan.json changed" in text and "plan: config sha256" in text


def test_auditor_imports_nothing_from_the_harness():
    for path in sorted((REPO / "audit").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            for name in names:
                assert "harness" not in name and not name.startswith(".."), f"{path.name} imports {name}"


def test_auditor_runs_with_the_harness_unimportable(bundle):
    code = ("import sys, runpy; sys.modules['loopbench.harness'] = None; "
            f"sys.argv = ['audit', {str(bundle)!r}]; runpy.run_module('loopbench.audit', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "audit PASS" in proc.stdout
    assert json.loads((bundle / "audit.json").read_text())["status"] == "pass"
    assert "audit.json" not in json.loads((bundle / "manifest.json").read_text())["files"]
    # and the CLI exits 1 on a tampered bundle
    _edit_table(bundle, "tokens", lambda df: df.assign(exit_depth=df["exit_depth"].where(df.index != 0, 1)))
    proc = subprocess.run([sys.executable, "-m", "loopbench.audit", str(bundle)], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1 and "audit FAIL" in proc.stdout and "exit_depth" in proc.stdout
