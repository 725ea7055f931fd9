#!/usr/bin/env bash
# First call of a GPU session (~3 min on one H200): the kernel changes not yet run on CUDA, each checked
# for bytes against its reference and timed. Pending after session 5: TACO's INT8 byte from the bits of
# y + 1.5 * 2**23 (static SASS 1048 -> 984 per 1024 values; session 5 timed INT8 encode at 0.64-0.65x of
# copy, taco_kernels_int8_magic.json), and benchmarks/diag_ciera_split.py: CIERA compare-mode split variants
# and a one-kernel encode by decoupled look-back against the production split + prefix sum + gather (each
# checked byte for byte; the production path changes only after they are measured).
# (Session 5 ran the previous version of this script: delta tiled kernels and histogram width search.)
# Usage (device machine, repo root): bash scripts/gpu/kernel_changes_check.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests/test_taco_kernels.py tests/test_ciera.py tests/test_delta.py 2>&1 | tail -3
for fmt in int8 e4m3; do
  timeout 60 python3 -m benchmarks.bench_taco_kernels --format $fmt --sizes-mib 16,64,256 --reference-max-mib 0 \
    --out $RES/taco_kernels_$fmt.json 2>&1 | grep -A5 "MiB  copy"
done
timeout 120 python3 benchmarks/diag_ciera_split.py --out $RES/ciera_split_variants.json 2>&1 | grep -E "^lr|Error"
