#!/usr/bin/env bash
# 2x H200, ~2 min: where the delta parameter all-gather's time goes at ~25 GB/s. Session 5 measured 2.56 ms
# against ~1.0 ms of codec device time and ~0.3 ms of wire (param_gather_delta_atomic_p2p_off.json): the
# profiled gather (PyTorch profiler, host and device) shows the syncs, launches and NCCL calls in between.
# Usage (device machine, repo root): bash scripts/gpu/delta_gather_profile.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
NCCL_P2P_DISABLE=1 timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
  --profile-dir $RES/profile_delta_gather_p2p_off --out $RES/param_gather_delta_profiled_p2p_off.json 2>&1 | grep -v -i warn | tail -4
head -30 $RES/profile_delta_gather_p2p_off/delta_rank0.txt
