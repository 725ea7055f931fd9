#!/usr/bin/env bash
# GPU call (2x H200): end-to-end TACO (int8) at TP=2 vs the uncompressed baseline of the same run,
# GPT-1.3B, NCCL_P2P_DISABLE=1 (~25 GB/s) and NVLink, `auto` thresholds (queued timing) and every
# tensor compressed; then with sequence parallelism at ~25 GB/s; then the lossless delta codec's
# wire ratio over real GPT-125M training (DP=2) at lr 1e-4 and 1e-5.
# Usage (device machine, repo root): bash scripts/gpu/e2e_taco_and_delta_ratio.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
save() { tar czf $OUT/results.tgz -C $RES .; }
common="--micro-batch-size 4 --global-batch-size 16 --log-dir $RES/logs --variants taco_int8 taco_int8_all"
timeout 330 python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_1.3b.yaml --links p2p_off_25GBps nvlink \
  $common --out $RES/e2e_tp2_taco_gpt_1.3b.json 2>&1 | grep -E "speedup|Error"; save
timeout 150 python3 benchmarks/e2e_throughput.py --suite tp2_sp_taco --model configs/gpt_1.3b.yaml --links p2p_off_25GBps \
  $common --out $RES/e2e_tp2_sp_taco_gpt_1.3b.json 2>&1 | grep -E "speedup|Error"; save
grep -ho "compress from bytes [^:]*" $RES/logs/*.log | sort | uniq -c | head
for lr in 1e-4 1e-5; do
  timeout 100 torchrun --standalone --nproc-per-node 2 pretrain_gpt.py --config configs/gpt_125m.yaml --micro-batch-size 8 \
    --global-batch-size 16 --train-iters 150 --lr $lr --min-lr $lr --lr-decay-style constant --lr-warmup-iters 20 \
    --eval-interval 100000 --log-interval 50 --param-gather-compression delta \
    --metrics-file $RES/wire_delta_v2_lr$lr.jsonl > $RES/wire_delta_v2_lr$lr.log 2>&1 || tail -30 $RES/wire_delta_v2_lr$lr.log
  grep -E "iteration +150/" $RES/wire_delta_v2_lr$lr.log | tail -1; save
done
