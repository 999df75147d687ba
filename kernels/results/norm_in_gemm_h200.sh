#!/usr/bin/env bash
# The first GPU measurement of 6a7cd61's gate-in-the-norm, the exit rule in one launch (kernels/exit_rule.py) and
# 5289297's opt-in norm step in o_proj / down
# (kernels/gemm_norm.py), written on a CPU-only day: run on the lent H200 from the repository root, with PYTHONPATH
# set as for the probe and $OUT set (bash kernels/results/norm_in_gemm_h200.sh). Logs land in $OUT.
#   1. the GPU tests of what changed (gemm_norm's first launch runs in a child process with a time limit: a broken
#      arrival protocol hangs instead of failing);
#   2. the probe, B16/C32 and B32/C64, one process each: as configured (the gate in the norm is on) against
#      --norm-in-gemm, and split-K variants of o_proj and down measured in the loop (the isolated sweep did not
#      count the partials the norm step reads).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
timeout 480 python3 -m pytest -q -m gpu -x tests/kernels/test_gemm_norm.py tests/kernels/test_fused.py \
    tests/kernels/test_exit_rule.py tests/runtime/test_gpu.py tests/runtime/test_batch_invariance.py 2>&1 \
    | tail -15 | tee "$OUT/gpu_tests.log"
for B in 16 32; do
    timeout 600 python3 -m loopbench.harness.throughput --preset ouro-1.4b --max-num-seqs $B --num-requests $((2 * B)) \
        --repeats 3 --variant "" --variant "--norm-in-gemm" \
        --variant "--gemm-config o_proj.split_k=2 --gemm-config down.split_k=8" 2>&1 | tee "$OUT/probe_b$B.log" | tail -6
done
