#!/usr/bin/env bash
# 1x H200 (2x adds the gathers), ~5 min: a gather's delta buckets coded as one (GatherFusions, session 12). The
# CUDA tests of the segmented kernels; bench_delta_buckets.py (62.5M values per rank in 1, 8 and 32 buckets, each
# alone vs fused, WORLDS simulated ranks' payloads decoded in one launch or one by one: wall, host and device ms of
# one gather's codec work, at LRS); KERNELS=1: bench_delta_kernels.py (the kernels' device throughput); on 2 GPUs
# also bench_param_gather.py with 8 buckets, alone and --fuse-buckets, at ~25 GB/s and on NVLink, and with E2E=1 the
# exposed gather end to end (GPT-350M DP=2, ~25 GB/s and sockets).
# Usage (device machine, repo root): [WORLDS="2 8"] [LRS=1e-4] [KERNELS=1] [E2E=1] bash scripts/gpu/delta_fused_buckets.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
python3 -m pytest -q -m gpu tests/test_delta.py tests/test_shard_gather.py 2>&1 | tail -3
for lr in ${LRS:-1e-4 1e-5}; do
  timeout 240 python3 benchmarks/bench_delta_buckets.py --buckets 1 8 32 --world ${WORLDS:-2} --lr $lr \
    --out $RES/delta_buckets_lr$lr.json 2>&1 | grep "^|"
done
if [ -n "${KERNELS:-}" ]; then  # the codec kernels' device throughput (decode: all payload rows in one launch since call 2)
  timeout 120 python3 benchmarks/bench_delta_kernels.py --lrs 1e-4,1e-5 --repeats 10 --out $RES/delta_kernels.json 2>&1 | grep "device time only"
fi
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  for fuse in "" --fuse-buckets; do
    name=param_gather_buckets8${fuse:+_fused}
    NCCL_P2P_DISABLE=1 timeout 60 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
      --buckets 8 $fuse --out $RES/${name}_p2p_off.json 2>&1 | grep -v -i warn | tail -3
    timeout 45 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
      --buckets 8 $fuse --out $RES/${name}_nvlink.json 2>&1 | grep -v -i warn | tail -3
  done
  if [ -n "${E2E:-}" ]; then  # the exposed gather end to end (GPT-350M DP=2, its buckets fused), as session 11 call 8
    timeout 420 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation --model configs/gpt_350m.yaml \
      --links p2p_off_25GBps sockets_4GBps --variants delta_all delta --micro-batch-size 4 --global-batch-size 8 \
      --train-iters 50 --warmup 41 --param-gather-reselect-interval 25 --log-dir /tmp/fused_e2e \
      --out $RES/e2e_exposed_fused.json 2>&1 | grep -E "speedup|Error"
  fi
fi
