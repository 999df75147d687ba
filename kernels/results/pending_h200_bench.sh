#!/usr/bin/env bash
# Issue 11's H200 must-show figures of current main in one device call (each session since 2026-12-05 asked for an
# H200 and got an H100 or none): `make bench` of ouro-1.4b (its bundle tarred into $OUT/bundle.tgz, to commit under
# results/) and, if time is left, kernels/bench/read_floor.py. On any other GPU it measures nothing and says so.
# Send the tree without the committed bundles (git sparse-checkout set --no-cone '/*' '!/results/2026-*/'), so the
# tarball holds only the new one. Run from the repository root with the wheels on PYTHONPATH, LOOPBENCH_GIT_SHA set
# to the commit sent and $OUT set:
#   OUT=$OUT bash kernels/results/pending_h200_bench.sh
set -uo pipefail
[[ -n "${OUT:-}" ]] || { echo "usage: OUT=DIR bash kernels/results/pending_h200_bench.sh" >&2; exit 2; }
nvidia-smi -L
if [[ $(nvidia-smi -L) != *H200* ]]; then
    echo "not an H200: nothing measured"
    exit 0
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
timeout 470 make bench 2>&1 | tail -30
tar czf "$OUT/bundle.tgz" results/2026-* 2>/dev/null
timeout 90 python3 kernels/bench/read_floor.py --out "$OUT/read_floor_h200.md" 2>&1 | tail -10
