#!/usr/bin/env bash
# First call of a GPU session (~1.5 min on one H200): the kernel changes not yet run on CUDA, each checked
# for bytes against its reference and timed. Pending after session 6: benchmarks/diag_ciera_split.py's
# one-kernel CIERA encode (decoupled look-back) walking back a window of 32 predecessors per step
# (encode_lookback_32; one per step took 293 us against the production encode's 169 us in session 6,
# results/gpu/ciera_split_variants.json). The production path changes only after it is measured.
# (Session 6 ran the previous version of this script: TACO INT8 low-byte rounding, the split variants.)
# Usage (device machine, repo root): bash scripts/gpu/kernel_changes_check.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 90 python3 -m pytest -q -m gpu tests/test_ciera.py 2>&1 | tail -2
timeout 150 python3 benchmarks/diag_ciera_split.py --out $RES/ciera_split_lookback_window.json 2>&1 | grep -E "^lr|Error"
