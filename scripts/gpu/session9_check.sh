#!/usr/bin/env bash
# 2x H200, ~5 min: end-of-session check of main after the delta row kernels and the leaner gather path:
# every GPU test, the parameter gather (none, delta) at ~25 GB/s and NVLink, and GPT-350M DP=2 end to end
# at ~25 GB/s (Megatron's overlap on; delta with the default benefit selection and end-to-end trial, whose
# decisions the logs show; losses must stay bit-identical to the baseline).
# Usage (device machine, repo root): bash scripts/gpu/session9_check.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 200 python3 -m pytest -q -p no:warnings -m gpu tests/ 2>&1 | tail -2
NCCL_P2P_DISABLE=1 timeout 45 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py \
  --codecs none delta --out $RES/param_gather_delta_s9_p2p_off.json 2>&1 | grep -v -i warn | tail -3
timeout 30 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
  --out $RES/param_gather_delta_s9_nvlink.json 2>&1 | grep -v -i warn | tail -3
timeout 240 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather --model configs/gpt_350m.yaml \
  --links p2p_off_25GBps --variants delta --micro-batch-size 4 --global-batch-size 16 --params-checksum-interval 1 \
  --log-dir $RES/logs_s9 --out $RES/e2e_dp2_delta_s9_gpt_350m.json 2>&1 | grep -E "speedup|Error|identical"
grep -h "selection\|trial" $RES/logs_s9/*.log | sort | uniq -c | head -20
