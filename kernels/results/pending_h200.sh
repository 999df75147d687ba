#!/usr/bin/env bash
# The first GPU measurement of what was built on CPU-only days (2026-12-04/05), none of it timed yet:
#   - 6a7cd61 the exit gate in the last norm kernel and c416b21 the exit rule in one launch (both on by default);
#   - 5289297 the norm step inside o_proj / down (kernels/gemm_norm.py, opt-in: --norm-in-gemm);
#   - f446049 decode attention's loads before its PDL wait (on; off: --attention-config early_kv=false);
#   - ff5d247 qkv_rope's epilogue inputs before its PDL wait (on; off: --gemm-config qkv_rope.early_epilogue=false);
#   - GemmConfig.early_trigger: one GEMM releases its dependents right after its wait (off; qkv_rope's lets attention's
#     loads before its wait run under the qkv K loop, swiglu's lets down's weight prefetch run under gate_up's);
#     decode attention's the same (--attention-config early_trigger=true: o_proj's prefetch under attention);
#   - GemmConfig.prefetch_programs: extra programs on the SMs a GEMM leaves idle bring the next weight into L2
#     (--prefetch-next down=1 --gemm-config swiglu.prefetch_programs=44: down's 23 MB on gate_up's 44 idle SMs).
# Run on the lent H200 from the repository root, PYTHONPATH set as for the probe and $OUT set, one stage a device call
# (each fits the 10-minute limit; logs land in $OUT):
#   bash kernels/results/pending_h200.sh tests   the GPU tests of what changed (gemm_norm's first launch runs in a
#                                                child with a time limit: a broken arrival protocol hangs, not fails)
#   bash kernels/results/pending_h200.sh probe   the throughput probe at B16/C32 and B32/C64, one process each, every
#                                                variant against as configured in alternating order
#   bash kernels/results/pending_h200.sh explore the same for combinations: with the norm in o_proj / down, a GEMM's
#                                                early release together with a deeper weight prefetch by its dependent
#                                                (the dependent's programs prefetch while the releasing kernel streams)
# Then `make bench` for a bundle of whatever the probe favours.
set -uo pipefail
if [[ "${1:-}" != tests && "${1:-}" != probe && "${1:-}" != explore ]] || [[ -z "${OUT:-}" ]]; then
    echo "usage: OUT=DIR bash kernels/results/pending_h200.sh tests|probe|explore" >&2
    exit 2
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
case "$1" in
tests)
    timeout 540 python3 -m pytest -q -m gpu -x tests/kernels/test_gemm_norm.py tests/kernels/test_fused.py \
        tests/kernels/test_exit_rule.py tests/kernels/test_pdl.py tests/kernels/test_qkv_rope.py \
        tests/kernels/test_decode_attention.py tests/runtime/test_gpu.py tests/runtime/test_batch_invariance.py 2>&1 \
        | tail -15 | tee "$OUT/gpu_tests.log" ;;
probe)
    for B in 16 32; do
        timeout 285 python3 -m loopbench.harness.throughput --preset ouro-1.4b --max-num-seqs $B \
            --num-requests $((2 * B)) --repeats 3 --variant "" --variant "--norm-in-gemm" \
            --variant "--attention-config early_kv=false" --variant "--gemm-config qkv_rope.early_epilogue=false" \
            --variant "--gemm-config qkv_rope.early_trigger=true" --variant "--gemm-config swiglu.early_trigger=true" \
            --variant "--gemm-config o_proj.split_k=2 --gemm-config down.split_k=8" 2>&1 \
            | tee "$OUT/probe_b$B.log" | tail -8
    done ;;
explore)
    for B in 16 32; do
        timeout 285 python3 -m loopbench.harness.throughput --preset ouro-1.4b --max-num-seqs $B \
            --num-requests $((2 * B)) --repeats 3 --variant "" --variant "--norm-in-gemm" \
            --variant "--norm-in-gemm --gemm-config swiglu.early_trigger=true --gemm-config down.prefetch_tiles=8" \
            --variant "--norm-in-gemm --gemm-config o_proj.early_trigger=true --gemm-config swiglu.prefetch_tiles=4" \
            --variant "--norm-in-gemm --gemm-config down.early_trigger=true --gemm-config qkv_rope.prefetch_tiles=4" \
            --variant "--norm-in-gemm --gemm-config qkv_rope.early_trigger=true" \
            --variant "--norm-in-gemm --attention-config early_trigger=true --gemm-config o_proj.prefetch_tiles=4" \
            --variant "--norm-in-gemm --prefetch-next down=1 --gemm-config swiglu.prefetch_programs=44" \
            --variant "--norm-in-gemm --prefetch-next o_proj=1 --gemm-config qkv_rope.prefetch_programs=36" 2>&1 \
            | tee "$OUT/explore_b$B.log" | tail -8
    done ;;
esac
