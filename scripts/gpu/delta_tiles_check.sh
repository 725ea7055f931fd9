#!/usr/bin/env bash
# For the next GPU session, first (~2 min on one H200): the delta codec's tiled gather and stream-size
# kernels (session 4, byte-identical in the interpreter, not yet run on CUDA): the CUDA exactness tests,
# then device-time throughput against results/gpu/delta_kernels_device_time.json (gather 275-287 us,
# stream sizes 148 us before).
# Usage (device machine, repo root): bash scripts/gpu/delta_tiles_check.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 120 python3 -m pytest -q -m gpu tests/test_delta.py tests/test_timing.py 2>&1 | tail -3
timeout 90 python3 benchmarks/bench_delta_kernels.py --repeats 8 --out $RES/delta_kernels_tiled.json 2>&1 | grep "device time only"
python3 - <<'PY'
import json, os
rows = json.load(open(os.path.join(os.environ["RES"], "delta_kernels_tiled.json")))["rows"]
for r in rows:
    print(r["lr"], {k: round(v, 1) for k, v in {**r["encode_ops_us"], **r["decode_ops_us"]}.items() if "kernel" in k})
PY
