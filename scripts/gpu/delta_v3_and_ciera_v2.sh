#!/usr/bin/env bash
# Session 3 of 2026-11-30 (2x H200, ~8 min): the delta format-3 kernels (row packing, no scans) and the
# fused CIERA format-2 kernels: CUDA exactness tests, codec throughput vs a bf16 copy, the parameter
# all-gather vs NCCL at the three link classes, and delta end to end (GPT-350M, DP=2, benefit selection).
# The delta numbers in results/gpu/*delta_v3* came from commit 80ef3cc (delta format 3, since reverted);
# at later commits this script measures delta format 2 beside CIERA format 2.
# Usage (device machine, repo root): bash scripts/gpu/delta_v3_and_ciera_v2.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 200 python3 -m pytest -q -m gpu tests/test_delta.py tests/test_ciera.py 2>&1 | tail -4
timeout 90 python3 benchmarks/bench_delta_kernels.py --out $RES/delta_kernels_v3.json 2>&1 | grep -E "^\||Error"
timeout 120 python3 benchmarks/bench_ciera_kernels.py --tiles 2048,4096,8192 --warps 4,8 \
  --out $RES/ciera_kernels_v2.json 2>&1 | grep -E "^\||Error" | head -24
for link in nvlink p2p_off sockets; do
  case $link in nvlink) env="";; p2p_off) env="NCCL_P2P_DISABLE=1";; sockets) env="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1";; esac
  env $env timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none ciera delta \
    --out $RES/param_gather_v3_$link.json 2>&1 | grep -v -i warn | tail -5
done
timeout 170 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather --model configs/gpt_350m.yaml \
  --links p2p_off_25GBps sockets_4GBps --variants delta --micro-batch-size 4 --global-batch-size 16 \
  --log-dir $RES/logs_dp2 --out $RES/e2e_dp2_delta_v3_gpt_350m.json 2>&1 | grep -E "speedup|Error"
grep -h "selection" $RES/logs_dp2/*.log | sort | uniq -c | head
