#!/usr/bin/env bash
# 1x H200, ~2 min, on branch ciera-hash-compare-in-kernel: CIERA hash mode compares the block hashes in
# the split kernel (was: torch ops over the new and previous hashes), A/B in one call: GPU tests, then
# bench_ciera_kernels --change-detect hash on this tree and with main's code (MAIN_PATCH: `git diff
# ciera-hash-compare-in-kernel main -- kernels/ciera.py compression/ciera.py`).
# Usage (device machine, repo root): MAIN_PATCH=main.patch bash scripts/gpu/ciera_hash_compare_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 100 python3 -m pytest -q -m gpu tests/test_ciera.py -p no:warnings 2>&1 | tail -1
timeout 80 python3 benchmarks/bench_ciera_kernels.py --change-detect hash --repeats 8 \
  --out $RES/ciera_kernels_hash_in_kernel.json 2>&1 | grep -A5 "Device time only"
patch -p1 -s < ${MAIN_PATCH:?} || exit 1
timeout 80 python3 benchmarks/bench_ciera_kernels.py --change-detect hash --repeats 8 \
  --out $RES/ciera_kernels_hash_torch_compare.json 2>&1 | grep -A5 "Device time only"
