"""Shared test set-up.

Without CUDA, Triton kernels run under the Triton interpreter on CPU tensors; the interpreter is chosen
at kernel decoration time, so the variable must be set before anything imports ``triton``.
GPU-only tests carry the ``gpu`` marker and are skipped where CUDA is absent. The CPU runtime tests share
one seeded tiny checkpoint and the models built from it (fixtures below; imports stay lazy so that the
interpreter variable is set first).
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """(OuroConfig, tensors) of the seeded tiny synthetic checkpoint, stored in fp32."""
    from loopbench.harness.fixtures import write_synthetic_checkpoint
    from loopbench.runtime.checkpoint import load_checkpoint
    path = tmp_path_factory.mktemp("tiny")
    write_synthetic_checkpoint(path, "tiny", seed=0, dtype=torch.float32)
    return load_checkpoint(path)


@pytest.fixture(scope="session")
def model64(tiny_ckpt):
    from loopbench.runtime.model import OuroModel
    return OuroModel.from_tensors(*tiny_ckpt, dtype=torch.float64)


@pytest.fixture(scope="session")
def naive(tiny_ckpt):
    from loopbench.runtime.reference import NaiveOuro
    return NaiveOuro(*tiny_ckpt, dtype=torch.float64)
