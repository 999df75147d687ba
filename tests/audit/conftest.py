"""The honest bundle every auditor test tampers with: one small CPU run, made once per test session."""
import shutil
from pathlib import Path

import pytest

from loopbench.harness import conf, controller

MINI = ["name=mini", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=17", "workload.prompt_lens=null",
        "workload.output_len=4", "pairs=2",
        "comparisons=[{baseline:native,candidate:alias_prefix},{baseline:native,candidate:native}]", "executor.poll_s=0.1"]


@pytest.fixture(scope="session")
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
