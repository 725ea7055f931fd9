#!/usr/bin/env bash
# 1x H200, ~4 min: the CIERA split kernel of several source trees in the same call, in rounds:
# bench_ciera_kernels.py (62.5M values, B=512, lr 1e-4 and 1e-5; device time vs a bf16 copy) in compare and
# hash mode, after the GPU tests of this tree. TREES lists label:dir pairs; each dir holds `kernels compression
# benchmarks` of one version (`git archive <commit> kernels compression benchmarks | tar -x -C .cache/<dir>`)
# and is carried to the machine.
# Usage (device machine, repo root): TREES="old:.cache/ciera_old new:." bash scripts/gpu/ciera_split_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests/test_ciera.py -p no:warnings 2>&1 | tail -1
for round in 1 2; do
  for mode in compare hash; do
    for tree in ${TREES:-new:.}; do
      label=${tree%%:*}; dir=${tree#*:}
      echo "== $label $mode $round"
      (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/bench_ciera_kernels.py --change-detect $mode \
        --repeats 8 --out $RES/ciera_kernels_${mode}_${label}${round}.json 2>&1 | grep -A6 "Device time only")
    done
  done
done
