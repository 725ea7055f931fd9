#!/usr/bin/env bash
# Prepared in session 3 of 2026-11-30 (its device budget ran out before it could run; ~5 min on 2x H200):
# CUDA-graph replay of the compressed TP collectives (--tp-comm-cuda-graphs): exactness on 2 GPUs,
# host/device time against NCCL and the eager compressed calls at ~25 GB/s, then end to end (TACO INT8,
# every TP tensor compressed, with and without graphs, GPT-350M and GPT-1.3B at TP=2, ~25 GB/s).
# Usage (device machine, repo root): bash scripts/gpu/taco_cuda_graphs.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 70 python3 -m pytest -q -m gpu tests/test_collective_graphs.py 2>&1 | tail -3
NCCL_P2P_DISABLE=1 timeout 60 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives --format int8 \
  --all-reduce one-shot --sizes-kib 16384,32768 --iters 8 --warmup 4 --cuda-graphs \
  --out $RES/taco_coll_cuda_graphs_p2p_off.json 2>&1 | grep -E "CUDA graph|CHECK|Error|all_|reduce_scatter" | head -12
for model in gpt_350m gpt_1.3b; do
  timeout 150 python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/$model.yaml --links p2p_off_25GBps \
    --micro-batch-size 4 --global-batch-size 16 --variants taco_int8_all taco_int8_graphs --log-dir $RES/logs_graphs_$model \
    --out $RES/e2e_tp2_taco_graphs_$model.json 2>&1 | grep -E "speedup|Error"
done
