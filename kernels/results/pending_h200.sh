#!/usr/bin/env bash
# The first GPU measurement of what was built on CPU-only days (2026-12-04/05); run at 62ac899 on 2026-12-05, results
# in prewait_h200_62ac899.md. What it measured:
#   - 6a7cd61 the exit gate in the last norm kernel and c416b21 the exit rule in one launch (both on by default);
#   - 5289297 the norm step inside o_proj / down (kernels/gemm_norm.py, opt-in: --norm-in-gemm);
#   - f446049 decode attention's loads before its PDL wait (on; off: --attention-config early_kv=false);
#   - ff5d247 qkv_rope's epilogue inputs before its PDL wait (on; off: --gemm-config qkv_rope.early_epilogue=false);
#   - GemmConfig.early_trigger (off): one GEMM releases its dependents right after its wait, so their programs run
#     what they do before their own wait under its K loop; decode attention's the same (--attention-config
#     early_trigger=true);
#   - GemmConfig.prefetch_programs (0): extra programs on the SMs a GEMM leaves idle bring the next weight into L2;
#   - decode_attention(prefetch_kv=N) (0): attention asks L2 for its next N K/V tiles before its wait, which with
#     qkv_rope's early release streams the rows' history under the qkv K loop.
# Run on the lent H200 from the repository root, PYTHONPATH set as for the probe and $OUT set, one stage a device call
# (each fits the 10-minute limit; logs land in $OUT):
#   tests      the GPU tests of what changed (gemm_norm's first launch runs in a child with a time limit: a broken
#              arrival protocol hangs, not fails)
#   probe      the throughput probe at B16/C32 and B32/C64, one process each, every variant against as configured
#              in alternating order: each switch above on its own
#   attention  the same for the qkv -> attention -> o_proj boundaries (early releases with deeper prefetches), then
#              kernels/bench/decode_attention.py with the attention switches as variants
#   mlp        the same for gate_up -> down -> next qkv, with the norm in o_proj / down (a fused MLP's overlap from
#              existing knobs: the dependent's programs prefetch while the releasing kernel streams)
# e.g. OUT=$OUT bash kernels/results/pending_h200.sh probe. Then `make bench` for a bundle of whatever wins.
set -uo pipefail
stage=${1:-}
if [[ ! "$stage" =~ ^(tests|probe|attention|mlp)$ ]] || [[ -z "${OUT:-}" ]]; then
    echo "usage: OUT=DIR bash kernels/results/pending_h200.sh tests|probe|attention|mlp" >&2
    exit 2
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"

probe() {   # probe VARIANT...: as configured and every VARIANT, B16/C32 then B32/C64, into $OUT/$stage_b*.log
    local args=(--variant "")
    for v in "$@"; do args+=(--variant "$v"); done
    for B in 16 32; do
        timeout 235 python3 -m loopbench.harness.throughput --preset ouro-1.4b --max-num-seqs $B \
            --num-requests $((2 * B)) --repeats 3 "${args[@]}" 2>&1 | tee "$OUT/${stage}_b$B.log" | tail -10
    done
}

case "$stage" in
tests)
    timeout 540 python3 -m pytest -q -m gpu -x tests/kernels/test_gemm_norm.py tests/kernels/test_fused.py \
        tests/kernels/test_exit_rule.py tests/kernels/test_pdl.py tests/kernels/test_qkv_rope.py \
        tests/kernels/test_gemm.py tests/kernels/test_decode_attention.py tests/runtime/test_gpu.py \
        tests/runtime/test_batch_invariance.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
probe)
    probe "--norm-in-gemm" "--attention-config early_kv=false" "--gemm-config qkv_rope.early_epilogue=false" \
        "--gemm-config o_proj.split_k=2 --gemm-config down.split_k=8" ;;
attention)
    probe "--gemm-config qkv_rope.early_trigger=true" \
        "--gemm-config qkv_rope.early_trigger=true --attention-config prefetch_kv=8" \
        "--attention-config prefetch_kv=8" \
        "--attention-config early_trigger=true --gemm-config o_proj.prefetch_tiles=4" \
        "--prefetch-next o_proj=1 --gemm-config qkv_rope.prefetch_programs=36"
    # the attention kernel alone, back-to-back calls in a graph (no qkv kernel before it): the switches' own cost
    timeout 120 python3 kernels/bench/decode_attention.py --out "$OUT/decode_attention_prewait.md" --batches 16 32 \
        --contexts 128 256 1024 --no-sdpa --rep-ms 40 --variants native_latekv alias_latekv prefix_latekv \
        native_early native_pf8_early prefix_pf8_early 2>&1 | tee "$OUT/decode_attention_prewait.log" | tail -3 ;;
mlp)
    probe "--norm-in-gemm" \
        "--norm-in-gemm --gemm-config swiglu.early_trigger=true --gemm-config down.prefetch_tiles=8" \
        "--norm-in-gemm --gemm-config o_proj.early_trigger=true --gemm-config swiglu.prefetch_tiles=4" \
        "--norm-in-gemm --gemm-config down.early_trigger=true --gemm-config qkv_rope.prefetch_tiles=4" \
        "--norm-in-gemm --prefetch-next down=1 --gemm-config swiglu.prefetch_programs=44" ;;
esac
