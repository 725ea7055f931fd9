#!/usr/bin/env bash
# 1x H200, ~1.5 min for three trees: the TACO collectives' fused kernel steps (decode_sum, reduce_encode,
# reduce_decode; benchmarks/bench_taco_fused_steps.py) of several source trees in the same call, in rounds.
# TREES lists label:dir pairs; each dir holds `kernels compression benchmarks` of one version (e.g.
# `git archive 32454c0 kernels compression benchmarks | tar -x -C .cache/ab_old2`, plus this benchmark) and is
# carried to the machine. Each run checks its kernels against its own reference on the GPU.
# Usage (device machine, repo root): TREES="old:.cache/ab_old2 new:." bash scripts/gpu/taco_fused_steps_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
for round in 1 2; do
  for tree in ${TREES:-new:.}; do
    label=${tree%%:*}; dir=${tree#*:}
    echo "== $label $round"
    (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/bench_taco_fused_steps.py \
      --out $RES/taco_fused_steps_${label}${round}.json 2>&1 | grep -v Warn | tail -11)
  done
done
