#!/usr/bin/env bash
# Delta encoder with atomic-OR packing instead of two segmented OR scans (static SASS 2440 -> 1320 per
# 256-value block): CUDA bytes vs the reference, then device time (before: encode kernel 682 us,
# results/gpu/delta_kernels_tiled.json). Usage (device machine, repo root): bash scripts/gpu/delta_atomic_check.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests/test_delta.py 2>&1 | tail -3
timeout 90 python3 benchmarks/bench_delta_kernels.py --repeats 8 --out $RES/delta_kernels_atomic.json 2>&1 | grep "device time only"
python3 - <<'PY'
import json, os
rows = json.load(open(os.path.join(os.environ["RES"], "delta_kernels_atomic.json")))["rows"]
for r in rows:
    print(r["lr"], {k: round(v, 1) for k, v in {**r["encode_ops_us"], **r["decode_ops_us"]}.items() if "kernel" in k})
PY
