#!/usr/bin/env bash
# 1x H200, ~2.5 min, on branch ciera-dense-sample: dense CIERA encodes count changed blocks on every 16th
# block only (compare mode then reads 1/16 of the previous exponents: ~4.06 bytes per value moved instead of
# 5), A/B in one call: GPU tests, then bench_ciera_kernels (compare and hash) on this tree and with main's
# code (MAIN_PATCH: `git diff ciera-dense-sample main -- kernels/ciera.py compression/ciera.py`).
# Merge the branch if its lr 1e-4 (dense) encode is faster and the others are not slower.
# Usage (device machine, repo root): MAIN_PATCH=main.patch bash scripts/gpu/ciera_dense_sample_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 120 python3 -m pytest -q -m gpu tests/test_ciera.py 2>&1 | tail -2
both() {  # $1: tag
  for mode in compare hash; do
    timeout 90 python3 benchmarks/bench_ciera_kernels.py --change-detect $mode --repeats 10 \
      --out $RES/ciera_kernels_${mode}_$1.json 2>&1 | grep -A5 "Device time only"
  done
}
echo "== sampled dense count"; both dense_sample
patch -p1 -s < ${MAIN_PATCH:?} || exit 1
echo "== every block counted (main)"; both main
