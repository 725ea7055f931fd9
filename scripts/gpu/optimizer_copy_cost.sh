#!/usr/bin/env bash
# One GPU: what megatron-core's fp32 -> bf16 copy at the end of each optimizer step (_copy_main_params_to_model_params,
# one copy_ per parameter) costs, from its own timer `optimizer-copy-main-to-model-params` (--timing-log-level 1: the
# device synchronised at start and stop, so host launches and device time together), beside the whole optimizer step,
# for GPT-125M, -350M and -1.3B with the distributed optimizer. With --delta-fused-cast the delta encode does that copy
# for the buckets it codes (docs/delta.md "Fused cast"), so this is what such a bucket's step no longer spends.
#   bash scripts/gpu/optimizer_copy_cost.sh      (results in $RES)
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
for model in gpt_125m gpt_350m gpt_1.3b; do
  timeout 200 torchrun --standalone --nproc-per-node 1 pretrain_gpt.py --config configs/$model.yaml \
    --builtin-corpus python-stdlib --tokenizer-type ByteTokenizer --use-distributed-optimizer \
    --micro-batch-size 1 --global-batch-size 1 --seq-length 512 --max-position-embeddings 2048 --train-iters 30 \
    --lr-warmup-iters 2 --log-interval 10 --eval-interval 1000 --eval-iters 0 --timing-log-level 1 \
    --metrics-file $RES/$model.jsonl > $RES/$model.log 2>&1
  echo "$model rc=$?"
  grep -A6 "time across ranks" $RES/$model.log | tail -6
done
