"""The auditor imports nothing of the harness and runs where the harness cannot be imported."""
import ast
import json
import subprocess
import sys

from tests.audit.tamper import REPO, edit_table


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
    edit_table(bundle, "tokens", lambda df: df.assign(exit_depth=df["exit_depth"].where(df.index != 0, 1)))
    proc = subprocess.run([sys.executable, "-m", "loopbench.audit", str(bundle)], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1 and "audit FAIL" in proc.stdout and "exit_depth" in proc.stdout


def test_auditor_refuses_a_folder_without_plan_json_and_writes_nothing_there(tmp_path):
    (tmp_path / "notes.txt").write_text("not a bundle")
    proc = subprocess.run([sys.executable, "-m", "loopbench.audit", str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "is not a bundle (no plan.json)" in proc.stderr, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
