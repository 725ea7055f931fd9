#!/usr/bin/env bash
# Session 3 of 2026-11-30 (2x H200, ~4 min): the delta format-3 kernels with rows stored at a 24-byte
# stride (no byte tile in the encoder): CUDA exactness, throughput over a sweep of tile sizes and warps,
# and the parameter all-gather at ~25 GB/s and NVLink.
# Usage (device machine, repo root): bash scripts/gpu/delta_v3_tiles.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests/test_delta.py 2>&1 | tail -2
timeout 200 python3 benchmarks/bench_delta_kernels.py --configs 256:1,512:2,1024:4,2048:8,4096:8 \
  --out $RES/delta_kernels_v3_tiles.json 2>&1 | grep -E "^\||Error"
for link in nvlink p2p_off; do
  env=""; [ $link = p2p_off ] && env="NCCL_P2P_DISABLE=1"
  env $env timeout 80 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
    --out $RES/param_gather_v3_rows_$link.json 2>&1 | grep -v -i warn | tail -3
done
