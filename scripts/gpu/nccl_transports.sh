#!/usr/bin/env bash
# 2x H200, ~1.5 min: benchmarks/diag_nccl_transports.py at the three link classes (NVLink, ~25 GB/s
# with NCCL_P2P_DISABLE=1, sockets with NCCL_SHM_DISABLE=1 as well): which NCCL transport moves TACO's
# wire fastest relative to the bf16 all-reduce it replaces.
# Usage (device machine, repo root): bash scripts/gpu/nccl_transports.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
run() {  # $1: tag, then env assignments
  local tag=$1; shift
  env "$@" timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/diag_nccl_transports.py \
    --out $RES/nccl_transports_$tag.json 2>&1 | grep -E "MiB|Error"
}
echo "== nvlink"; run nvlink NCCL_DEBUG=WARN
echo "== p2p_off"; run p2p_off NCCL_P2P_DISABLE=1
echo "== sockets"; run sockets NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
