#!/usr/bin/env bash
# 2x H200, ~1.5 min: the parameter all-gathers with one waiting host sync each. Delta and CIERA (raw
# exponents) leave their payload sizes and headers on the device (begin_encode) until the gather's size
# exchange and write the payload straight into the send buffer (finish_encode); the counts finish_encode
# needs come back by non-blocking copies, and headers go up from pinned memory (a pageable .to(device)
# waits for the stream). GPU tests, then ~25 GB/s and NVLink against NCCL bf16 in the same run; the JSON
# goes straight to $OUT (it comes back even if the call is cut short).
# Usage (device machine, repo root): bash scripts/gpu/one_sync_gathers.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 40 python3 -m pytest -q -m gpu tests/test_ciera.py tests/test_delta.py 2>&1 | tail -2
NCCL_P2P_DISABLE=1 timeout 45 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
  --out $OUT/param_gather_one_sync_p2p_off.json 2>&1 | grep -v -i warn | tail -4
timeout 30 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
  --out $OUT/param_gather_one_sync_nvlink.json 2>&1 | grep -v -i warn | tail -4
