#!/usr/bin/env bash
# For the next GPU session (~6 min on 2x H200): issue 4's MoE end to end at the size two GPUs allow: an
# OLMoE-shaped MoE (configs/olmoe_1b_7b.yaml: 64 experts top-8, hidden 2048) cut to 4 layers and seq 2048,
# DP=2 with EP=1 so that dense and expert buckets are gathered over DP=2, distributed optimizer and
# Megatron's overlap, param-gather compression none / ciera / delta (benefit selection + trial, the
# defaults) at the three link classes; loss bits and parameter checksums must equal the baseline's.
# Usage (device machine, repo root): bash scripts/gpu/moe_dp2_param_gather.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 500 python3 benchmarks/e2e_throughput.py --suite dp2_moe_param_gather --model configs/olmoe_1b_7b.yaml \
  --links nvlink p2p_off_25GBps sockets_4GBps --variants ciera delta --num-layers 4 --seq-length 2048 --max-position-embeddings 2048 \
  --micro-batch-size 1 --global-batch-size 8 --params-checksum-interval 1 --log-dir $RES/logs_moe \
  --out $RES/e2e_dp2_moe_param_gather_olmoe_4l.json 2>&1 | grep -E "speedup|Error"
grep -h "selection\|trial" $RES/logs_moe/*.log | sort | uniq -c | head -20
