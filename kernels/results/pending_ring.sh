#!/usr/bin/env bash
# Ran on 2026-12-07 on an H100 at ff05565 (the bench first, then the tests, with the timeouts 280 and 100 s);
# results: mlp_ring_lean_h100_ff05565.md, mlp_ring_trace_h100_ff05565.log, ring_gpu_tests_h100_ff05565.log.
# The next GPU measurement of kernels/mlp_ring.py (kernels/results/README.md, the mlp_ring entry): whether the grid
# barriers get cheap when the arrival and spin leave the TMA-issuing thread and its fences (``_diag`` 4, "lean";
# never run on a GPU yet), and where the rest of the 11 us between the ring (42.9 us at M16 on an H100) and its bare
# stream (31.1 us) goes: the bench prints each program's %globaltimer at every stage point for s8x4 (``_trace``).
# Run on the lent GPU from the repository root, PYTHONPATH set as for the probe and $OUT set (one device call):
#   OUT=$OUT bash kernels/results/pending_ring.sh
set -uo pipefail
[[ -n "${OUT:-}" ]] || { echo "usage: OUT=DIR bash kernels/results/pending_ring.sh" >&2; exit 2; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
nvidia-smi -L
# the ring's GPU tests (its first launch in a time-limited child: a broken barrier hangs rather than fails)
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mlp_ring.py 2>&1 \
    | tee "$OUT/ring_gpu_tests.log" | tail -3
# the kernel alone against today's five launches, the lean barriers, the diagnostics and the stage trace
timeout 200 python3 kernels/bench/mlp_block.py --ms 16 32 64 --paths now ring --out "$OUT/mlp_ring.md" \
    > "$OUT/mlp_ring.log" 2>&1
grep -v "^|" "$OUT/mlp_ring.log" | tail -6
cat "$OUT/mlp_ring.md"
