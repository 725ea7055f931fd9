#!/usr/bin/env bash
# The parameter all-gather's wire ratio over a real GPT-125M training at DP=2 when only one GPU is lent: both ranks
# share cuda:0 and talk over gloo (which stages CUDA tensors through the host). The payload bytes depend on the
# training's values, not on the link, so this is wire_ratio_and_baselines.sh's DP=2 run (same flags) on one device;
# its times are not meaningful. RUNS lists codec:lr pairs; EXTRA, more flags for every run (e.g.
# "--param-gather-verify-interval 1": every gather also checked bit for bit against an uncompressed one). EXTRA comes
# after the script's own flags and wins over them: "--min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 100" with
# RUNS=delta:6e-4 runs configs/gpt_125m.yaml's own schedule (session 36).
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
RUNS=${RUNS:-"delta:1e-4 delta:1e-5"}
ITERS=${ITERS:-150}
EXTRA=${EXTRA:-}
# MBS: the micro-batch. Two ranks at 8 hold ~40 GiB each, and the CIERA runs ran out of an H100's 80 GiB (session
# 47), so GPUs under 100 GiB take two micro-batches of 4 (the same global batch and raw gather bytes).
if [ -z "${MBS:-}" ]; then
  GPU_GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
  MBS=$([ "$GPU_GIB" -ge 100 ] && echo 8 || echo 4)
fi
port=29611
for run in $RUNS; do
  codec=${run%%:*}; lr=${run##*:}; name=dp2_one_gpu_${codec}_lr$lr
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      python3 pretrain_gpt.py --config configs/gpt_125m.yaml --distributed-backend gloo --micro-batch-size $MBS \
      --global-batch-size 16 --train-iters $ITERS --lr $lr --min-lr $lr --lr-decay-style constant --lr-warmup-iters 20 \
      --eval-interval 100000 --log-interval 10 --param-gather-compression $codec $EXTRA \
      --metrics-file $RES/$name.jsonl > $RES/$name.rank$rank.log 2>&1 &
  done
  wait
  port=$((port + 1))
  grep -E "iteration +$ITERS/" $RES/$name.rank0.log | tail -1 || tail -20 $RES/$name.rank0.log
  python3 - $RES/$name.jsonl <<'PY'
import json, os, sys
from compression.telemetry import PARAM_GATHER_CLASSES, raw_and_sent
rows = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
def ratio(rs):
    raw, sent = map(sum, zip(*(raw_and_sent(r["comm"], PARAM_GATHER_CLASSES) for r in rs)))
    return raw / max(1, sent)
n = len(rows)
if not n:
    sys.exit(f"{sys.argv[1]}: no iterations (see the rank logs)")
print(f"{sys.argv[1]}: {n} iterations, steady state (iterations {n // 2 + 1}-{n}) {ratio(rows[n // 2:]):.2f}x, "
      f"all {ratio(rows):.2f}x, last loss {rows[-1]['loss']:.4f}")
PY
done
