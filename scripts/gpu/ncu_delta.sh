#!/usr/bin/env bash
# 1x H200, ~1 min: Nsight Compute (full section set) of one steady-state launch of the delta encode and decode
# kernels (bench_delta_kernels.py, 62.5M values, lr 1e-4), reports and details pages (CSV) in $RES, then the
# summary table (scripts/gpu/ncu_summary.py) and the figures that say what bounds them. The benchmark's own
# summary fails under ncu (the profiled launches are not seen by its device timer); the reports are complete.
# Usage (device machine, repo root): bash scripts/gpu/ncu_delta.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
NCU_TIMEOUT=200
source scripts/gpu/ncu_profile.sh
profile delta_encode "_encode_kernel" 4 1 python3 benchmarks/bench_delta_kernels.py --lrs 1e-4 --repeats 3 --out $RES/b1.json
profile delta_decode "_decode_kernel" 2 1 python3 benchmarks/bench_delta_kernels.py --lrs 1e-4 --repeats 3 --out $RES/b2.json
python3 scripts/gpu/ncu_summary.py $RES/ncu_delta_*_details.csv
for f in $RES/ncu_delta_*_details.csv; do echo "== $f"; grep -E '"(Warp Cycles Per Issued Instruction|Issue Slots Busy|Achieved Active Warps Per SM|Theoretical Occupancy|Block Limit [A-Za-z ]*|Registers Per Thread|Memory Throughput|DRAM Throughput|L1/TEX Hit Rate|L2 Hit Rate|Executed Ipc Active|Duration)"' $f | awk -F'","' '{print $(NF-3), $(NF-2), $(NF-1)}' | sort -u | head -40; done
