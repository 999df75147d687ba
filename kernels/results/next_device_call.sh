#!/usr/bin/env bash
# The first device call of a session while issue 11 waits for an H200 (each session since 2026-12-05 asked for one
# and mostly got an H100): on an H200, kernels/results/pending_h200_bench.sh (make bench of ouro-1.4b, its bundle
# tarred into $OUT/bundle.tgz, then read_floor.py); on any other GPU, every `gpu`-marked test of the tree sent
# (`make test-gpu`'s selection), its log in $OUT/gpu_tests.log, cut off after GPU_TESTS_S seconds (default 560).
# Send the tree without the committed bundles (git sparse-checkout set --no-cone '/*' '!/results/2026-*/'); run
# from the repository root with the wheels on PYTHONPATH, LOOPBENCH_GIT_SHA set to the commit sent and $OUT set:
#   OUT=$OUT bash kernels/results/next_device_call.sh
set -uo pipefail
[[ -n "${OUT:-}" ]] || { echo "usage: OUT=DIR bash kernels/results/next_device_call.sh" >&2; exit 2; }
if [[ $(nvidia-smi -L) == *H200* ]]; then
    exec bash kernels/results/pending_h200_bench.sh
fi
nvidia-smi -L | tee "$OUT/gpu_tests.log"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# written as it runs, so a call cut off by its time limit still brings back the tests that ran
timeout "${GPU_TESTS_S:-560}" python3 -m pytest -q -m gpu -rfE --durations=25 -p no:cacheprovider \
    >> "$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?" | tee -a "$OUT/gpu_tests.log"
tail -n 40 "$OUT/gpu_tests.log"
