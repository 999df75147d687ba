#!/usr/bin/env bash
# Times the untimed candidate kernels/results/candidate_decode_attention_longctx.patch (alias+prefix decode
# attention: each split runs only the loops it has tiles for) against the committed kernel, in one process, on
# a GPU machine: bash kernels/results/candidate_decode_attention_longctx.sh (from the repository root, with
# PYTHONPATH set as for the probe and $OUT set). Leaves the working copy patched; results in $OUT.
set -euo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p .scratch "$OUT"
if grep -q _routed_loop kernels/decode_attention.py; then
    echo "kernels/decode_attention.py is already patched: run this on an unpatched copy"; exit 3
fi
# the committed kernel, loadable from a file (kernels/bench/decode_attention.py --baseline), then the candidate
sed 's/^from \. import pdl$/from loopbench.kernels import pdl/' kernels/decode_attention.py > .scratch/da_head.py
git apply kernels/results/candidate_decode_attention_longctx.patch \
    || patch -p1 < kernels/results/candidate_decode_attention_longctx.patch
python3 -m pytest -q tests/kernels/test_decode_attention.py 2>&1 | tail -2
B="--no-sdpa --rep-ms 50 --baseline .scratch/da_head.py"
python3 kernels/bench/decode_attention.py --out "$OUT/da_longctx.md" --batches 16 32 64 \
    --contexts 128 256 1024 2048 4096 $B --variants base_native base_alias base_prefix prefix_nocap
python3 kernels/bench/decode_attention.py --out "$OUT/da_longctx_rep.md" --batches 16 32 64 --contexts 1024 4096 $B \
    --variants base_prefix base_native
cat "$OUT/da_longctx.md" "$OUT/da_longctx_rep.md"
