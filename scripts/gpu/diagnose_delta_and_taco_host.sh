#!/usr/bin/env bash
# Session 3 of 2026-11-30 (2x H200, ~2 min): device time of the delta encoder's building blocks, and a PyTorch
# profile (iterations 10-11) of GPT-350M TP=2 at ~25 GB/s, baseline vs TACO INT8 with every TP tensor compressed.
# (benchmarks/diag_delta_primitives.py timed the per-value encoder; removed with the row kernels, see git history.)
# Usage (device machine, repo root): bash scripts/gpu/diagnose_delta_and_taco_host.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 200 python3 benchmarks/diag_delta_primitives.py 2>&1 | grep -v Warn | tail -40
common="--config configs/gpt_350m.yaml --bf16 --transformer-impl local --use-distributed-optimizer --mock-data --lr-warmup-iters 2 --log-interval 1 --eval-iters 0 --eval-interval 1000000 --tensor-model-parallel-size 2 --train-iters 12 --micro-batch-size 4 --global-batch-size 16 --profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12"
for v in baseline taco; do
  extra=""; [ $v = taco ] && extra="--tp-comm-compression taco --taco-format int8 --tp-comm-compression-min-bytes 0 --tp-comm-compression-trial-iters 0"
  NCCL_P2P_DISABLE=1 timeout 120 torchrun --standalone --nproc-per-node 2 pretrain_gpt.py $common $extra \
    --metrics-file $RES/prof_$v/m.jsonl > $RES/prof_$v.log 2>&1
  rm -f $RES/prof_$v/trace_rank0.json
  cut -c1-220 $RES/prof_$v/profile_rank0.txt | head -45
done
