#!/usr/bin/env bash
# One H200, ~1.5 min: CIERA's compare-mode split kernel variants (benchmarks/diag_ciera_split.py: without
# the barrier, storing changed blocks' exponents only), each checked bit for bit against the production
# kernel; the production kernel changes only if a variant is exact and faster.
# Usage (device machine, repo root): bash scripts/gpu/ciera_split_diag.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 120 python3 benchmarks/diag_ciera_split.py --out $RES/ciera_split_variants.json 2>&1 | grep -E "^lr|Error"
