#!/usr/bin/env bash
# GPU call (2x H200): (1) the lossless delta codec's CUDA kernels: exactness test and throughput
# (scripts/gpu/delta_kernels.sh); (2) TACO kernel throughput with the host's launch cost per call;
# (3) TACO collectives vs NCCL, synced and queued (host running ahead, as in training), NVLink and
# NCCL_P2P_DISABLE=1, with the AUTO crossover under both timings.
# Usage (device machine, repo root): bash scripts/gpu/delta_and_taco_timing.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
save() { tar czf $OUT/results.tgz -C $RES .; }
{
  timeout 150 python3 -m pytest -q -x -m gpu tests/test_delta.py 2>&1 | tail -15
  timeout 150 python3 benchmarks/bench_delta_kernels.py --warps 2,4 --out $RES/delta_kernels.json 2>&1 | grep -v -i warn
} 2>&1 | tee $RES/delta_gpu.log; save
timeout 120 python3 -m benchmarks.bench_taco_kernels --format int8 --sizes-mib 1,16,64 --out $RES/taco_kernels_host.json \
  2>&1 | tee $RES/taco_kernels_host.log; save
sizes=1024,4096,16384,32768,65536,262144
for link in nvlink p2p_off; do
  env=""; [ $link = p2p_off ] && env="NCCL_P2P_DISABLE=1"
  env $env timeout 150 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives --format int8 \
    --sizes-kib $sizes --out $RES/taco_coll_queued_$link.json 2>&1 | grep -v -i warn | tee $RES/taco_coll_queued_$link.log
  save
done
