#!/usr/bin/env bash
# The main job of the README: a small GPT trained on CPU with TP=2 x PP=2 x DP=2 (8 processes) on real
# text (the Python standard library's sources, byte-tokenized) with the distributed optimizer.
# A couple of minutes on 2 cores. Metrics: runs/main/metrics.jsonl (one JSON object per iteration).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh

# TACO on every TP collective (min-bytes 0: on gloo/CPU the 'auto' probe would find that compression
# never pays, and this job is here to show it working) and the lossless delta code on the distributed
# optimizer's parameter all-gather (bf16 params: the lossless codecs carry 16-bit values; selection
# 'all' for the same reason: 'benefit' would keep gloo's fast loopback gathers uncompressed).
# COMPRESSION_FLAGS="" gives stock megatron-core.
COMPRESSION_FLAGS=${COMPRESSION_FLAGS-"--bf16 --tp-comm-compression taco --tp-comm-compression-min-bytes 0 --param-gather-compression delta --param-gather-selection all --param-gather-verify-interval 25"}

OUT=${OUT:-runs/main}
mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore

# shellcheck disable=SC2086  # COMPRESSION_FLAGS is a list of flags
.venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 8 pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --micro-batch-size 4 --global-batch-size 32 --train-iters 100 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.01 --clip-grad 1.0 \
  --hidden-dropout 0 --attention-dropout 0 --no-bias-gelu-fusion --no-bias-dropout-fusion \
  --transformer-impl local --builtin-corpus python-stdlib --tokenizer-type ByteTokenizer \
  --log-interval 10 --eval-interval 50 --eval-iters 4 --params-checksum-interval 50 \
  --metrics-file "$OUT/metrics.jsonl" \
  $COMPRESSION_FLAGS "$@"
