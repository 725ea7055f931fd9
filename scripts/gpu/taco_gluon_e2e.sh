#!/usr/bin/env bash
# 2x H200, ~7 min: TACO end to end at TP=2 with the Gluon kernels (sessions 12-13), each against the uncompressed
# baseline in the same run (bf16, dist-opt, local spec, seq 2048, MBS 4, GBS 16, mock data): GPT-1.3B with the
# default `auto` (start-up probe + in-loop trial) at ~25 GB/s and on NVLink; GPT-350M (host-bound) with `auto` +
# CUDA graphs at ~25 GB/s.
# Usage (device machine, repo root): bash scripts/gpu/taco_gluon_e2e.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
e2e() {  # model, link, variant
  timeout 200 python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/$1.yaml --links $2 \
    --micro-batch-size 4 --global-batch-size 16 --variants $3 --log-dir $RES/logs_$1_$2 \
    --out $RES/e2e_tp2_gluon_$1_$2.json 2>&1 | grep -E "speedup|Error|trial"
}
e2e gpt_1.3b p2p_off_25GBps taco_int8
e2e gpt_1.3b nvlink taco_int8
e2e gpt_350m p2p_off_25GBps taco_int8_auto_graphs
