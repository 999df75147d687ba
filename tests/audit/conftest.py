"""The honest bundle every auditor test tampers with: one small CPU run, made once per test session; and its twin
with the pair order and prompts a format-14 writer drew, for the tests that claim an older format."""
import shutil
from pathlib import Path

import pytest

from loopbench.harness import conf, controller
from tests.audit.tamper import numpy_draws

# prompt_seed 1: prompts on which decode rows read keys from planes below their depth and the prefix arm meets a
# boundary tile (test_honest's coverage warning names the one gap left); seed 0's prompts by the SHA-256 rule of
# format 15 reach neither in 3 requests of 4 tokens
MINI = ["name=mini", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=17", "workload.prompt_lens=null",
        "workload.prompt_seed=1", "workload.output_len=4", "pairs=2",
        "comparisons=[{baseline:native,candidate:alias_prefix},{baseline:native,candidate:native}]", "executor.poll_s=0.1"]


def _run_mini(root: Path) -> Path:
    cfg = conf.compose("cpu-smoke", MINI + [f"results_dir={root / 'results'}", f"cache_dir={root / 'cache'}"])
    result = controller.run(cfg)
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    assert result.summary["checks"]["ok"], result.summary["checks"]["findings"]
    return result.bundle


@pytest.fixture(scope="session")
def honest_bundle(tmp_path_factory) -> Path:
    return _run_mini(tmp_path_factory.mktemp("audit"))


@pytest.fixture(scope="session")
def numpy_draws_bundle(tmp_path_factory) -> Path:
    """The honest bundle with its pair order and prompts drawn by numpy's Generator, as writers of formats up to 14
    drew them (tamper.numpy_draws): a bundle a test claims as an older format, whose rules re-derive that order."""
    with numpy_draws():
        return _run_mini(tmp_path_factory.mktemp("audit-numpy-draws"))


def _copy(bundle: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(bundle, tmp_path / bundle.name))


@pytest.fixture
def bundle(honest_bundle, tmp_path) -> Path:
    return _copy(honest_bundle, tmp_path)


@pytest.fixture
def older_bundle(numpy_draws_bundle, tmp_path) -> Path:
    """A copy of ``numpy_draws_bundle`` to tamper with (in a folder of its own: both bundles have one name)."""
    return _copy(numpy_draws_bundle, tmp_path / "older")
