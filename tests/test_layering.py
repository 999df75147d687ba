"""Layering is tested, not hoped for (STYLE rule 12): one test per boundary.

- the runtime never imports the harness or the audit (every ``runtime/*.py`` statically, and at run time:
  importing the engine loads no ``loopbench.harness`` module);
- the session child loads no dataframe library (pandas, pyarrow): it writes through harness/fileio.py;
- no harness module imports a private name of another module (``from .x import _y``).
The audit's own boundary (it imports nothing of loopbench) is tested in tests/audit/test_audit.py.
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module name, imported names, line) of every import in ``path``; relative imports are
    resolved against the file's package (``loopbench.<folder>``)."""
    package = f"loopbench.{path.parent.name}"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            out.append((module, [a.name for a in node.names], node.lineno))
    return out


@pytest.mark.parametrize("path", sorted((REPO / "runtime").glob("*.py")), ids=lambda p: p.name)
def test_runtime_module_imports_neither_harness_nor_audit(path):
    for module, names, line in _imports(path):
        for forbidden in ("loopbench.harness", "loopbench.audit"):
            assert not (module == forbidden or module.startswith(forbidden + ".")), f"{path.name}:{line} imports {module}"
        if module == "loopbench":
            assert not {"harness", "audit"} & set(names), f"{path.name}:{line} imports {names} from loopbench"


def _run(code: str) -> list[str]:
    """The ``loopbench``/pandas/pyarrow modules loaded after running ``code`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    probe = (f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('loopbench', 'pandas', 'pyarrow'))))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_importing_the_engines_loads_no_harness_module():
    loaded = _run("import loopbench.runtime.engine, loopbench.runtime.reference")
    assert "loopbench.runtime.engine" in loaded
    assert not [m for m in loaded if m.startswith(("loopbench.harness", "loopbench.audit"))], loaded


def test_the_session_child_loads_no_dataframe_library(tmp_path):
    """What ``python -m loopbench.harness.session JOB`` imports to measure: the session module, the
    runtime it builds (model, checkpoint, engine, reference engine, schedule) and its record types."""
    loaded = _run("import loopbench.harness.session as s\n"
                  "from loopbench.runtime import checkpoint, engine, model, reference, schedule, api\n"
                  "from loopbench.harness import engines, records, coverage, machine, fileio, stats\n"
                  "engines.load_factory(records.DEFAULT_ENGINE)\n"
                  "engines.load_factory('loopbench.runtime.reference:make_engine')")
    assert "loopbench.harness.session" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("pandas", "pyarrow")], loaded
    assert "loopbench.harness.evidence" not in loaded


@pytest.mark.parametrize("path", sorted((REPO / "harness").glob("*.py")), ids=lambda p: p.name)
def test_no_private_cross_module_imports_in_the_harness(path):
    for module, names, line in _imports(path):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{path.name}:{line} imports private {private} from {module}"
