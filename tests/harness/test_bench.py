"""`make bench`'s entry point: the whole pipeline from the command line, config errors, Hydra multirun."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MINI = ["--config-name", "cpu-smoke", "name=cli", "points=[{max_num_seqs:2,num_requests:2}]", "workload.prompt_len=5",
        "workload.prompt_lens=null", "workload.output_len=2", "pairs=1",
        "comparisons=[{baseline:native,candidate:alias_prefix}]", "executor.poll_s=0.1"]


def bench(tmp_path, *args, flags=()):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "loopbench.harness.bench", *flags, *MINI, f"results_dir={tmp_path / 'r'}",
                           f"cache_dir={tmp_path / 'c'}", f"hydra.run.dir={tmp_path / 'h'}",
                           f"hydra.sweep.dir={tmp_path / 'm'}", *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


@pytest.mark.slow      # about 18 s on 2 cores (a whole make bench)
def test_bench_runs_checks_audits_and_prints_the_table(tmp_path):
    proc = bench(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("| Device | B / C | P / D | native (baseline) tokens/s | alias_prefix (candidate) tokens/s "
            "| Paired speedup [95% CI] | Throughput change (speedup - 1) |") in proc.stdout
    assert "| CPU | 2 / 2 |" in proc.stdout and "audit PASS" in proc.stdout
    (bundle,) = (tmp_path / "r").iterdir()
    assert json.loads((bundle / "audit.json").read_text())["status"] == "pass"


def test_misspelt_key_fails_before_anything_runs(tmp_path):
    proc = bench(tmp_path, "workload.promt_len=3")
    assert proc.returncode == 2 and "loopbench: bad configuration: " in proc.stderr and "workload.promt_len" in proc.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()
    proc = bench(tmp_path, "+exit.treshold=0.3")     # our own key check: one line, exit 2, no traceback
    assert proc.returncode == 2
    assert "loopbench: bad configuration: unknown config key exit.treshold; did you mean exit.threshold?" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


def test_default_preset_follows_cuda():
    from loopbench.harness import bench as bench_mod
    import torch

    assert bench_mod.default_config_name() == ("ouro-1.4b" if torch.cuda.is_available() else "cpu-smoke")
