#!/usr/bin/env bash
# Session 3 of 2026-11-30 (2x H200, ~5.5 min): CIERA's ablation (exponent reuse alone, + benefit selection,
# + overlap) and delta, GPT-350M DP=2 at ~4 GB/s (sockets), the parameter gather exposed unless a variant
# overlaps it; Megatron's --overlap-grad-reduce in every run.
# Usage (device machine, repo root): bash scripts/gpu/param_gather_ablation.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 340 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation --model configs/gpt_350m.yaml \
  --links sockets_4GBps --micro-batch-size 4 --global-batch-size 16 --train-iters 14 --warmup 10 \
  --log-dir $RES/logs_ablation --out $RES/e2e_dp2_param_gather_ablation_gpt_350m.json 2>&1 | grep -E "speedup|Error"
grep -h "selection" $RES/logs_ablation/*.log | sort | uniq -c | head
