#!/usr/bin/env bash
# Which coalesced collectives of CUDA tensors torch's gloo backend survives, beyond the parameter all-gather that
# session 34 found to crash: the gradient reduce-scatter (distributed optimizer) and all-reduce (without it) as
# megatron-core issues them. Both ranks on cuda:0; one line per rank and an exit code per run, also in $RES/summary.txt.
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
port=29720
for c in all_gather reduce_scatter all_reduce; do
  for m in plain coalesced-sync coalesced-async; do
    log=$RES/$c.$m.log
    PYTHONFAULTHANDLER=1 timeout 60 torchrun --nproc-per-node 2 --master-port $port \
      benchmarks/diag_gloo_cuda_gather.py $m $c > $log 2>&1
    code=$?
    seen=$(grep -hoE '(correct|WRONG|Segmentation fault|Fatal Python error)' $log | sort | uniq -c | tr '\n' ' ')
    echo "$c $m exit $code $seen" | tee -a $RES/summary.txt
    port=$((port + 1))
  done
done
