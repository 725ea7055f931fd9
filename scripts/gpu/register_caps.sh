#!/usr/bin/env bash
# 1x H200, ~4 min: register caps (PTX .maxnreg) for the one-warp codec kernels, by device time. A one-warp
# program runs at most 32 per SM; TACO's encode (71 registers) fits 28, the delta encoder (122) 16, its
# decoder (70) 28 (cuobjdump -res-usage of the sm_90 builds). TACO INT8 launch configurations with caps
# against a bf16 copy (L2 flushed, bytes checked against the reference), then the delta kernels with caps
# (every decode checked bit for bit).
# Usage (device machine, repo root): bash scripts/gpu/register_caps.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests/test_taco_kernels.py tests/test_delta.py 2>&1 | tail -2
timeout 200 python3 -m benchmarks.bench_taco_kernels --format int8 --sizes-mib 16,64,256 --reference-max-mib 0 \
  --launch 1024x1,1024x1r64,1024x1r56,2048x1r64,2048x1r80 --out $RES/taco_register_caps_int8.json 2>&1 | grep -E "^launch|goal"
timeout 200 python3 benchmarks/bench_delta_kernels.py --max-registers 96:0,80:0,0:64,0:56 \
  --out $RES/delta_register_caps.json 2>&1 | grep "device time only"
