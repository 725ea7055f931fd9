#!/usr/bin/env bash
# 2x H200, ~3 min: main at the end of session 8 (register caps only where they do not spill): every GPU test,
# the TACO INT8 kernels by device time, and the one-shot all-reduce at ~25 GB/s against NCCL bf16.
# Usage (device machine, repo root): bash scripts/gpu/session8_check.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 200 python3 -m pytest -q -m gpu tests/ -p no:warnings 2>&1 | tail -2
timeout 100 python3 -m benchmarks.bench_taco_kernels --format int8 --sizes-mib 16,64,256 --reference-max-mib 0 \
  --out $RES/taco_kernels_int8_s8.json 2>&1 | tail -6
NCCL_P2P_DISABLE=1 timeout 100 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives --format int8 \
  --all-reduce one-shot --sizes-kib 16384,65536,262144 --iters 10 --out $RES/taco_coll_s8_one-shot_p2p_off.json 2>&1 \
  | grep -E "^ *(all_reduce|reduce_scatter|all_gather)|op " | head -12
