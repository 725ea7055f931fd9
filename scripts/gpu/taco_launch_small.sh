#!/usr/bin/env bash
# 1x H200, ~2 min: TACO INT8 encode/decode launch configurations with fewer values per program (session 11): the
# encode reaches 0.61 / 0.67 / 0.69x of a bf16 copy at 16 / 64 / 256 MiB with 1024 values per one-warp program
# (8192 programs at 16 MiB, ~2 waves); 512 and 256 values per program give the SMs more, shorter programs.
# Device time, L2 flushed, bytes checked against the reference. Usage (device machine, repo root):
# bash scripts/gpu/taco_launch_small.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 240 python3 -m benchmarks.bench_taco_kernels --format int8 --sizes-mib 16,64,256 --reference-max-mib 0 \
  --launch 1024x1r64,512x1r64,512x1,256x1r64,1024x2r64,2048x2r64 --out $RES/taco_launch_small_int8.json 2>&1 | grep -E "^launch|goal"
