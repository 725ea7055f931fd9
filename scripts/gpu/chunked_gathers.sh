#!/usr/bin/env bash
# 2x H200, ~6 min. (1) GPU tests of CIERA and delta (the compare-mode split now stores only changed blocks'
# exponents, without a barrier: 130 -> 76 us in results/gpu/ciera_split_variants.json); (2) CIERA's and
# delta's kernels by device time (bench_*_kernels, now without the decode's header read: the gather hands
# the header over with the sizes); (3) the parameter all-gather at ~25 GB/s and on NVLink with the shard in
# 1, 4 and 8 chunks (--param-gather-chunks: decoding chunk k overlaps chunk k+1's transfer), against
# NCCL bf16 in the same run, then one profiled delta/4 gather at ~25 GB/s.
# Usage (device machine, repo root): bash scripts/gpu/chunked_gathers.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 120 python3 -m pytest -q -m gpu tests/test_ciera.py tests/test_delta.py 2>&1 | tail -2
timeout 60 python3 benchmarks/bench_ciera_kernels.py --repeats 8 --out $RES/ciera_kernels_changed_only.json 2>&1 | grep -A8 "Device time only"
timeout 60 python3 benchmarks/bench_delta_kernels.py --repeats 8 --out $RES/delta_kernels_host_header.json 2>&1 | grep "device time only"
for link in p2p_off nvlink; do
  env=""; [ $link = p2p_off ] && env="NCCL_P2P_DISABLE=1"
  env $env timeout 220 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
    --chunks 1 4 8 --out $RES/param_gather_chunks_$link.json 2>&1 | grep -v -i warn | tail -10
done
NCCL_P2P_DISABLE=1 timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs delta \
  --chunks 4 --profile-dir $RES/profile_delta4_p2p_off --out $RES/param_gather_delta4_profiled_p2p_off.json 2>&1 | grep -v -i warn | tail -3
