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


def first_half_launch_counts(module: str, config: str, barriers: int, timeout_s: float = 300) -> None:
    """One layer half's first launch at M16 on the Ouro shape (``loopbench.kernels.<module>``, whose entry point is
    its namesake taking (a, x, w_o, gate_up, down, 4 norm weights, eps, ``config``, counters)) in a child process;
    asserts it exited cleanly with every one of its ``barriers`` arrival counters at the grid size (one program an
    SM), i.e. every program passed every grid barrier once. ``config``: a Python expression in the child, the module
    imported as ``k``."""
    proc = run_in_child(f"""
        import torch
        from loopbench.kernels import {module} as k
        torch.manual_seed(0)
        h, i = 2048, 5632
        r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16) / 50
        ln = torch.ones(h, device="cuda", dtype=torch.bfloat16)
        c = k.new_counters("cuda")
        k.{module}(r(16, h), r(16, h), r(h, h), r(2 * i, h), r(h, i), ln, ln, ln, ln, 1e-6, {config}, c)
        torch.cuda.synchronize()
        print("counters", c.tolist())
    """, timeout_s)
    g = torch.cuda.get_device_properties(0).multi_processor_count
    assert proc.returncode == 0 and f"counters {[g] * barriers}" in proc.stdout, proc.stdout + proc.stderr
