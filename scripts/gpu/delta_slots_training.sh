#!/usr/bin/env bash
# GPT-125M DP=2 on one GPU (both ranks over gloo, wire_ratio_dp2_one_gpu.sh), ITERS (60) iterations at lr 1e-4 under
# --deterministic-mode with every gather checked against an uncompressed one: delta with the size exchange, then
# delta's sync-free gathers (--delta-capacity-factor 1.25; eager: gloo cannot be captured as a CUDA graph). Prints
# whether the two runs have the same loss and grad norm at every iteration, and the slot counters.
# Usage (device machine, repo root): [ITERS=60] bash scripts/gpu/delta_slots_training.sh
set -uo pipefail
export RUNS=delta:1e-4 ITERS=${ITERS:-60}
base="--param-gather-selection all --param-gather-trial-iters 0 --param-gather-verify-interval 1 --deterministic-mode"
EXTRA="$base" timeout 280 bash scripts/gpu/wire_ratio_dp2_one_gpu.sh 2>&1 | tail -2
mkdir -p /tmp/res/exchange && mv /tmp/res/dp2_one_gpu_* /tmp/res/exchange/
EXTRA="$base --delta-capacity-factor 1.25" timeout 280 bash scripts/gpu/wire_ratio_dp2_one_gpu.sh 2>&1 | tail -2
python3 - <<'PY'
import json
a = [json.loads(l) for l in open("/tmp/res/exchange/dp2_one_gpu_delta_lr1e-4.jsonl")]
b = [json.loads(l) for l in open("/tmp/res/dp2_one_gpu_delta_lr1e-4.jsonl")]
same = [x["loss"] == y["loss"] and x.get("grad_norm") == y.get("grad_norm") for x, y in zip(a, b)]
print(f"iterations {len(a)} / {len(b)}, identical loss and grad norm in {sum(same)}, last loss {a[-1]['loss']} / {b[-1]['loss']}")
c = {k: sum(r.get("comm_counters", {}).get(k, 0) for r in b) for k in ("dp_param_gather/slot_gathers", "dp_param_gather/slot_overflows")}
print("slots:", c)
PY
