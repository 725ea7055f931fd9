#!/usr/bin/env bash
# One GPU (session 19): the CUDA path of --async-save (forked writer and --use-persistent-ckpt-worker, both from host
# copies of the state) against synchronous saves of the same GPT-125M-shaped bf16 run: the time a save holds training
# up, and a resume from the iteration-20 checkpoint of each against the uninterrupted run (loss and grad-norm bits,
# --deterministic-mode). Then multi-token prediction (--mtp-num-layers 1) beside the same model without it (tokens/s,
# losses), and every GPU test.
#   MODES="sync async persistent" CONSTANT=0 MTP=1 GPU_TESTS=1 bash scripts/gpu/smoke_ckpt_mtp_1gpu.sh
#   (the defaults; CONSTANT=1 adds --ckpt-assume-constant-structure; results in $RES, back as results.tgz)
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
MODES=${MODES:-sync async persistent}; CONSTANT=${CONSTANT:-0}; MTP=${MTP:-1}; GPU_TESTS=${GPU_TESTS:-1}
common="--config configs/gpt_125m.yaml --transformer-impl local --bf16 --micro-batch-size 4 --global-batch-size 8
  --seq-length 1024 --max-position-embeddings 1024 --lr-warmup-iters 2 --log-interval 10 --eval-interval 1000
  --eval-iters 0 --no-check-for-nan-in-loss-and-grad --train-iters 30 --deterministic-mode"
run() {  # name, flags...
  local name=$1; shift
  local t0=$(date +%s.%N)
  timeout 240 torchrun --standalone --nproc-per-node 1 pretrain_gpt.py $common "$@" --metrics-file $RES/$name.jsonl \
    > $RES/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc wall_s=$(awk "BEGIN {print $(date +%s.%N) - $t0}")"
  grep -E "checkpoint of iteration|iteration +30/" $RES/$name.log | cut -c1-200
}
for mode in $MODES; do
  flags="--save /tmp/ck_$mode --save-interval 10"
  [ $CONSTANT = 1 ] && flags="$flags --ckpt-assume-constant-structure"
  [ $mode = async ] && flags="$flags --async-save"
  [ $mode = persistent ] && flags="$flags --async-save --use-persistent-ckpt-worker"
  run ckpt_$mode $flags
  run resume_$mode --load /tmp/ck_$mode --ckpt-step 20
done
if [ $MTP = 1 ]; then
  run rope --position-embedding-type rope
  run rope_mtp --position-embedding-type rope --mtp-num-layers 1
fi
python3 - <<'PY'
import json, os
def records(name):
    path = f"/tmp/res/{name}.jsonl"
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []
for mode in os.environ.get("MODES", "sync async persistent").split():
    full, resumed = records(f"ckpt_{mode}"), records(f"resume_{mode}")
    same = [(r["loss"], r["grad_norm"]) for r in full[20:]] == [(r["loss"], r["grad_norm"]) for r in resumed]
    print(mode, "iterations", len(full), "resumed", len(resumed), "resume bit-identical:", same and bool(resumed))
for name in ("rope", "rope_mtp"):
    rs = records(name)
    if not rs:
        continue
    late = [r for r in rs if r["iteration"] > 10]
    print(name, "loss", round(rs[-1]["loss"], 4), "mtp", [round(x, 4) for x in rs[-1].get("mtp_loss", [])],
          "median tokens/s", round(sorted(r["tokens_per_s"] for r in late)[len(late) // 2]))
PY
if [ $GPU_TESTS = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | grep -E "passed|failed|error" | tee $RES/gpu_tests.txt
fi
