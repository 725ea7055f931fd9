#!/usr/bin/env bash
# For the next GPU session, first (~3 min on one H200): the kernel changes of session 4 that are
# byte-identical in the interpreter but not yet run on CUDA: the delta codec's tiled gather and
# stream-size kernels and its histogram width search (device time before: encode kernel 732 us, gather
# 275-287 us, stream sizes 148 us, results/gpu/delta_kernels_device_time.json) and TACO's INT8 cast shortcut (static SASS -9%;
# INT8 encode before: results/gpu/taco_kernels.json is E4M3, so INT8 is timed here with E4M3 beside it).
# Usage (device machine, repo root): bash scripts/gpu/kernel_changes_check.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests/test_delta.py tests/test_timing.py tests/test_taco_kernels.py 2>&1 | tail -3
timeout 90 python3 benchmarks/bench_delta_kernels.py --repeats 8 --out $RES/delta_kernels_tiled.json 2>&1 | grep "device time only"
python3 - <<'PY'
import json, os
rows = json.load(open(os.path.join(os.environ["RES"], "delta_kernels_tiled.json")))["rows"]
for r in rows:
    print(r["lr"], {k: round(v, 1) for k, v in {**r["encode_ops_us"], **r["decode_ops_us"]}.items() if "kernel" in k})
PY
for fmt in int8 e4m3; do
  timeout 60 python3 -m benchmarks.bench_taco_kernels --format $fmt --sizes-mib 16,64,256 --reference-max-mib 0 \
    --out $RES/taco_kernels_$fmt.json 2>&1 | grep -A5 "MiB  copy"
done
