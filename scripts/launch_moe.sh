#!/usr/bin/env bash
# Local MoE launcher: scripts/launch_gpt.sh (same variables) with pretrain_moe.py and expert parallelism.
#   CONFIG=configs/olmoe_1b_7b.yaml TP=1 PP=1 EP=8 NPROC=8 scripts/launch_moe.sh [extra flags]
# EP   expert-parallel size   [1]; ETP  tensor-parallel size inside experts   [TP]
set -euo pipefail
EXPERT_FLAGS=(--expert-model-parallel-size "${EP:-1}")
if [ -n "${ETP:-}" ]; then EXPERT_FLAGS+=(--expert-tensor-parallel-size "$ETP"); fi
CONFIG=${CONFIG:-configs/tiny_cpu_moe.yaml} ENTRY=pretrain_moe.py \
  exec bash "$(dirname "$0")/launch_gpt.sh" "${EXPERT_FLAGS[@]}" "$@"
