#!/usr/bin/env bash
# Prepared in session 3 of 2026-11-30 for the next GPU session (~8 min on 2x H200): the parameter-gather
# codecs end to end with the defaults (benefit selection + the end-to-end trial, iterations 11-16; timed
# 17-22), GPT-350M DP=2 with Megatron's overlap, at the three link classes; the logs say what the
# selection and the trial decided, and the losses must stay bit-identical to the baseline.
# Usage (device machine, repo root): bash scripts/gpu/param_gather_trial.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 460 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather --model configs/gpt_350m.yaml \
  --links nvlink p2p_off_25GBps sockets_4GBps --variants ciera delta --micro-batch-size 4 --global-batch-size 16 \
  --params-checksum-interval 1 --log-dir $RES/logs_trial --out $RES/e2e_dp2_param_gather_trial_gpt_350m.json 2>&1 \
  | grep -E "speedup|Error"
grep -h "selection\|trial" $RES/logs_trial/*.log | sort | uniq -c | head -20
