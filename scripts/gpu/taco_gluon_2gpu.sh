#!/usr/bin/env bash
# 2x H200, ~8 min: TACO's compressed collectives with the Gluon kernels (sessions 12-13) against NCCL bf16 at the
# three link classes, 1-256 MiB, INT8 (default format) and the paper's E4M3 at ~25 GB/s, CUDA-graph replays at
# ~25 GB/s; first every GPU test (the 2-GPU ones included).
# Usage (device machine, repo root): bash scripts/gpu/taco_gluon_2gpu.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests -p no:warnings 2>&1 | tail -3
SIZES=1024,4096,16384,32768,65536,262144
coll() {  # name, NCCL env..., then -- bench args
  local name=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 150 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives \
    --sizes-kib $SIZES "$@" --out $RES/taco_coll_gluon_$name.json 2>&1 | grep -v -i warn | tail -25
}
coll int8_nvlink NCCL_DEBUG=WARN -- --format int8
coll int8_p2p_off NCCL_P2P_DISABLE=1 -- --format int8 --cuda-graphs
coll e4m3_p2p_off NCCL_P2P_DISABLE=1 -- --format e4m3
coll int8_sockets NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 -- --format int8
