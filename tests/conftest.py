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


def _language_state() -> list[tuple[object, dict]]:
    """Every attribute of triton.language's modules and tensor classes, as they are now (taken at this file's
    import, before any test launches a kernel)."""
    import triton.language as tl
    return [(obj, dict(vars(obj))) for obj in (tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base)]


_LANGUAGE = _language_state()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def release_cuda_memory(request):
    """After each ``gpu`` test: collect garbage and return the allocator's free blocks. GPU memory piled up over a
    whole ``make test-gpu`` (kernels/results/gpu_suite_h100_077e1d9.log: on an 80 GB H100 test_batch_invariance's
    B128 engines ran out of memory with 75 GiB allocated; the module passed alone before). The likely cause, not
    yet confirmed on a GPU: engines in reference cycles, which Python's collector (counting objects, not bytes)
    frees late."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available() and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


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


@pytest.fixture
def unpatched_triton_language():
    """triton.language as imported, for a test that compiles a Gluon kernel after interpreted kernels ran in the
    same process. Triton 3.9's interpreter patches the language while it runs a kernel and restores it after, but a
    jit helper the kernel calls from another module (``tl.sum`` from triton/language/standard.py) patches
    ``triton.language.core`` again and never restores it (``InterpretedFunction.__call__``); a later Gluon compile
    then builds scalar arithmetic with the interpreter ("'value' object has no attribute 'dtype'"). Seen only with
    an empty Triton cache, where the Gluon kernel is compiled rather than loaded."""
    for obj, attrs in _LANGUAGE:
        now = vars(obj)
        for name in [n for n in now if n not in attrs]:
            delattr(obj, name)
        for name, value in attrs.items():
            if now.get(name) is not value:
                setattr(obj, name, value)
    yield
