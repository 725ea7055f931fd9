#!/usr/bin/env bash
# 2x H200, ~8 min: the parameter gather as the hook now runs it (session 10: one size exchange for all buckets of
# a model chunk, every transfer queued before the first decode). bench_param_gather.py with the same 62.5M
# values per rank in 1 bucket and in 8 (a GPT-350M-like split), none and delta, at ~25 GB/s and on NVLink
# (REPEATS=2: twice, as the gathers vary by ~20% between calls; then split the call): does the decode-transfer
# overlap of 8 buckets reach the issue's <= 0.3x of NCCL at ~25 GB/s? Then the exposed end to end at ~25 GB/s and on sockets, against
# session 10 calls 2 and 4 (delta on every bucket 1.030x and 1.165x there, the default 1.007x and 1.184x).
# Usage (device machine, repo root): bash scripts/gpu/bucketed_gather.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
for repeat in $(seq ${REPEATS:-1}); do for buckets in 1 8; do
  NCCL_P2P_DISABLE=1 timeout 60 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
    --buckets $buckets --out $RES/param_gather_buckets${buckets}_p2p_off_r$repeat.json 2>&1 | grep -v -i warn | tail -3
  timeout 45 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
    --buckets $buckets --out $RES/param_gather_buckets${buckets}_nvlink_r$repeat.json 2>&1 | grep -v -i warn | tail -3
done; done
timeout 420 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation --model configs/gpt_350m.yaml \
  --links p2p_off_25GBps sockets_4GBps --variants delta_all delta --micro-batch-size 4 --global-batch-size 8 --train-iters 30 --warmup 17 \
  --log-dir /tmp/bucketed --out $RES/e2e_exposed_prepared.json 2>&1 | grep -E "speedup|Error"
