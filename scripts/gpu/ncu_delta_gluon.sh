#!/usr/bin/env bash
# 1x H200, ~1.5 min: Nsight Compute of session 14's Gluon delta decoder (tree .cache/delta_gl, built as in
# scripts/gpu/delta_decode_gluon_ab.sh) at 1 and 2 blocks per warp (full sections, details CSV, summary), then the
# instructions per pipe (ALU / FMA) of main's decode and encode kernels and of the Gluon decoder.
# Usage (device machine, repo root): bash scripts/gpu/ncu_delta_gluon.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
NCU_TIMEOUT=200
source scripts/gpu/ncu_profile.sh
for nblk in 1 2; do
  (cd .cache/delta_gl && PYTHONPATH=/tmp/site:$PWD DELTA_DECODE_GLUON=1 DELTA_DECODE_NBLK=$nblk profile gl_decode_nblk$nblk \
    "_decode_kernel_gl" 2 1 python3 benchmarks/bench_delta_kernels.py --lrs 1e-4 --repeats 3 --out $RES/b.json)
  $NCU_BIN --import $RES/ncu_gl_decode_nblk$nblk.ncu-rep --page raw --csv --metrics sm__inst_executed_pipe_alu.sum,sm__inst_executed_pipe_fma.sum,sm__inst_executed_pipe_fmaheavy.sum,sm__inst_executed.sum,smsp__inst_executed_pipe_alu.sum > $RES/ncu_gl_decode_nblk${nblk}_pipes.csv 2>&1
done
python3 scripts/gpu/ncu_summary.py $RES/ncu_gl_decode_nblk*_details.csv
for f in $RES/ncu_gl_decode_nblk*_details.csv; do grep -i "highest-utilized" $f | awk -F'","' '{print $(NF-2)}' | cut -c1-120; done
cat $RES/ncu_gl_decode_nblk*_pipes.csv | cut -c1-400
M=sm__inst_executed_pipe_alu.sum,sm__inst_executed_pipe_fma.sum,sm__inst_executed_pipe_fmaheavy.sum,sm__inst_executed.sum,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum
for k in _decode_kernel _encode_kernel; do
  timeout 200 $NCU_BIN --kernel-name "regex:^${k}\$" --launch-skip 2 --launch-count 1 --metrics $M --csv python3 benchmarks/bench_delta_kernels.py --lrs 1e-4 --repeats 3 --out $RES/b2.json 2>/dev/null | grep -E '"(sm__|gpu__)' | awk -F'","' '{print $(NF-2), $NF}'
done
(cd .cache/delta_gl && PYTHONPATH=/tmp/site:$PWD DELTA_DECODE_GLUON=1 timeout 200 $NCU_BIN --kernel-name "regex:_decode_kernel_gl" --launch-skip 2 --launch-count 1 --metrics $M --csv python3 benchmarks/bench_delta_kernels.py --lrs 1e-4 --repeats 3 --out $RES/b3.json 2>/dev/null | grep -E '"(sm__|gpu__)' | awk -F'","' '{print "gluon", $(NF-2), $NF}')
