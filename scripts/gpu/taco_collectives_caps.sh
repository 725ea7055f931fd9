#!/usr/bin/env bash
# 2x H200, ~2.5 min: TACO INT8 collectives with the register-capped kernels (session 8) at ~25 GB/s (one-shot
# and two-shot all-reduce) and on sockets (one-shot), 16/64/256 MiB, against NCCL bf16 in the same run.
# Usage (device machine, repo root): bash scripts/gpu/taco_collectives_caps.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
run() {  # $1: link, $2: all-reduce
  env="NCCL_P2P_DISABLE=1"; [ $1 = sockets ] && env="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
  env $env timeout 100 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives --format int8 \
    --all-reduce $2 --sizes-kib 16384,65536,262144 --iters 10 \
    --out $RES/taco_coll_caps_$2_$1.json 2>&1 | grep -E "^ *(all_reduce|reduce_scatter|all_gather)|op " | head -12
}
run p2p_off one-shot; run p2p_off two-shot; run sockets one-shot
