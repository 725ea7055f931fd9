#!/usr/bin/env bash
# 2x H200, ~3 min: the parameter all-gathers with one host sync each. Delta and CIERA (raw exponents) now
# leave their payload sizes and headers on the device (begin_encode) until the gather's size exchange, the
# only sync, and write the payload straight into the send buffer (finish_encode); before, each encode
# synchronised on its own first (session 6: delta 2.57 ms vs NCCL 5.02 ms at ~25 GB/s). GPU tests first,
# then ~25 GB/s with a profiled gather per codec, then NVLink.
# Usage (device machine, repo root): bash scripts/gpu/one_sync_gathers.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 60 python3 -m pytest -q -m gpu tests/test_ciera.py tests/test_delta.py 2>&1 | tail -2
NCCL_P2P_DISABLE=1 timeout 80 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
  --profile-dir $RES/profile_one_sync_p2p_off --out $RES/param_gather_one_sync_p2p_off.json 2>&1 | grep -v -i warn | tail -5
timeout 50 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
  --out $RES/param_gather_one_sync_nvlink.json 2>&1 | grep -v -i warn | tail -5
