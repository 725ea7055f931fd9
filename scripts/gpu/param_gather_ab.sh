#!/usr/bin/env bash
# 2x H200, ~3 min: A/B of a branch's parameter-gather path against main in one call: GPU tests, then the
# delta kernel benchmark and bench_param_gather (none, delta) at ~25 GB/s and NVLink on this tree (tag $A),
# then with main's code (MAIN_PATCH: `git diff BRANCH main -- <the changed files>`, tag $B), then this tree
# again (tag ${A}_again): the gathers are host-bound and vary by ~20% between calls and machines.
# PROFILE=1 adds a PyTorch profile of this tree's delta gather at ~25 GB/s.
# Usage (device machine, repo root): [PROFILE=1] A=branch B=main MAIN_PATCH=main.patch bash scripts/gpu/param_gather_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 120 python3 -m pytest -q -p no:warnings -m gpu tests/test_delta.py 2>&1 | tail -2
measure() {  # $1: tag
  timeout 120 python3 benchmarks/bench_delta_kernels.py --out $RES/delta_kernels_$1.json 2>&1 | grep "device time only"
  NCCL_P2P_DISABLE=1 timeout 45 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py \
    --codecs none delta --out $RES/param_gather_delta_$1_p2p_off.json 2>&1 | grep -v -i warn | tail -3
  timeout 30 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
    --out $RES/param_gather_delta_$1_nvlink.json 2>&1 | grep -v -i warn | tail -3
}
echo "== ${A:?}"; measure $A
[ -z "${PROFILE:-}" ] || NCCL_P2P_DISABLE=1 timeout 60 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py \
  --codecs delta --profile-dir $RES/profile_delta_${A}_p2p_off --out $RES/param_gather_delta_${A}_profiled_p2p_off.json \
  2>&1 | grep -v -i warn | tail -2
patch -p1 -s < ${MAIN_PATCH:?} || exit 1
echo "== ${B:?}"; measure $B
patch -R -p1 -s < $MAIN_PATCH && echo "== ${A} again" && measure ${A}_again
