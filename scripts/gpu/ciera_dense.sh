#!/usr/bin/env bash
# 2x H200, ~3 min: CIERA's dense encodes (raw exponents, after an encode where >= 99% of the blocks
# changed: every block's exponents written in place into the payload, which in compare mode is the sender
# state; no gather pass, size known on the host). GPU tests (CUDA payload bytes == CPU payload bytes over
# a sequence with dense steps), kernel throughput vs a bf16 copy (keyframe, lr 1e-4, lr 1e-5), then the
# parameter all-gather at ~25 GB/s and NVLink against NCCL bf16 in the same run.
# Usage (device machine, repo root): bash scripts/gpu/ciera_dense.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 60 python3 -m pytest -q -m gpu tests/test_ciera.py tests/test_delta.py 2>&1 | tail -2
timeout 120 python3 benchmarks/bench_ciera_kernels.py --out $RES/ciera_kernels_dense.json 2>&1 | grep -v -i warn | tail -14
NCCL_P2P_DISABLE=1 timeout 45 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
  --out $RES/param_gather_ciera_dense_p2p_off.json 2>&1 | grep -v -i warn | tail -4
timeout 30 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
  --out $RES/param_gather_ciera_dense_nvlink.json 2>&1 | grep -v -i warn | tail -4
