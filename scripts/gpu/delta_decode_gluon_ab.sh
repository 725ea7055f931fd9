#!/usr/bin/env bash
# 1x H200, ~4 min: the delta decoder written in Gluon (tree GL, DELTA_DECODE_GLUON=1, DELTA_DECODE_NBLK blocks
# per program) against this tree's Triton decoder, in rounds: GPU tests of the Gluon tree, then
# bench_delta_kernels.py (62.5M values, B=256, lr 1e-4 and 1e-5, device time vs a bf16 copy; every decode checked).
# The GL tree of session 14: mkdir -p .cache/delta_gl && git archive c33bcbc kernels compression benchmarks tests |
# tar -x -C .cache/delta_gl && (cd .cache/delta_gl && patch -p1 < ../../results/gpu/session14/delta_decode_gluon.patch)
# Usage (device machine, repo root): GL=.cache/delta_gl bash scripts/gpu/delta_decode_gluon_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
(cd ${GL:?} && PYTHONPATH=/tmp/site:$PWD DELTA_DECODE_GLUON=1 timeout 200 python3 -m pytest -q -m gpu tests/test_delta.py \
  -p no:warnings 2>&1 | tail -2)
for round in 1 2; do
  echo "== triton $round"
  timeout 150 python3 benchmarks/bench_delta_kernels.py --repeats 10 --out $RES/delta_triton$round.json 2>&1 | grep -A4 "^| lr"
  for nblk in 1 2; do
    echo "== gluon nblk $nblk $round"
    (cd $GL && PYTHONPATH=/tmp/site:$PWD DELTA_DECODE_GLUON=1 DELTA_DECODE_NBLK=$nblk timeout 150 python3 \
      benchmarks/bench_delta_kernels.py --repeats 10 --out $RES/delta_gluon_nblk${nblk}_$round.json 2>&1 | grep -A4 "^| lr")
  done
done
