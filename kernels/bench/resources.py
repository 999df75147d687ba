"""Offline resource report: the decode loop's GEMM kernels compiled for sm_90 (H100 / H200) on any machine.

For each configured projection (kernels/gemm.py ``CONFIGS`` and ``SWIGLU_CONFIGS``, kernels/qkv_rope.py
``CONFIGS``) at M rows and a range of ``num_stages`` it compiles the kernel the engine would launch with
Triton's own ptxas (no GPU needed; ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``) and reports:

- ``shared_B``: the program's shared memory (the software pipeline's stage buffers and barriers), from the
  compiled kernel's metadata; ``regs``: registers per thread (``cuobjdump -res-usage`` of the cubin);
- ``ctas_per_sm``: how many programs fit on one SM at once, by shared memory (``SM_SHARED_BYTES`` with the
  1 KiB each program reserves) and by registers (65,536 a SM), from the CUDA C++ Programming Guide's
  occupancy rules and the H100/H200 limits (228 KiB shared memory an SM, 227 KiB a block);
- ``runs``: whether the engine runs the kernel at M rows (its ``FASTER_UP_TO``; else cuBLAS);
- ``programs`` and ``waves`` = programs / (ctas_per_sm x ``--sms``): a fraction above a whole number is a
  last wave that leaves SMs idle; two kernels back to back under programmatic dependent launch overlap only
  where the next one's programs fit beside the running one's (``shared_B`` of both).

These are compile-time facts of this machine's Triton, not timings: the lent H200 runs Triton 3.6 (compile
with it, e.g. ``pip install --target DIR triton==3.6.0`` and ``PYTHONPATH=DIR``, to match its registers).
Pointer and size arguments that the runtime sees divisible by 16 get Triton's ``tt.divisibility=16``, as a
launch specialises them; without it the loads are not vectorised and the K loop is not pipelined at all.

Usage: ``PYTHONPATH=<repo> python3 -m loopbench.kernels.bench.resources --ms 16 32 --stages 2 3 4``.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton

from loopbench.kernels import gemm as gm
from loopbench.kernels import qkv_rope

SM_SHARED_BYTES = 228 * 1024        # shared memory of one H100 / H200 SM
BLOCK_RESERVED_BYTES = 1024         # shared memory the system keeps for each resident program
SM_REGISTERS = 65536
SM_WARPS, SM_PROGRAMS = 64, 32      # resident warps and programs an SM (compute capability 9.0)
H200_SMS = 132
SHAPES = {"qkv": (6144, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (49152, 2048)}
COLUMNS = ("role", "kernel", "m", "runs", "num_stages", "configured", "shared_B", "regs", "ctas_per_sm", "programs",
           "waves")


@dataclass(frozen=True)
class Resources:
    shared_bytes: int
    registers: int
    num_warps: int

    def ctas_per_sm(self) -> int:
        """Programs one SM holds at once: the smallest of its shared-memory limit, its register limit (registers
        are allocated to a warp in units of 256, so a thread's count rounds up to a multiple of 8), 64 warps
        and 32 programs an SM."""
        by_shared = SM_SHARED_BYTES // (self.shared_bytes + BLOCK_RESERVED_BYTES)
        by_regs = SM_REGISTERS // (-(-max(self.registers, 1) // 8) * 8 * 32 * self.num_warps)
        return min(by_shared, by_regs, SM_WARPS // self.num_warps, SM_PROGRAMS)


def compile_sm90(fn, signature: dict, constexprs: dict, divisible_by_16: tuple[str, ...], num_warps: int,
                 num_stages: int) -> Resources:
    """Compile ``fn`` for sm_90 with Triton's ptxas; ``signature`` names every argument (``"constexpr"`` for
    those in ``constexprs``), ``divisible_by_16`` the runtime arguments a launch would see as multiples of 16.
    Raises RuntimeError when cuobjdump reports no register count."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible_by_16}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        report = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", report)
    if regs is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no register count: {report!r}")
    return Resources(int(kernel.metadata.shared), int(regs.group(1)), num_warps)


# the kernels' region of a later weight to bring into L2 (gemm.next_weight_region)
_REGION = {"nw_ptr": "*bf16", "nw_rows": "i32", "nw_cols": "i32", "nw_stride": "i32", "nw_lines": "i32"}
# the GEMM kernels' greedy sampling partials (gemm.gemm_argmax)
_ARGMAX = {"tmax_ptr": "*fp32", "targ_ptr": "*i32"}


def _next_mode(c: gm.GemmConfig, next_lines: int) -> int:
    """The kernels' ``NEXT`` constexpr for ``next_lines`` lines of a later weight (``gemm.next_weight_launch``)."""
    if not next_lines:
        return 0
    return int((gm.NEXT_EXTRA if c.prefetch_programs else gm.NEXT_TAIL if c.prefetch_at_end else gm.NEXT_OWN).value)


def _gemm_kernel_args(c: gm.GemmConfig, block_m: int, glu: bool, out_dtype: str, next_lines: int = 0,
                      argmax: bool = False) -> tuple:
    """(kernel, signature, constexprs, divisible_by_16) of :func:`gemm._launch` for config ``c``;
    ``next_lines`` > 0 compiles in the prefetch of a later weight (``NEXT``); ``argmax`` the greedy partials
    without the product (``gemm.gemm_argmax``, as the decode step runs lm_head)."""
    common = {"M": "i32", "N": "i32", "K": "i32", "tiles_per_split": "i32"}
    flags = {"ARGMAX": argmax, "STORE": not argmax}
    if c.tma:
        sig = {"x_desc": f"tensordesc<bf16[{block_m}, {c.block_k}]>",
               "w_desc": f"tensordesc<bf16[{c.block_n}, {c.block_k}]>", "out_ptr": out_dtype, "w_ptr": "*bf16",
               **common, "stride_om": "i32", "stride_os": "i32", "stride_wn": "i32", **_REGION, **_ARGMAX}
        consts = {"BLOCK_N": c.block_n, "BLOCK_M": block_m, "BLOCK_K": c.block_k, "PDL": 1, "GLU": glu,
                  "PREFETCH_K": c.block_k * min(c.prefetch_tiles, 1), "NEXT": _next_mode(c, next_lines), **flags}
        return gm._gemm_tma_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, \
            ("out_ptr", "w_ptr", "N", "K", "stride_om", "stride_os", "stride_wn", "nw_ptr")
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": out_dtype, **common,
           "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32", "stride_os": "i32", **_REGION, **_ARGMAX}
    consts = {"BLOCK_N": c.block_n, "BLOCK_M": block_m, "BLOCK_K": c.block_k, "EVEN": True, "DOT_FP32": False,
              "PDL": 1, "GLU": glu, "PREFETCH_K": c.block_k * min(c.prefetch_tiles, 1),
              "NEXT": _next_mode(c, next_lines),
              **flags}
    return gm._gemm_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, \
        ("x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_os", "nw_ptr")


def _qkv_rope_args(c: gm.GemmConfig, block_m: int, heads: int = 16, kv_heads: int = 16, head_dim: int = 128,
                   page_size: int = 16, next_lines: int = 0) -> tuple:
    """(kernel, signature, constexprs, divisible_by_16) of :func:`qkv_rope.qkv_rope_write_kv` (Ouro shape)."""
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32", "row_slot_ptr": "*i32",
            "row_depth_ptr": "*i32", "row_pos_ptr": "*i32"}
    ints = ("M K num_slots num_planes max_blocks stride_xm stride_wn stride_qm stride_cos stride_kb stride_kt "
            "stride_kh stride_kd stride_vb stride_vt stride_vh stride_vd stride_bts stride_btp stride_btj").split()
    consts = {"NUM_HEADS": heads, "NUM_KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "BLOCK_M": block_m,
              "BLOCK_K": c.block_k, "EVEN": True, "DOT_FP32": False, "PDL": 1, "PAGE_SIZE": page_size,
              "PREFETCH_K": c.block_k * min(c.prefetch_tiles, 1), "PARTS": head_dim // c.block_n,
              "NEXT": _next_mode(c, next_lines), "EARLY_EPILOGUE": c.early_epilogue}
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), **_REGION, **dict.fromkeys(consts, "constexpr")}
    div = tuple(ptrs) + ("K", "stride_xm", "stride_wn", "stride_qm", "stride_kb", "stride_kt", "stride_kh",
                         "stride_vb", "stride_vt", "stride_vh", "nw_ptr")
    return qkv_rope._qkv_rope_write_kernel, sig, consts, div


def rows(ms: list[int], stages: list[int], sms: int = H200_SMS, next_lines: int = 0) -> list[dict]:
    """One row per (role, M, num_stages) of every configured Ouro-1.4B projection kernel: ``runs`` whether the
    engine runs it at M rows (its FASTER_UP_TO), ``waves`` None where one program does not fit an SM (the
    runtime then lowers the stages, ``gemm.num_stages_that_fit``); ``next_lines`` > 0 compiles the kernels with
    the cross-kernel L2 prefetch (``gemm.next_weight_region``) in."""
    plans = []
    for role, shape in SHAPES.items():
        if shape in gm.CONFIGS and role not in ("qkv", "gate_up"):    # qkv_rope and swiglu serve those at M <= 64
            c = gm.CONFIGS[shape]
            plans.append((role, "gemm_tma" if c.tma else "gemm", c, False, "*fp32" if c.split_k > 1 else "*bf16",
                          triton.cdiv(shape[0], c.block_n) * c.split_k, gm.FASTER_UP_TO.get(shape, 0)))
    glu = gm.SWIGLU_CONFIGS[SHAPES["gate_up"]]
    plans.append(("gate_up", "gemm_swiglu" + ("_tma" if glu.tma else ""), glu, True, "*bf16",
                  triton.cdiv(SHAPES["gate_up"][0] // 2, glu.block_n), gm.SWIGLU_FASTER_UP_TO.get(SHAPES["gate_up"], 0)))
    qc = qkv_rope.CONFIGS[SHAPES["qkv"]]
    plans.append(("qkv", "qkv_rope", qc, None, None, SHAPES["qkv"][0] // qc.block_n,     # block_n rows a program
                  qkv_rope.FASTER_UP_TO.get(SHAPES["qkv"], 0)))
    out = []
    for role, kernel, c, glu_flag, out_dtype, programs, up_to in plans:
        for m in ms:
            block_m = max(16, triton.next_power_of_2(m))
            for st in sorted(set(stages) | {c.num_stages}):
                fn, sig, consts, div = (_qkv_rope_args(c, block_m, next_lines=next_lines) if kernel == "qkv_rope"
                                        else _gemm_kernel_args(c, block_m, glu_flag, out_dtype, next_lines,
                                                               argmax=role == "lm_head"))
                res = compile_sm90(fn, sig, consts, div, c.num_warps, st)
                per_sm = res.ctas_per_sm()
                out.append(dict(role=role, kernel=kernel, m=m, runs=m <= min(up_to, gm.MAX_M), num_stages=st,
                                configured=st == c.num_stages, shared_B=res.shared_bytes, regs=res.registers,
                                ctas_per_sm=per_sm, programs=programs,
                                waves=programs / (per_sm * sms) if per_sm else None))
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in table:
        lines.append("| " + " | ".join(_cell(c, r[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def _cell(column: str, value) -> str:
    if column == "waves":
        return "does not fit" if value is None else f"{value:.2f}"
    if isinstance(value, bool):
        return "yes" if value else ("no" if column == "runs" else "")
    return str(value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[16, 32, 64], help="rows (batch sizes), 1..128")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4], help="num_stages to compile besides the "
                    "configured one")
    ap.add_argument("--sms", type=int, default=H200_SMS, help="SMs of the device the waves are counted for")
    ap.add_argument("--next-lines", type=int, default=0, help="compile with the cross-kernel L2 prefetch in "
                    "(> 0; gemm.next_weight_region)")
    args = ap.parse_args(argv)
    for name, values, lo, hi in (("--ms", args.ms, 1, gm.MAX_M), ("--stages", args.stages, 1, 8),
                                 ("--sms", [args.sms], 1, 1024), ("--next-lines", [args.next_lines], 0, 1 << 20)):
        bad = [v for v in values if not lo <= v <= hi]
        if bad:
            ap.error(f"{name} must be in {lo}..{hi}, got {bad[0]}")
    print(f"triton {triton.__version__}, sm_90, {args.sms} SMs", file=sys.stderr)
    print(markdown(rows(args.ms, args.stages, args.sms, args.next_lines)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
