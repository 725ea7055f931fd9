#!/usr/bin/env bash
# GPU call 4 (2x H200): end-to-end speed of TACO (TP=2) and of the lossless parameter all-gather
# (DP=2), each against the uncompressed baseline measured in the same run, by link class.
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
save() { tar czf $OUT/results.tgz -C $RES .; }
common="--links nvlink p2p_off_25GBps --micro-batch-size 4 --global-batch-size 16 --log-dir $RES/logs"
python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_1.3b.yaml $common --out $RES/e2e_tp2_taco_gpt_1.3b.json 2>&1 | grep -E "speedup|Error"; save
python3 benchmarks/e2e_throughput.py --suite dp2_param_gather --model configs/gpt_350m.yaml --links sockets_4GBps p2p_off_25GBps \
  --micro-batch-size 4 --global-batch-size 16 --log-dir $RES/logs --out $RES/e2e_dp2_param_gather_gpt_350m.json 2>&1 | grep -E "speedup|Error"; save
python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_350m.yaml $common --out $RES/e2e_tp2_taco_gpt_350m.json 2>&1 | grep -E "speedup|Error"; save
