#!/usr/bin/env bash
# Session 4 of 2026-11-30 (~5 min on 2x H200): the codecs' device-time-only throughput (CIERA, delta;
# PyTorch profiler, no launch gaps or host syncs), then TACO end to end with the default `auto` (probe +
# trial) plus --tp-comm-cuda-graphs for GPT-350M at ~25 GB/s, and `auto` for GPT-350M on NVLink.
# Usage (device machine, repo root): bash scripts/gpu/graphs_auto_and_device_time.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 40 python3 -m pytest -q -m gpu tests/test_timing.py 2>&1 | tail -1
timeout 60 python3 benchmarks/bench_ciera_kernels.py --repeats 8 --out $RES/ciera_kernels_device_time.json 2>&1 | grep -A8 "Device time only"
timeout 60 python3 benchmarks/bench_delta_kernels.py --repeats 8 --out $RES/delta_kernels_device_time.json 2>&1 | grep "device time only"
timeout 130 python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_350m.yaml --links p2p_off_25GBps \
  --micro-batch-size 4 --global-batch-size 16 --variants taco_int8_auto_graphs --log-dir $RES/logs_auto_graphs \
  --out $RES/e2e_tp2_taco_auto_graphs_gpt_350m.json 2>&1 | grep -E "speedup|Error"
timeout 110 python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_350m.yaml --links nvlink \
  --micro-batch-size 4 --global-batch-size 16 --variants taco_int8 --log-dir $RES/logs_auto_nvlink \
  --out $RES/e2e_tp2_taco_auto_nvlink_gpt_350m.json 2>&1 | grep -E "speedup|Error"
grep -h "trial\|probe" $RES/logs_auto_*/*.log | sort | uniq -c | head
