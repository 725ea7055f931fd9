#!/usr/bin/env bash
# 2x H200, ~3 min. (1) TACO encode with the INT8 byte from one fused multiply-add, masked stores for
# non-finite blocks and 32-bit bf16 pair loads (840 SASS instructions per 1024-value program, was 912):
# GPU tests, then encode/decode vs a bf16 copy at 16/64/256 MiB. (2) One-sync parameter gathers A/B in
# one call: bench_param_gather on this tree, then with ONE_SYNC_PATCH applied (git diff main
# one-sync-gathers), ~25 GB/s and NVLink each.
# Usage (device machine, repo root): ONE_SYNC_PATCH=one_sync.patch bash scripts/gpu/taco_fma_and_one_sync_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 60 python3 -m pytest -q -m gpu tests/test_taco_kernels.py 2>&1 | tail -2
timeout 120 python3 -m benchmarks.bench_taco_kernels --format int8 --sizes-mib 16,64,256 --reference-max-mib 0 \
  --out $RES/taco_kernels_int8_fma.json 2>&1 | grep -v -i warn | tail -8
gathers() {  # $1: tag
  NCCL_P2P_DISABLE=1 timeout 45 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
    --out $RES/param_gather_$1_p2p_off.json 2>&1 | grep -v -i warn | tail -4
  timeout 30 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
    --out $RES/param_gather_$1_nvlink.json 2>&1 | grep -v -i warn | tail -4
}
echo "== main"; gathers main_ab
patch -p1 -s < ${ONE_SYNC_PATCH:?} || exit 1
timeout 40 python3 -m pytest -q -m gpu tests/test_ciera.py tests/test_delta.py 2>&1 | tail -2
echo "== one-sync"; gathers one_sync_ab
