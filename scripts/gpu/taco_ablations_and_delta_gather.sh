#!/usr/bin/env bash
# GPU call (2x H200, ~7 min): (1) the delta codec's parameter all-gather at ~25 GB/s with the atomic-OR
# encoder and tiled gather/stream-size kernels (before: 3.59 ms vs 5.14 ms NCCL, param_gather_delta_v2_p2p_off.json);
# (2) TACO's convergence ablations on GPT-125M (TP=2, every TP tensor compressed, 300 iterations): every
# variant of scripts/convergence.py's taco family but hadamard_single, one after another (~100 s each alone;
# session 5 ran them 8 at once: out of GPU memory, then 4 at once: each 4-5x slower than alone).
# SKIP_GATHER=1 skips (1); VARIANTS (default all eight) picks the variants: 4 take ~420 s (session 6).
# BASELINE_JSONL=path (.jsonl or .jsonl.gz) reuses a baseline trained by an earlier call of this script (same
# flags) instead of training it again: it is copied into the output folder and the variants run with --reuse.
# Usage (device machine, repo root): bash scripts/gpu/taco_ablations_and_delta_gather.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
[ -n "${SKIP_GATHER:-}" ] || NCCL_P2P_DISABLE=1 timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
  --out $RES/param_gather_delta_atomic_p2p_off.json 2>&1 | grep -v -i warn | tail -4
OUT_DIR=$RES/taco_convergence_gpu_ablations
VARIANTS=${VARIANTS:-baseline taco naive_fp8 ds_only hadamard_ds e5m2 int8 hadamard_int8}
REUSE=""
if [ -n "${BASELINE_JSONL:-}" ]; then
  mkdir -p $OUT_DIR && cp "$BASELINE_JSONL" "$OUT_DIR/baseline.jsonl${BASELINE_JSONL##*.jsonl}" && REUSE="--reuse"
  VARIANTS="baseline $VARIANTS"
fi
timeout 560 python3 scripts/taco_convergence.py --preset gpu-125m --jobs 1 $REUSE --variants $VARIANTS \
  --out-dir $OUT_DIR --taco-all-reduce two-shot 2>&1 | grep -v -i warn | tail -14
