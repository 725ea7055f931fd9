#!/usr/bin/env bash
# 1x H200, ~2 min, on branch ciera-fused-hash: CIERA's hash mode with the block hashes computed in the split
# kernel (was: block_hashes in torch, many passes over the exponents), A/B in one call: GPU tests, then
# bench_ciera_kernels --change-detect hash on this tree and with main's hash path (MAIN_PATCH: `git diff
# ciera-fused-hash main -- kernels/ciera.py compression/ciera.py`), and compare mode for reference.
# Merge the branch if its hash-mode encode is faster (it should be: 744 vs 448 SASS instructions per
# 4096-value program against ~10 torch passes).
# Usage (device machine, repo root): MAIN_PATCH=main.patch bash scripts/gpu/ciera_fused_hash_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 90 python3 -m pytest -q -m gpu tests/test_ciera.py 2>&1 | tail -2
timeout 120 python3 benchmarks/bench_ciera_kernels.py --change-detect hash --out $RES/ciera_kernels_fused_hash.json 2>&1 | grep -A6 "Device time only"
timeout 120 python3 benchmarks/bench_ciera_kernels.py --out $RES/ciera_kernels_compare.json 2>&1 | grep -A6 "Device time only"
patch -p1 -s < ${MAIN_PATCH:?} || exit 1
timeout 120 python3 benchmarks/bench_ciera_kernels.py --change-detect hash --out $RES/ciera_kernels_torch_hash.json 2>&1 | grep -A6 "Device time only"
