#!/usr/bin/env bash
# TACO on 2x H200 in one call: GPU kernel tests, kernel throughput, compressed collectives vs NCCL over
# NVLink and over PCIe/host paths (NCCL_P2P_DISABLE=1), and the AUTO crossover sizes.
# Usage (device machine, repo root): bash scripts/gpu/taco_kernels.sh. Results land in $OUT; logs in
# $OUT/taco_gpu.log.
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
{
  python3 -m pytest -q -m gpu tests/test_taco_kernels.py tests/test_tp_collectives.py 2>&1 | tail -15
  python3 -m benchmarks.bench_taco_kernels --sizes-mib 1,4,16,64,256 --out $OUT/taco_kernels.json
  torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives --out $OUT/taco_coll_nvlink.json
  NCCL_P2P_DISABLE=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives \
    --out $OUT/taco_coll_p2p_disabled.json
} 2>&1 | tee $OUT/taco_gpu.log
