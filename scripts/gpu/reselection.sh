#!/usr/bin/env bash
# 2x H200, ~6 min: the benefit selection with device-time codec costs and re-selection (session 11; the meter's
# timing alone: scripts/gpu/delta_host_cost.sh). GPT-350M DP=2 with the gather exposed (MBS 4, GBS 8), at ~25 GB/s and on sockets, the default (delta) against delta on every bucket
# and the baseline: 50 iterations with --param-gather-reselect-interval 25 (first choice from iterations 1-8,
# the second from 26-33, each tried if it switches buckets), timed over iterations 42-50; then at ~25 GB/s the
# default as it ships (one choice in 50 iterations), timed over the same iterations.
# Usage (device machine, repo root): bash scripts/gpu/reselection.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
E2E="benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation --model configs/gpt_350m.yaml --micro-batch-size 4
  --global-batch-size 8 --train-iters 50 --warmup 41"
for link in p2p_off_25GBps sockets_4GBps; do
  timeout 240 python3 $E2E --links $link --variants delta_all delta --param-gather-reselect-interval 25 \
    --log-dir /tmp/reselect_$link --out $RES/e2e_reselect_$link.json 2>&1 | grep -E "speedup|Error"
done
timeout 150 python3 $E2E --links p2p_off_25GBps --variants delta --log-dir /tmp/once \
  --out $RES/e2e_choose_once_p2p_off_25GBps.json 2>&1 | grep -E "speedup|Error"
for d in /tmp/reselect_* /tmp/once; do echo "== $d"; grep -h "selection\|trial" $d/*.log | cut -c1-420; done > $RES/selection_lines.txt
mkdir -p $RES/metrics && for d in /tmp/reselect_* /tmp/once; do for f in $d/*.jsonl; do cp $f $RES/metrics/$(basename $d)_$(basename $f); done; done
