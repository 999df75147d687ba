"""Two simulated devices through the real executor path (issue 16, the part one machine allows): a Hydra
multirun of `cpu-smoke` over ``executor.cpu_devices=2,1``. Its first job runs one session per device in
parallel, each child pinned to its own device and reporting its own identity, with one reference capture
and one checkpoint for both; its second job starts only after every child of the first ended, so a
multirun never puts two sessions on one device at once. Both bundles audit PASS, and a bundle whose two
devices name one card fails the audit naming them."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from loopbench.audit.auditor import audit
from tests.audit.tamper import REPO, edit_json, failed, rewrite_manifest

pytestmark = pytest.mark.slow      # its two-session bundle takes about 40 s on 2 cores

SMALL = ["pairs=2", "points=[{max_num_seqs:2,num_requests:3}]", "workload.output_len=8", "executor.poll_s=0.1"]


@pytest.fixture(scope="module")
def multirun(tmp_path_factory):
    """(the two-device bundle, the one-device bundle, stdout) of one multirun."""
    root = tmp_path_factory.mktemp("devices")
    proc = subprocess.run([sys.executable, "-m", "loopbench.harness.bench", "--config-name", "cpu-smoke", "-m",
                           "executor.cpu_devices=2,1", f"results_dir={root / 'r'}", f"cache_dir={root / 'c'}",
                           f"hydra.sweep.dir={root / 'h'}", *SMALL], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_devices = {len(_json(b / "plan.json")["devices"]): b for b in (root / "r").iterdir()}
    return by_devices[2], by_devices[1], proc.stdout


def _json(path: Path):
    return json.loads(path.read_text())


def _records(bundle: Path, job: str) -> list[dict]:
    return [_json(p) for p in sorted((bundle / "raw" / job).glob("*.json"))]


def _span(records: list[dict]) -> tuple[float, float]:
    return (min(r["wall_clock"]["measured_start_unix_s"] for r in records),
            max(r["wall_clock"]["measured_end_unix_s"] for r in records))


def test_two_devices_run_in_parallel_each_pinned_to_its_own(multirun):
    two, _, stdout = multirun
    assert stdout.count("audit PASS") == 2 and _json(two / "audit.json")["status"] == "pass"
    children = {c["name"]: c for c in _json(two / "children.json")}
    assert {n: (c["device"], c["state"]) for n, c in children.items()} == {
        "reference": ("cpu #0", "completed"), "cpu0": ("cpu #0", "completed"), "cpu1": ("cpu #1", "completed")}
    for i in (0, 1):
        assert _json(two / "jobs" / f"session-cpu{i}.json")["device"]["cpu_index"] == i
        devices = {json.dumps(r["device"], sort_keys=True) for r in _records(two, f"cpu{i}")}
        assert [json.loads(d) for d in devices] == [{"kind": "cpu", "torch": "cpu", "gpu_index": None,
                                                     "label": f"cpu #{i}", "name": machine_cpu(), "uuid": f"CPU-SIM-{i}"}]
    (s0, e0), (s1, e1) = _span(_records(two, "cpu0")), _span(_records(two, "cpu1"))
    assert max(s0, s1) < min(e0, e1), "the two sessions measured one after the other, not in parallel"


def machine_cpu() -> str:
    from loopbench.harness.machine import cpu_name
    return cpu_name()


def test_the_reference_capture_and_the_checkpoint_are_shared(multirun):
    two, _, _ = multirun
    plan = _json(two / "plan.json")
    assert sorted(p.name for p in (two / "jobs").iterdir()) == ["reference-cpu0.json", "session-cpu0.json",
                                                                 "session-cpu1.json"]
    assert sorted(p.name for p in (two / "references").iterdir()) == ["B2C3.meta.json", "B2C3.schedule.json"]
    assert [c["name"] for c in _json(two / "children.json")].count("reference") == 1
    ckpt = plan["checkpoint"]["path"]
    for i in (0, 1):
        assert f"session cpu{i} on cpu #{i}: loading {ckpt}\n" in (two / "logs" / f"cpu{i}.log").read_text()
    assert len(list((Path(ckpt).parent).iterdir())) == 1   # the cache holds the one checkpoint both loaded


def test_every_table_and_result_row_names_its_device(multirun):
    two, _, _ = multirun
    arms = pd.read_parquet(two / "tables" / "arms.parquet")
    assert sorted(set(zip(arms["job"], arms["device"]))) == [("cpu0", "cpu #0"), ("cpu1", "cpu #1")]
    assert arms.groupby("job").size().to_dict() == {"cpu0": 12, "cpu1": 12}
    results = _json(two / "summary.json")["results"]
    assert sorted((r["job"], r["device"], r["comparison"]) for r in results) == sorted(
        (f"cpu{i}", f"cpu #{i}", c) for i in (0, 1) for c in ("native_vs_alias_prefix", "alias_vs_alias_prefix",
                                                               "native_vs_native"))
    lines = (two / "report.md").read_text().splitlines()
    for i in (0, 1):   # the seed-style result table: one row per device in each comparison's table
        rows = [ln for ln in lines if ln.startswith(f"| cpu #{i} | 2 / 3 | 31,32,63,33 cycled / 8 |") and "× [" in ln]
        assert len(rows) == 3, lines


def test_a_multiruns_jobs_never_share_a_device(multirun):
    """Hydra's basic launcher runs the jobs one after another, each controller joining its children: the
    one-device job measured only after both sessions of the two-device job ended."""
    two, one, _ = multirun
    assert _json(one / "audit.json")["status"] == "pass"
    ends = [_span(_records(two, job))[1] for job in ("cpu0", "cpu1")]
    assert max(ends) < _span(_records(one, "cpu0"))[0]


def test_two_devices_that_name_one_card_fail_the_audit(multirun, tmp_path):
    bundle = tmp_path / multirun[0].name
    shutil.copytree(multirun[0], bundle)
    for path in (bundle / "raw" / "cpu1").glob("*.json"):
        edit_json(path, lambda r: r["device"].update(uuid="CPU-SIM-0"))
    rewrite_manifest(bundle)
    assert "records of cpu0 and cpu1 name one card 'CPU-SIM-0'" in failed(bundle)
    assert audit(multirun[0])["status"] == "pass"
