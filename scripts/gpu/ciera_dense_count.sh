#!/usr/bin/env bash
# 1x H200, ~1.5 min: CIERA dense encodes with the changed-block count from the prefix sum (the first
# version's torch sum over the block flags took 23 us of a ~114 us encode): GPU tests, kernel throughput.
# Usage (device machine, repo root): bash scripts/gpu/ciera_dense_count.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 60 python3 -m pytest -q -m gpu tests/test_ciera.py 2>&1 | tail -2
timeout 120 python3 benchmarks/bench_ciera_kernels.py --out $RES/ciera_kernels_dense_count.json 2>&1 | grep -A6 "Device time only"
