#!/usr/bin/env bash
# One GPU (session 20): this session's Megatron-LM run flags on CUDA with a GPT-125M-shaped bf16 model: a batch-size
# ramp (--rampup-batch-size, sample-based), its twin --step-batch-size-schedule (same steps, thresholds in tokens),
# non-persistent checkpoints (--non-persistent-ckpt-type global) and a resume from the newest of them, gpt-oss's gated
# activation (--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0) with
# --disable-bf16-reduced-precision-matmul. Reports batch sizes, loss bits of the twins and of the resume.
#   bash scripts/gpu/smoke_schedules_1gpu.sh   (results in $RES, back as results.tgz)
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
# 19 iterations: batches of 4 up to 16 samples, 8 up to 32, 12 up to 48, then 16 (--train-samples 240)
# (configs/gpt_125m.yaml's shape, spelled out: the file's --train-iters and --global-batch-size would clash)
common="--num-layers 12 --hidden-size 768 --ffn-hidden-size 3072 --num-attention-heads 12 --position-embedding-type rope
  --attention-dropout 0.0 --hidden-dropout 0.0 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --weight-decay 0.1
  --adam-beta2 0.95 --clip-grad 1.0 --tokenizer-type ByteTokenizer --builtin-corpus python-stdlib
  --transformer-impl local --bf16 --micro-batch-size 4 --seq-length 1024
  --max-position-embeddings 1024 --train-samples 240 --lr-warmup-samples 16 --lr-decay-samples 240 --log-interval 4
  --eval-interval 1000 --eval-iters 0 --deterministic-mode --quick-geglu --glu-linear-offset 1.0
  --activation-func-clamp-value 7.0 --disable-bf16-reduced-precision-matmul"
run() {  # name, flags...
  local name=$1; shift
  timeout 240 torchrun --standalone --nproc-per-node 1 pretrain_gpt.py $common "$@" --metrics-file $RES/$name.jsonl \
    > $RES/$name.log 2>&1
  echo "$name rc=$?"; grep -E "iteration +(4|12|19)/|checkpoint of iteration|loading|Error" $RES/$name.log | cut -c1-220
}
rm -rf /tmp/ck_ramp  # a rerun starts afresh: saving from iteration 0 into an earlier run's checkpoints is an error
run ramp --global-batch-size 16 --rampup-batch-size 4 4 48 --save /tmp/ck_ramp --save-interval 100 \
  --non-persistent-save-interval 5 --non-persistent-ckpt-type global --exit-interval 12
ls /tmp/ck_ramp /tmp/ck_ramp/non_persistent | tee $RES/ckpt_dirs.txt
# as if the job had died before its exit save: the newest checkpoint is then non-persistent iteration 10
rm -rf /tmp/ck_ramp/iter_0000012 /tmp/ck_ramp/latest_checkpointed_iteration.txt
run resumed --global-batch-size 16 --rampup-batch-size 4 4 48 --load /tmp/ck_ramp --non-persistent-ckpt-type global
run stepped --step-batch-size-schedule "0:4 16384:8 32768:12 49152:16"
python3 - <<'PY'
import json
def records(name):
    try:
        return [json.loads(line) for line in open(f"/tmp/res/{name}.jsonl")]
    except FileNotFoundError:
        return []
ramp, resumed, stepped = records("ramp"), records("resumed"), records("stepped")
print("ramp batches", [r["global_batch_size"] for r in ramp])
print("stepped batches", [r["global_batch_size"] for r in stepped])
keys = ("iteration", "global_batch_size", "loss", "grad_norm")
print("stepped repeats the ramp's 12 iterations bit for bit:", [[r[k] for k in keys] for r in stepped[:12]] == [[r[k] for k in keys] for r in ramp])
print("resumed from", resumed[0]["iteration"] if resumed else None, "repeats the stepped run:",
      bool(resumed) and [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in stepped[len(stepped) - len(resumed):]])
print("losses", [round(r["loss"], 4) for r in stepped[::4]], "tokens/s (last)", round(stepped[-1]["tokens_per_s"]) if stepped else None)
PY
