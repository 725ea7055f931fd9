#!/usr/bin/env bash
# 1x H200, ~1.5 min: TACO INT8 encode/decode launch configurations (values per program x warps) by device
# time against a bf16 copy (L2 flushed), each checked byte for byte against the reference.
# Usage (device machine, repo root): bash scripts/gpu/taco_launch_sweep.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 200 python3 -m benchmarks.bench_taco_kernels --format int8 --sizes-mib 16,64,256 --reference-max-mib 0 \
  --launch 512x1,1024x1,2048x1,1024x2,2048x2,2048x4,4096x4,4096x8 --out $RES/taco_launch_sweep_int8.json 2>&1 | grep -E "^launch|goal"
