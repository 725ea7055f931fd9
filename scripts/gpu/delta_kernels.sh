#!/usr/bin/env bash
# Lossless delta codec on one H200 in one call: the CUDA kernel test (payload bytes and decoded bits
# equal to the PyTorch reference), then encode/decode throughput of a steady-state AdamW step at
# 62.5M bf16 values vs a bf16 copy, with a warps-per-program sweep; the table comes last.
# Usage (device machine, repo root): bash scripts/gpu/delta_kernels.sh [WARPS_SWEEP], e.g. 2,4.
# Results: $RES/delta_kernels.json and $RES/delta_gpu.log (back as results.tgz).
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
sweep=${1:-2,4}
{
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
  timeout 150 python3 -m pytest -q -x -m gpu tests/test_delta.py 2>&1 | tail -25
  timeout 150 python3 benchmarks/bench_delta_kernels.py --warps "$sweep" --out $RES/delta_kernels.json 2>&1 \
    | grep -v -i warn
} 2>&1 | tee $RES/delta_gpu.log
