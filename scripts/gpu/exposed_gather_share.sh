#!/usr/bin/env bash
# 2x H200, ~45 s per run: the parameter gather exposed (--no-overlap-param-gather) with the GPU, not the host,
# setting the pace: GPT-350M DP=2, one micro-batch of 4 x 2048 tokens per rank (at one sequence per rank the
# iteration is host-bound: scripts/gpu/exposed_gather_profile.sh found the device idle 70% of it, and the
# exposed speedups moved by +-20% between calls). --comm-profile profiles the last two iterations of every run
# (untimed): the baseline's all-gather share and each variant's bound. Losses must be bit-identical (the logs).
# Usage (device machine, repo root): LINKS="p2p_off_25GBps sockets_4GBps" VARIANTS="delta_all ciera_reuse delta" \
#   bash scripts/gpu/exposed_gather_share.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
for link in ${LINKS:-p2p_off_25GBps sockets_4GBps}; do
  timeout ${TIMEOUT:-280} python3 benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation --model configs/gpt_350m.yaml \
    --links $link --variants ${VARIANTS:-delta_all ciera_reuse delta} --micro-batch-size 4 --global-batch-size 8 \
    --train-iters 30 --warmup 16 --comm-profile --log-dir /tmp/share --out $RES/e2e_exposed_share_${link}_gpt_350m.json \
    2>&1 | grep -E "speedup|Error"
done
cp /tmp/share/*.jsonl /tmp/share/*.log $RES/ 2>/dev/null
for f in /tmp/share/*.jsonl; do echo "$(basename $f): $(grep -o '"loss": [0-9.e+-]*' $f | tail -2 | tr '\n' ' ')"; done
grep -h "selection\|trial" /tmp/share/*.log | head -20
