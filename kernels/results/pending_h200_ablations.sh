#!/usr/bin/env bash
# The H100 ablations of 2026-12-07 (ablate_{projections,attention}_h100_*.log, norm_bound_h100_2110858.log) on an
# H200, where issue 11's figures are defined: per point, the throughput probe as configured, then without the norm,
# attention and projection launches (kernels/bench/ablate.py; wrong tokens, a diagnostic), then as configured again,
# one process each, 3 runs a process. About 6 minutes. On any other GPU it measures nothing and says so. Run from the
# repository root with the wheels on PYTHONPATH, LOOPBENCH_GIT_SHA set to the commit sent and $OUT set:
#   OUT=$OUT bash kernels/results/pending_h200_ablations.sh
set -uo pipefail
[[ -n "${OUT:-}" ]] || { echo "usage: OUT=DIR bash kernels/results/pending_h200_ablations.sh" >&2; exit 2; }
nvidia-smi -L | tee "$OUT/ablate_h200.log"
if [[ $(nvidia-smi -L) != *H200* ]]; then
    echo "not an H200: nothing measured" | tee -a "$OUT/ablate_h200.log"
    exit 0
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
for point in "16 32" "32 64"; do
    set -- $point
    for switch in "" --no-norm --no-attention --no-projections ""; do
        echo "=== B$1 C$2 [$switch]"
        timeout 150 python3 kernels/bench/ablate.py $switch --preset ouro-1.4b --max-num-seqs "$1" --num-requests "$2" \
            --repeats 3 2>&1 | grep 'run \|ablate\|tok/s\|rror' | tail -4
    done
done 2>&1 | tee -a "$OUT/ablate_h200.log"
