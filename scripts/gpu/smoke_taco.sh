#!/usr/bin/env bash
# First GPU check of the TACO kernels and collectives, and of the driver on 2 GPUs.
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
python3 -m pytest -q -m gpu tests/test_taco_kernels.py 2>&1 | tail -15
python3 -m benchmarks.bench_taco_kernels --out $OUT/taco_kernels.json 2>&1 | tail -30
torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives --out $OUT/tp_coll_nvlink.json 2>&1 | tail -30
torchrun --standalone --nproc-per-node 2 pretrain_gpt.py --config configs/tiny_cpu_gpt.yaml --tensor-model-parallel-size 2 \
  --transformer-impl local --bf16 --train-iters 6 --tp-comm-compression taco --metrics-file $OUT/smoke_metrics.jsonl 2>&1 | tail -20
