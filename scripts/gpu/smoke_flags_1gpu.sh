#!/usr/bin/env bash
# One GPU: every GPU test, then the CUDA paths of the Megatron-LM flags added in session 16 that the CPU suite
# cannot reach (NCCL default backend, --local-rank, CUDA memory logging and history, the NaN check under bf16,
# params norm and num-zeros logging, a save without optimizer state and a load of it) in short GPT-125M-shaped runs.
#   GPU_TESTS=1 bash scripts/gpu/smoke_flags_1gpu.sh   (the default; 0 skips the GPU tests; results in $RES, back as
#   results.tgz)
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
if [ "${GPU_TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | grep -E "passed|failed|error" | tee $RES/gpu_tests.txt
fi
common="--config configs/gpt_125m.yaml --builtin-corpus python-stdlib --tokenizer-type ByteTokenizer --transformer-impl local
  --bf16 --micro-batch-size 2 --global-batch-size 4 --seq-length 512 --max-position-embeddings 512 --lr-warmup-iters 2
  --log-interval 2 --eval-interval 10 --eval-iters 2"
torchrun --standalone --nproc-per-node 1 pretrain_gpt.py $common --train-iters 10 --local-rank 0 \
  --log-params-norm --log-num-zeros-in-grad --check-for-nan-in-loss-and-grad --check-for-spiky-loss \
  --tensorboard-dir $RES/tb --log-memory-to-tensorboard --log-timers-to-tensorboard --timing-log-level 1 \
  --record-memory-history --memory-snapshot-path $RES/snapshot.pickle --log-progress \
  --save $RES/ckpt --save-interval 10 --no-save-optim --metrics-file $RES/run1.jsonl 2>&1 | tail -8
torchrun --standalone --nproc-per-node 1 pretrain_gpt.py $common --train-iters 14 --load $RES/ckpt --no-load-optim \
  --use-checkpoint-args --metrics-file $RES/run2.jsonl 2>&1 | tail -4
rm -rf $RES/ckpt  # checkpoints stay on the machine
python3 - <<'PY'
import json
for name in ("run1", "run2"):
    records = [json.loads(line) for line in open(f"/tmp/res/{name}.jsonl")]
    last = records[-1]
    print(name, "iterations", [r["iteration"] for r in records][:1], "..", last["iteration"], "loss", round(last["loss"], 4),
          {k: last.get(k) for k in ("params_norm", "num_zeros_in_grad", "mem_allocated_bytes", "mem_reserved_bytes")})
PY
ls $RES $RES/tb 2>/dev/null | head -20
