#!/usr/bin/env bash
# Issue 4's MoE end to end at the size two GPUs allow (~5 min on 2x H200 per link): an OLMoE-shaped MoE
# (configs/olmoe_1b_7b.yaml: 64 experts top-8, hidden 2048) cut to 4 layers and seq 2048, DP=2 with EP=1
# so that dense and expert buckets are gathered over DP=2, distributed optimizer and Megatron's overlap,
# param-gather compression none / ciera / delta (benefit selection + trial, the defaults). Loss bits and
# parameter checksums must equal the baseline's: --deterministic-mode, since megatron-core's MoE token
# scatter (scatter_add) is not run-to-run deterministic on GPUs otherwise (session 5: without it the three
# NVLink runs' losses differed in the 2nd-3rd digit). Checksums at iterations 11 and 22 (each hashes ~3 GB
# of parameters on the host). LINKS: a subset of e2e_throughput.py's link classes; LAYERS (default 4), TIMEOUT (s).
# Usage (device machine, repo root): [LINKS="nvlink p2p_off_25GBps sockets_4GBps"] bash scripts/gpu/moe_dp2_param_gather.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout ${TIMEOUT:-540} python3 benchmarks/e2e_throughput.py --suite dp2_moe_param_gather --model configs/olmoe_1b_7b.yaml \
  --links ${LINKS:-p2p_off_25GBps} --variants ciera delta --num-layers ${LAYERS:-4} --seq-length 2048 --max-position-embeddings 2048 \
  --micro-batch-size 1 --global-batch-size 8 --deterministic-mode --params-checksum-interval 11 --log-dir $RES/logs_moe \
  --out $RES/e2e_dp2_moe_param_gather_olmoe_${LAYERS:-4}l.json 2>&1 | grep -E "speedup|Error"
grep -h "selection\|trial" $RES/logs_moe/*.log | sort | uniq -c | head -20
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.path.join(os.environ["RES"], "logs_moe", "*.jsonl"))):
    rows = [json.loads(l) for l in open(f)]
    print(os.path.basename(f), "loss[-1]", rows[-1]["loss"], "checksums", [r["params_checksum"][:12] for r in rows if "params_checksum" in r])
PY
