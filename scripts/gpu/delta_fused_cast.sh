#!/usr/bin/env bash
# One GPU: --delta-fused-cast's kernel path. The delta GPU tests (CastShard encodes on CUDA: payloads equal the
# sender-copy path's, the buffer equals torch's copy_ of fp32 values between 16-bit ones, NaNs included), then the
# fused encode timed against the encode with a sender copy on the benchmark's AdamW steps (62.5M values).
#   bash scripts/gpu/delta_fused_cast.sh      (results in $RES)
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_delta.py 2>&1 | tail -5
python3 benchmarks/bench_delta_fused_cast.py --out $RES/delta_fused_cast.json 2>&1 | tail -12
