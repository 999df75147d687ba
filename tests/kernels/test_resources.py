"""The offline sm_90 resource report (kernels/bench/resources.py) against the shared-memory model that
``gemm.num_stages_that_fit`` uses to lower a configuration's stages where they would not fit.

The compile runs in a child process without ``TRITON_INTERPRET`` (this session's conftest sets it, and an
interpreted kernel cannot be compiled); it needs only Triton's bundled ptxas, no GPU.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loopbench.kernels import gemm as gm
from loopbench.kernels import qkv_rope

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ("import json; from loopbench.kernels.bench import resources as r; "
           "print(json.dumps(r.rows([16, 32], [2]) + r.rows([16], [4], next_lines=1)))")


@pytest.fixture(scope="module")
def table():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", PROGRAM], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_cross_kernel_prefetch_compiles_in_every_configured_kernel_within_its_stages(table):
    """The rows of ``rows([16], [4], next_lines=1)``: the same shared memory as without (the prefetch holds no
    buffer), and a register count that still leaves shared memory the binding limit."""
    plain = {(r["role"], r["m"], r["num_stages"]): r for r in table[:-5]}
    for r in table[-5:]:
        twin = plain.get((r["role"], r["m"], r["num_stages"]))
        if twin is not None:
            assert r["shared_B"] == twin["shared_B"] and r["ctas_per_sm"] == twin["ctas_per_sm"], (r, twin)


def test_every_configured_kernel_is_reported_at_each_m_and_stage_count(table):
    seen = {(r["role"], r["m"], r["num_stages"]) for r in table}
    for role in ("o_proj", "down", "lm_head", "gate_up", "qkv"):
        for m in (16, 32):
            assert {(role, m, 2), (role, m, 4)} <= seen, (role, m)
    assert all(r["regs"] > 0 and r["ctas_per_sm"] >= 1 for r in table)


def test_shared_memory_is_what_num_stages_that_fit_assumes(table):
    """stages x (weight tiles x block_n + block_m) x block_k x 2 bytes, plus less than its 1 KiB reserve."""
    configs = {"o_proj": (gm.CONFIGS[(2048, 2048)], 1), "down": (gm.CONFIGS[(2048, 5632)], 1),
               "lm_head": (gm.CONFIGS[(49152, 2048)], 1), "gate_up": (gm.SWIGLU_CONFIGS[(11264, 2048)], 2),
               "qkv": (qkv_rope.CONFIGS[(6144, 2048)], 1)}
    for r in table:
        c, tiles = configs[r["role"]]
        block_m = max(16, 1 << (r["m"] - 1).bit_length())
        model = r["num_stages"] * (tiles * c.block_n + block_m) * c.block_k * 2
        assert model <= r["shared_B"] < model + gm._SHARED_RESERVE, (r, model)


def test_waves_count_programs_over_resident_slots(table):
    for r in table:
        assert r["waves"] == pytest.approx(r["programs"] / (r["ctas_per_sm"] * 132))
        assert r["runs"] == (r["m"] <= 32 or r["role"] in ("o_proj", "down", "qkv", "gate_up"))
    gate_up = next(r for r in table if r["role"] == "gate_up" and r["m"] == 16 and r["num_stages"] == 4)
    assert gate_up["programs"] == 11264 // 2 // gm.SWIGLU_CONFIGS[(11264, 2048)].block_n
