#!/usr/bin/env bash
# One GPU (session 17): every GPU test, then the CUDA path of multi-latent attention on the local spec
# (megatron/hooks/mla.py) and of --squared-relu / --quick-geglu in short GPT-125M-shaped bf16 runs, each beside
# the plain GPT-125M run for tokens/s; MLA with DeepSeek-V2-Lite's head sizes (no query latent, kv latent 512,
# qk 128 + rotary 64, v 128), saved and resumed with --use-checkpoint-args; then a tiny MLA MoE (DeepSeek-style).
#   bash scripts/gpu/smoke_mla_1gpu.sh          (results in $RES, back as results.tgz)
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | grep -E "passed|failed|error" | tee $RES/gpu_tests.txt
common="--config configs/gpt_125m.yaml --transformer-impl local --bf16 --micro-batch-size 4 --global-batch-size 8
  --seq-length 1024 --max-position-embeddings 1024 --lr-warmup-iters 2 --log-interval 10 --eval-interval 1000
  --eval-iters 0 --no-check-for-nan-in-loss-and-grad"
mla="--multi-latent-attention --position-embedding-type rope --kv-lora-rank 512 --qk-head-dim 128
  --qk-pos-emb-head-dim 64 --v-head-dim 128 --normalization RMSNorm"
run() {  # name, flags...
  local name=$1; shift
  torchrun --standalone --nproc-per-node 1 pretrain_gpt.py $common "$@" --metrics-file $RES/$name.jsonl \
    > $RES/$name.log 2>&1; echo "$name rc=$?"; grep -E "iteration +(20|30)/" $RES/$name.log | cut -c1-220
}
run plain --train-iters 30
run mla --train-iters 30 $mla --save $RES/ckpt --save-interval 30
run mla_resumed --train-iters 34 --override-opt_param-scheduler --load $RES/ckpt --use-checkpoint-args --log-interval 2
run mla_q_latent --train-iters 30 $mla --q-lora-rank 384
run squared_relu --train-iters 30 --squared-relu
run quick_geglu --train-iters 30 --quick-geglu
rm -rf $RES/ckpt  # checkpoints stay on the machine
torchrun --standalone --nproc-per-node 1 pretrain_moe.py --config configs/tiny_cpu_moe.yaml --transformer-impl local \
  --bf16 $mla --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 16 --v-head-dim 16 --train-iters 20 \
  --log-interval 10 --eval-interval 1000 --eval-iters 0 --metrics-file $RES/moe_mla.jsonl > $RES/moe_mla.log 2>&1
echo "moe_mla rc=$?"; grep -E "iteration +20/" $RES/moe_mla.log | cut -c1-220
python3 - <<'PY'
import json, os
for name in ("plain", "mla", "mla_resumed", "mla_q_latent", "squared_relu", "quick_geglu", "moe_mla"):
    path = f"/tmp/res/{name}.jsonl"
    if not os.path.exists(path):
        print(name, "no metrics"); continue
    records = [json.loads(line) for line in open(path)]
    late = [r for r in records if r["iteration"] > 10] or records
    print(name, "iterations", records[0]["iteration"], "..", records[-1]["iteration"], "loss", round(records[-1]["loss"], 4),
          "median tokens/s", round(sorted(r["tokens_per_s"] for r in late)[len(late) // 2]),
          "median TFLOP/s", round(sorted(r["tflops_per_gpu"] for r in late)[len(late) // 2], 1))
PY
