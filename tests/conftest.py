"""Shared test set-up.

Without CUDA, Triton kernels run under the Triton interpreter on CPU tensors; the interpreter is chosen
at kernel decoration time, so the variable must be set before anything imports ``triton``.
GPU-only tests carry the ``gpu`` marker and are skipped where CUDA is absent.
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
