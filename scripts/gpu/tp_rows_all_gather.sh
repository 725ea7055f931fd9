#!/usr/bin/env bash
# 2x H200, ~2.5 min: TACO's reduce-scatter and two-shot all-reduce with their row exchange as an
# all-gather of the peer's row (compression/transport.py; was an all-to-all) at ~25 GB/s and on sockets,
# INT8, 16/64/256 MiB, against NCCL bf16 in the same run.
# Usage (device machine, repo root): bash scripts/gpu/tp_rows_all_gather.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
for link in p2p_off sockets; do
  env="NCCL_P2P_DISABLE=1"; [ $link = sockets ] && env="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
  env $env timeout 100 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives --format int8 \
    --all-reduce two-shot --sizes-kib 16384,65536,262144 --iters 10 \
    --out $RES/taco_coll_rows_all_gather_$link.json 2>&1 | grep -E "^ *(all_reduce|reduce_scatter|all_gather)|op " | head -12
done
