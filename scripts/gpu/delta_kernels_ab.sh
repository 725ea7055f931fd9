#!/usr/bin/env bash
# 1x H200, ~3 min for two trees: the delta codec's kernels of several source trees in the same call, in rounds
# (bench_delta_kernels.py: 62.5M values, B=256, lr 1e-4 and 1e-5; device time vs a bf16 copy, every decode
# checked bit for bit), after the GPU tests of this tree. TREES lists label:dir pairs; each dir holds `kernels
# compression benchmarks` of one version (`git archive <commit> kernels compression benchmarks | tar -x -C
# .cache/<dir>`) and is carried to the machine.
# Usage (device machine, repo root): TREES="old:.cache/delta_old new:." bash scripts/gpu/delta_kernels_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 200 python3 -m pytest -q -m gpu tests/test_delta.py -p no:warnings 2>&1 | tail -1
for round in 1 2 3; do
  for tree in ${TREES:-new:.}; do
    label=${tree%%:*}; dir=${tree#*:}
    echo "== $label $round"
    (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/bench_delta_kernels.py --repeats 10 \
      --out $RES/delta_kernels_${label}${round}.json 2>&1 | grep "^lr")
  done
done
