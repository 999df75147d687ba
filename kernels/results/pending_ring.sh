#!/usr/bin/env bash
# The GPU measurement of kernels/mlp_ring.py that kernels/results/README.md's mlp_ring_lean entry reports, as it ran
# on 2026-12-07 on an H100 at ff05565 (results: mlp_ring_lean_h100_ff05565.md, mlp_ring_trace_h100_ff05565.log,
# ring_gpu_tests_h100_ff05565.log): whether the grid barriers get cheap when the arrival and spin leave the
# TMA-issuing thread and its fences (``_diag`` 4, "lean"), what the barriers and the norm steps each cost (``_diag`` 8
# and 12), and each program's %globaltimer at every stage point for s8x4 (``_trace``), then the ring's GPU tests.
# Run on the lent GPU from the repository root, PYTHONPATH set as for the probe and $OUT set (one device call):
#   OUT=$OUT bash kernels/results/pending_ring.sh
set -uo pipefail
[[ -n "${OUT:-}" ]] || { echo "usage: OUT=DIR bash kernels/results/pending_ring.sh" >&2; exit 2; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
nvidia-smi -L
# the kernel alone against today's five launches, the lean barriers, the diagnostics and the stage traces
timeout 280 python3 kernels/bench/mlp_block.py --ms 16 32 64 --paths now ring --out "$OUT/mlp_ring.md" \
    > "$OUT/mlp_ring.log" 2>&1
grep -v "^|" "$OUT/mlp_ring.log" | tail -12
cat "$OUT/mlp_ring.md"
# the ring's GPU tests (its first launch in a time-limited child: a broken barrier hangs rather than fails)
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mlp_ring.py 2>&1 \
    | tee "$OUT/ring_gpu_tests.log" | tail -3
