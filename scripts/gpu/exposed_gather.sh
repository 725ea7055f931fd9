#!/usr/bin/env bash
# 2x H200, ~5 min: the parameter gather exposed (--no-overlap-param-gather; configs/gpt_350m.yaml turns the
# overlap on, and the session-5 ablation, which only left the flag out, ran with it), GPT-350M DP=2 at ~25
# GB/s with one micro-batch of 2048 tokens per rank, so that the gather is a visible share of the iteration:
# baseline, delta on every bucket, CIERA on every bucket. Losses must be bit-identical (the logs).
# Usage (device machine, repo root): bash scripts/gpu/exposed_gather.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 300 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation --model configs/gpt_350m.yaml \
  --links p2p_off_25GBps --variants delta_all ciera_reuse --micro-batch-size 1 --global-batch-size 2 \
  --log-dir $RES/logs_exposed --out $RES/e2e_dp2_exposed_gather_gpt_350m.json 2>&1 | grep -E "speedup|Error"
for f in $RES/logs_exposed/*.jsonl; do echo "$(basename $f): $(grep -o '"loss": [0-9.e+-]*' $f | tail -3 | tr '\n' ' ')"; done
