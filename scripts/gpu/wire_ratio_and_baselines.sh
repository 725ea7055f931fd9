#!/usr/bin/env bash
# GPU call 3 (2x H200): wire ratio of the lossless parameter all-gather over a real GPT-125M training
# on text (DP=2, AdamW 0.9/0.95, wd 0.1, 20 warm-up iterations, constant lr), and the uncompressed
# GPT-350M / GPT-1.3B baselines of issue 2 (TP=1 x DP=2 and TP=2, bf16, distributed optimizer).
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
for run in delta:1e-4 delta:1e-5 ciera:1e-4; do
  codec=${run%%:*}; lr=${run##*:}
  torchrun --standalone --nproc-per-node 2 pretrain_gpt.py --config configs/gpt_125m.yaml --micro-batch-size 8 \
    --global-batch-size 16 --train-iters 150 --lr $lr --min-lr $lr --lr-decay-style constant --lr-warmup-iters 20 \
    --eval-interval 100000 --log-interval 50 --param-gather-compression $codec \
    --metrics-file $RES/wire_${codec}_lr$lr.jsonl > $RES/wire_${codec}_lr$lr.log 2>&1 || tail -30 $RES/wire_${codec}_lr$lr.log
  grep -E "iteration +150/" $RES/wire_${codec}_lr$lr.log | tail -1
done
for model in gpt_350m gpt_1.3b; do for suite in baseline_tp1 baseline_tp2; do
  python3 benchmarks/e2e_throughput.py --suite $suite --model configs/$model.yaml --links nvlink --log-dir $RES/logs \
    --micro-batch-size 4 --global-batch-size 16 --out $RES/${suite}_$model.json 2>&1 | tail -3
done; done
