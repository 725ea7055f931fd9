#!/usr/bin/env bash
# 2x H200, ~5 min: where the exposed parameter gather's time goes (scripts/gpu/exposed_gather.sh measured delta
# 0.830x and CIERA 0.842x of the baseline there): GPT-350M DP=2 at ~25 GB/s, one micro-batch per rank, the gather
# not overlapped; the PyTorch profiler (with Python stacks) on rank 0 over iterations 18-19 of baseline,
# delta on every bucket and CIERA on every bucket; benchmarks/trace_gaps.py summarizes each trace
# (GPU idle gaps charged to the host code that launched the work after them; host blocking calls).
# Usage (device machine, repo root): bash scripts/gpu/exposed_gather_profile.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
PROFILE="--profile --use-pytorch-profiler --profile-step-start 18 --profile-step-end 20 --pytorch-profiler-collect-callstack"
timeout 420 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation --model configs/gpt_350m.yaml \
  --links p2p_off_25GBps --variants ${VARIANTS:-delta_all ciera_reuse} --micro-batch-size 1 --global-batch-size 2 \
  --train-iters 20 --warmup 12 $PROFILE --log-dir /tmp/prof --out $RES/e2e_exposed_profile_gpt_350m.json 2>&1 \
  | grep -E "speedup|Error"
for trace in /tmp/prof/*.trace_rank0.json; do
  name=$(basename $trace .trace_rank0.json)
  echo "=== $name"; python3 benchmarks/trace_gaps.py $trace --top 12 | tee $RES/$name.gaps.txt
  cp /tmp/prof/$name.profile_rank0.txt /tmp/prof/$name.jsonl $RES/
  gzip -c $trace > /tmp/prof/$name.trace.json.gz
  [ $(stat -c %s /tmp/prof/$name.trace.json.gz) -lt 15000000 ] && cp /tmp/prof/$name.trace.json.gz $OUT/
done
ls -la $OUT
