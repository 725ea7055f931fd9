#!/usr/bin/env bash
# 2x H200, ~6 min: the runs of delta_fused_buckets.sh (E2E=1) and taco_gluon_e2e.sh again with --comm-profile, so
# each compressed run's bound comes from its own baseline's measured communication share (last two iterations
# profiled, left out of the timing): GPT-350M DP=2 with the parameter gather exposed (default delta) on sockets and
# at ~25 GB/s (DELTA_LINKS: also nvlink for the issue's three link classes); GPT-1.3B TP=2 with TACO INT8 `auto` at
# ~25 GB/s.
# Usage (device machine, repo root): [DELTA_LINKS="nvlink sockets_4GBps p2p_off_25GBps"] bash scripts/gpu/comm_share_2gpu.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
links=${DELTA_LINKS:-sockets_4GBps p2p_off_25GBps}
timeout $((150 * $(wc -w <<< "$links"))) python3 benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation \
  --model configs/gpt_350m.yaml --links $links --variants delta --micro-batch-size 4 --global-batch-size 8 --train-iters 50 \
  --warmup 41 --param-gather-reselect-interval 25 --comm-profile --log-dir /tmp/share_logs/delta \
  --out $RES/e2e_exposed_delta_share.json 2>&1 | grep -E "speedup|Error"
timeout 200 python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_1.3b.yaml --links p2p_off_25GBps \
  --micro-batch-size 4 --global-batch-size 16 --variants taco_int8 --comm-profile --log-dir /tmp/share_logs/taco \
  --out $RES/e2e_tp2_taco_share_gpt_1.3b.json 2>&1 | grep -E "speedup|Error"
# the profiler traces stay behind (session 15 call 4: with them the archive was over the tool's size limit)
(cd /tmp/share_logs && find . \( -name "*.jsonl" -o -name "*.log" \) -exec cp --parents {} $RES/ \;)
