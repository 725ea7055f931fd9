#!/usr/bin/env bash
# 1x H200, ~3 min: the stream-code diagnostic (benchmarks/diag_delta_stream_code.py) timed, then Nsight Compute
# (full section set) of one full-size launch each of its encode and decode kernels (62.5M values, lr 1e-4, one
# stream per thread, next row prefetched), reports and details pages (CSV) in $RES, with the figures that say what
# bounds them. Usage (device machine, repo root): CONFIGS=32x1p,64x1p bash scripts/gpu/ncu_stream_code.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
python3 benchmarks/diag_delta_stream_code.py --configs ${CONFIGS:-32x1,32x1p,64x1p} --out $RES/stream_code.json 2>&1 \
  | grep -v -i warn
NCU_TIMEOUT=150
source scripts/gpu/ncu_profile.sh
# The diagnostic's own timing fails under ncu (its profiler sees no launches: ZeroDivisionError); the reports are
# complete. The checks launch each kernel twice (plain, row flags) on small data first: skip them
DIAG="python3 benchmarks/diag_delta_stream_code.py --configs 32x1p --lrs 1e-4 --repeats 1 --out $RES/ncu_diag.json"
profile stream_encode "_stream_encode_kernel" 2 1 $DIAG
profile stream_decode "_stream_decode_kernel" 2 1 $DIAG
python3 scripts/gpu/ncu_summary.py $RES/ncu_stream_*_details.csv
for f in $RES/ncu_stream_*_details.csv; do echo "== $f"; grep -E '"(Warp Cycles Per Issued Instruction|Issue Slots Busy|Achieved Active Warps Per SM|Theoretical Occupancy|Block Limit [A-Za-z ]*|Registers Per Thread|Memory Throughput|DRAM Throughput|L1/TEX Hit Rate|L2 Hit Rate|Executed Ipc Active|Duration|Stall [A-Za-z ]*)"' $f | awk -F'","' '{print $(NF-3), $(NF-2), $(NF-1)}' | sort -u | head -60; done
rm -f $RES/*.ncu-rep
