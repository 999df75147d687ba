#!/usr/bin/env bash
# kernels/prefill_gemm.py on a GPU in one device call: its GPU tests, the projection microbenchmark
# (kernels/bench/prefill_gemm.py) and the throughput probe with the prefill projections as cuBLAS calls of 256 rows
# (as configured) against one launch each with graph-bucket padding (--prefill-gemm ours) at B16/C32 and B32/C64,
# one process a line, 3 timed runs each; then, in the time left, the batch-invariance GPU test of the model
# with prefill_gemm on.
# Run from the repository root with the wheels on PYTHONPATH, LOOPBENCH_GIT_SHA set to the commit sent and $OUT set:
#   OUT=$OUT bash kernels/results/prefill_gemm.sh
set -uo pipefail
[[ -n "${OUT:-}" ]] || { echo "usage: OUT=DIR bash kernels/results/prefill_gemm.sh" >&2; exit 2; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
nvidia-smi -L | tee "$OUT/prefill_gemm_probe.log"
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_prefill_gemm.py 2>&1 | tail -3 | tee -a "$OUT/prefill_gemm_probe.log"
for point in "16 32" "32 64"; do
    set -- $point
    for variant in cublas ours; do
        echo "=== B$1 C$2 [$variant]"
        timeout 120 python3 -m loopbench.harness.throughput --preset ouro-1.4b --max-num-seqs "$1" --num-requests "$2" \
            --repeats 3 --cache /tmp/lbcache --prefill-gemm $variant 2>&1 | grep 'run \|tok/s\|rror' | tail -4
    done
done 2>&1 | tee -a "$OUT/prefill_gemm_probe.log"
timeout 150 python3 kernels/bench/prefill_gemm.py --ms 256 2048 4096 --out "$OUT/prefill_gemm.md" 2>&1 | grep -v "^|"
timeout "${INVARIANCE_S:-150}" python3 -m pytest -q -m gpu -x tests/runtime/test_batch_invariance.py -k prefill_gemm 2>&1 \
    | tail -4 | tee -a "$OUT/prefill_gemm_probe.log"
