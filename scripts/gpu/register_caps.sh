#!/usr/bin/env bash
# 1x H200, ~2 min: register caps (PTX .maxnreg) for the one-warp delta kernels, by device time. A one-warp
# program runs at most 32 per SM; the delta encoder (122 registers) fits 16, its decoder (70) 28
# (cuobjdump -res-usage of the sm_90 builds); every decode checked bit for bit. (Session 8 ran this with the
# plain-Triton TACO kernels' caps too; the Gluon TACO kernels need none.)
# Usage (device machine, repo root): bash scripts/gpu/register_caps.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests/test_delta.py 2>&1 | tail -2
timeout 200 python3 benchmarks/bench_delta_kernels.py --max-registers 96:0,80:0,0:64,0:56 \
  --out $RES/delta_register_caps.json 2>&1 | grep "device time only"
