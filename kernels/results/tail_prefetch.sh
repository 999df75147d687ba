#!/usr/bin/env bash
# GemmConfig.prefetch_at_end (kernels/gemm.py NEXT_TAIL): each projection's programs ask L2 for their share of
# the next projection's weight at their end, one bulk prefetch a row, so the programs that finish first fill the
# launch's tail and the rest the norm / attention kernel before the next weight stream. The GPU tests that it
# changes no bit, then the throughput probe at B16/C32 and B32/C64 (one process each, variants alternating).
# Run on the lent GPU from the repository root with PYTHONPATH set as for the probe and OUT set:
#   OUT=$OUT bash kernels/results/tail_prefetch.sh tests|probe   (BS="16 32" by default: the batch sizes to probe)
set -uo pipefail
stage=${1:-}
if [[ ! "$stage" =~ ^(tests|probe)$ ]] || [[ -z "${OUT:-}" ]]; then
    echo "usage: OUT=DIR bash kernels/results/tail_prefetch.sh tests|probe" >&2
    exit 2
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
TAIL="--gemm-config qkv_rope.prefetch_at_end=true --gemm-config o_proj.prefetch_at_end=true \
--gemm-config swiglu.prefetch_at_end=true --gemm-config down.prefetch_at_end=true"

case "$stage" in
tests)
    timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_gemm.py tests/kernels/test_qkv_rope.py \
        tests/runtime/test_batch_invariance.py -k "prefetch or next_weight or qkv_rope" 2>&1 \
        | tee "$OUT/tail_gpu_tests.log" | tail -5 ;;
probe)
    for B in ${BS:-16 32}; do
        timeout 270 python3 -m loopbench.harness.throughput --preset ouro-1.4b --max-num-seqs $B \
            --num-requests $((2 * B)) --repeats 3 --variant "" \
            --variant "$TAIL --prefetch-next o_proj=1,gate_up=0.25,qkv=0.25" \
            --variant "$TAIL --prefetch-next o_proj=1,gate_up=0.25,down=0.25,qkv=0.25" \
            --variant "$TAIL --prefetch-next o_proj=1,gate_up=0.5,down=0.5,qkv=0.5" \
            2>&1 | tee "$OUT/tail_probe_b$B.log" | tail -8
    done ;;
esac
