#!/usr/bin/env bash
# 1x H200, ~4 min: the Gluon TACO kernels (one layout change per kernel, wire order per thread) against the
# previous plain-Triton kernels in the same call. The previous version is `git archive ef4f0af kernels
# compression benchmarks` unpacked in $OLD (carried to the machine); both benchmarks check their kernels
# against their own reference on the GPU. Order old / new / old / new so that drift shows.
# Usage (device machine, repo root): OLD=.cache/ab_old bash scripts/gpu/taco_gluon_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
OLD=${OLD:-.cache/ab_old}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/test_taco_kernels.py 2>&1 | tail -3
bench() {  # tag, dir, format
  (cd $2 && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m benchmarks.bench_taco_kernels --format $3 \
    --sizes-mib 16,64,256 --reference-max-mib 0 --out $RES/taco_kernels_$1_$3.json 2>&1 | tail -6)
}
for round in 1 2; do
  bench old$round $OLD int8
  bench new$round . int8
done
bench new1 . e4m3
bench old1 $OLD e4m3
