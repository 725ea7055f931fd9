#!/usr/bin/env bash
# One GPU (session 18): every GPU test, then the CUDA path of the attention-form and recompute flags in short
# GPT-125M-shaped bf16 runs, each beside the plain run of the same shape for tokens/s and peak memory: sliding-window
# attention (gpt-oss's 128-token window on every other layer), the learnable and off-by-one softmax, interleaved RoPE,
# and selective recompute of attention, MLP and norms on a bias-free model (against that model without recompute).
#   bash scripts/gpu/smoke_attention_forms_1gpu.sh          (results in $RES, back as results.tgz)
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | grep -E "passed|failed|error" | tee $RES/gpu_tests.txt
common="--config configs/gpt_125m.yaml --transformer-impl local --bf16 --micro-batch-size 4 --global-batch-size 8
  --seq-length 1024 --max-position-embeddings 1024 --lr-warmup-iters 2 --log-interval 10 --eval-interval 1000
  --eval-iters 0 --no-check-for-nan-in-loss-and-grad --log-memory-to-tensorboard --train-iters 30"
run() {  # name, flags...
  local name=$1; shift
  torchrun --standalone --nproc-per-node 1 pretrain_gpt.py $common "$@" --metrics-file $RES/$name.jsonl \
    > $RES/$name.log 2>&1; echo "$name rc=$?"; grep -E "iteration +30/" $RES/$name.log | cut -c1-220
}
run plain
run window --window-size 128,0 --window-attn-skip-freq 2
run softmax_learnable --softmax-type learnable
run softmax_off_by_one --softmax-type off-by-one
run rope_interleaved --position-embedding-type rope --rotary-interleaved
run rope_halves --position-embedding-type rope
run no_bias --disable-bias-linear --swiglu
run no_bias_recompute --disable-bias-linear --swiglu --recompute-granularity selective \
  --recompute-modules core_attn mlp layernorm
python3 - <<'PY'
import json, os
for name in ("plain", "window", "softmax_learnable", "softmax_off_by_one", "rope_interleaved", "rope_halves", "no_bias",
             "no_bias_recompute"):
    path = f"/tmp/res/{name}.jsonl"
    if not os.path.exists(path):
        print(name, "no metrics"); continue
    records = [json.loads(line) for line in open(path)]
    late = [r for r in records if r["iteration"] > 10] or records
    peak = max(r.get("mem_max_allocated_bytes", 0) for r in records) / 2**30
    print(name, "iterations", records[-1]["iteration"], "loss", round(records[-1]["loss"], 4),
          "median tokens/s", round(sorted(r["tokens_per_s"] for r in late)[len(late) // 2]),
          "peak GiB", round(peak, 2))
PY
