#!/usr/bin/env bash
# --tp-comm-emulate on one GPU: the python-site-packages corpus build, then 60 iterations of the gpu-125m-tp8
# preset's bf16 baseline, TACO (E4M3, emulated TP=8) and TahQuant (emulated TP=8), for the seconds per iteration
# that size the 3,000-iteration presets (each must fit one 10-minute call).
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
python3 scripts/convergence.py --family taco --preset ${PRESET:-gpu-125m-tp8} --variants ${VARIANTS:-baseline taco tahquant} \
  --train-only --out-dir $RES/tp8 --train-iters ${ITERS:-60} --eval-interval 30 --eval-iters 2 --log-interval 10 2>&1 \
  | grep -E "builtin-corpus|TP emulation|iteration +[0-9]+/|validation loss at|Error|error" | tail -60
python3 - <<'PY'
import glob, gzip, json, os
for path in sorted(glob.glob(os.environ["RES"] + "/tp8/*.jsonl.gz")):
    records = [json.loads(l) for l in gzip.open(path, "rt")]
    times = [r["iter_time_s"] for r in records if "iter_time_s" in r][5:]
    print(os.path.basename(path), "s/iter (after 5):", sum(times) / max(len(times), 1), "last loss",
          [r["loss"] for r in records if "loss" in r][-1])
PY
