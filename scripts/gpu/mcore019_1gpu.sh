#!/usr/bin/env bash
# One GPU, megatron-core 0.19.2 (the newest release for Python 3.12; every other GPU result ran 0.16.1): the CUDA paths
# of the driver under it. The GPU tests and the Megatron-LM flags' CUDA paths (smoke_flags_1gpu.sh: NCCL backend, NaN
# check, memory and timer logging, a save without optimizer state and a load of it), synchronous and asynchronous
# checkpoints resumed bit for bit beside the uninterrupted run, multi-token prediction (smoke_ckpt_mtp_1gpu.sh), and a
# short OLMoE-shaped MoE run (2 layers, 64 experts top-8, EP=1) whose loss must fall.
#   bash scripts/gpu/mcore019_1gpu.sh      (carry .whl019 holding the megatron-core 0.19.2 wheel; results in $RES)
set -uo pipefail
export WHEELS=${WHEELS:-.whl019}
bash scripts/gpu/smoke_flags_1gpu.sh
MODES="sync async" MTP=1 GPU_TESTS=0 bash scripts/gpu/smoke_ckpt_mtp_1gpu.sh
source scripts/gpu/setup_device.sh || exit 1
timeout 240 torchrun --standalone --nproc-per-node 1 pretrain_moe.py --config configs/olmoe_1b_7b.yaml --num-layers 2 \
  --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 4 --train-iters 30 \
  --lr-warmup-iters 2 --log-interval 10 --eval-interval 1000 --eval-iters 0 --builtin-corpus python-stdlib \
  --tokenizer-type ByteTokenizer --metrics-file $RES/moe.jsonl > $RES/moe.log 2>&1
echo "moe rc=$?"
python3 - <<'PY'
import json
rows = [json.loads(line) for line in open("/tmp/res/moe.jsonl")]
print("moe iterations", len(rows), "loss", round(rows[0]["loss"], 4), "->", round(rows[-1]["loss"], 4),
      "median tokens/s", round(sorted(r["tokens_per_s"] for r in rows[10:])[len(rows[10:]) // 2]))
PY
