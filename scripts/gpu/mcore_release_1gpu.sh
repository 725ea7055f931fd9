#!/usr/bin/env bash
# One GPU, one megatron-core release from a carried wheel folder (WHEELS: .whl019 holds 0.19.2, .whl018 0.18.2, .whl017
# 0.17.1; the other GPU results ran 0.16.1 from .whl): the CUDA paths of the driver under it. PARTS picks what runs:
#   tests   every GPU test
#   flags   the Megatron-LM flags' CUDA paths (smoke_flags_1gpu.sh: NCCL backend, NaN check, memory and timer logging, a
#           save without optimizer state and a load of it)
#   ckpt    synchronous and asynchronous checkpoints resumed bit for bit beside the uninterrupted run, and multi-token
#           prediction (smoke_ckpt_mtp_1gpu.sh)
#   moe     a short OLMoE-shaped MoE run (2 layers, 64 experts top-8, EP=1) whose loss must fall
#   gather  GPT-125M at DP=2 with both ranks on the one GPU over gloo (wire_ratio_dp2_one_gpu.sh): CIERA and delta on
#           every bucket with every gather checked bit for bit against an uncompressed one, then CIERA's benefit
#           selection (its merge probe on CUDA) as the hook runs it by default
#   WHEELS=.whl018 PARTS="tests flags ckpt moe gather" bash scripts/gpu/mcore_release_1gpu.sh     (results in $RES)
set -uo pipefail
export WHEELS=${WHEELS:-.whl019}
PARTS=${PARTS:-tests flags ckpt moe}
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has flags; then
  GPU_TESTS=$(has tests && echo 1 || echo 0) bash scripts/gpu/smoke_flags_1gpu.sh
elif has tests; then
  (source scripts/gpu/setup_device.sh || exit 1
   python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | grep -E "passed|failed|error" | tee $RES/gpu_tests.txt)
fi
has ckpt && MODES="sync async" MTP=1 GPU_TESTS=0 bash scripts/gpu/smoke_ckpt_mtp_1gpu.sh
if has gather; then
  RUNS="ciera:1e-4 delta:1e-4" ITERS=30 EXTRA="--param-gather-selection all --param-gather-verify-interval 1" \
    bash scripts/gpu/wire_ratio_dp2_one_gpu.sh
  # 16 iterations: the selection's 10-iteration window, then its choice; the warm-up must end inside the run
  RUNS="ciera:1e-5" ITERS=16 EXTRA="--param-gather-trial-iters 0 --lr-warmup-iters 2" \
    bash scripts/gpu/wire_ratio_dp2_one_gpu.sh
  grep -h "selection:" /tmp/res/dp2_one_gpu_ciera_lr1e-5.rank0.log | cut -c1-400
fi
has moe || exit 0
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
