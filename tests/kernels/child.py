"""A kernel's first CUDA launch in a child process with a time limit: for kernels whose programs wait for each other
(grid barriers), where a broken protocol hangs rather than fails, costing the time limit and not the suite."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run_in_child(code: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh Python with the repository importable; its CompletedProcess (text). Skips
    the calling test where there is no CUDA device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout_s, env=env)
