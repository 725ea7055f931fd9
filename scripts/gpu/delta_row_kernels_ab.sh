#!/usr/bin/env bash
# 2x H200, ~4 min, on branch delta-row-encoder: the delta kernels working on rows of 8 values, one per thread
# (encode: 720 SASS instructions per 256-value block on its narrow path and 6 atomic ORs per row, was 1456
# and one or two per value; decode: 448, was 704), A/B in one call: GPU tests, then the kernel benchmark
# (register caps swept) and the parameter gather at ~25 GB/s and NVLink on this tree, then the same with
# main's kernels (MAIN_PATCH: `git diff delta-row-encoder main -- kernels/delta.py`).
# Merge the branch if its kernels and gathers are faster. CAPS: the caps swept on the branch; PROFILE=1 adds a
# PyTorch profile of the branch's gather at ~25 GB/s; REPEAT=1 measures the branch
# again after main (order effects; the gathers are host-bound and vary by ~20% between calls).
# Usage (device machine, repo root): [CAPS=0:0] [PROFILE=1] [REPEAT=1] MAIN_PATCH=main.patch bash scripts/gpu/delta_row_kernels_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 120 python3 -m pytest -q -p no:warnings -m gpu tests/test_delta.py 2>&1 | tail -2
both() {  # $1: tag, $2: register caps to sweep
  timeout 150 python3 benchmarks/bench_delta_kernels.py --max-registers "$2" --out $RES/delta_kernels_$1.json 2>&1 \
    | grep "device time only"
  NCCL_P2P_DISABLE=1 timeout 45 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py \
    --codecs none delta --out $RES/param_gather_delta_$1_p2p_off.json 2>&1 | grep -v -i warn | tail -3
  timeout 30 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
    --out $RES/param_gather_delta_$1_nvlink.json 2>&1 | grep -v -i warn | tail -3
}
echo "== rows"; both rows "${CAPS:-80:64,0:0}"
[ -z "${PROFILE:-}" ] || NCCL_P2P_DISABLE=1 timeout 60 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py \
  --codecs delta --profile-dir $RES/profile_delta_rows_p2p_off --out $RES/param_gather_delta_rows_profiled_p2p_off.json \
  2>&1 | grep -v -i warn | tail -2
patch -p1 -s < ${MAIN_PATCH:?} || exit 1
echo "== per-value (main)"; both per_value ""
[ -z "${REPEAT:-}" ] || { patch -R -p1 -s < $MAIN_PATCH && echo "== rows again"; both rows_again ""; }
