#!/usr/bin/env bash
# Local launcher (one machine, torchrun). Environment variables pick the run; extra arguments are passed
# through to the trainer and win over the config:
#   CONFIG=configs/gpt_125m.yaml TP=2 PP=2 NPROC=8 scripts/launch_gpt.sh --tp-comm-compression taco
# CONFIG  YAML of model/training flags          [configs/tiny_cpu_gpt.yaml]
# TP, PP  tensor- and pipeline-parallel sizes   [1, 1]
# DP      data-parallel size; NPROC = TP x PP x DP processes (or give NPROC, and DP = NPROC / (TP x PP))
# VPP     virtual stages per pipeline rank (interleaved schedule)  [off]
# SP=1    sequence parallelism (needs TP > 1)   [off]
# ENTRY   trainer script                        [pretrain_gpt.py]; PYTHON [.venv/bin/python if present]
# Without GPUs the ranks run on CPU (gloo), one thread each.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/tiny_cpu_gpt.yaml}
TP=${TP:-1}
PP=${PP:-1}
NPROC=${NPROC:-$((TP * PP * ${DP:-1}))}
ENTRY=${ENTRY:-pretrain_gpt.py}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

PARALLEL_FLAGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
if [ -n "${VPP:-}" ]; then PARALLEL_FLAGS+=(--num-virtual-stages-per-pipeline-rank "$VPP"); fi
if [ "${SP:-0}" = 1 ]; then PARALLEL_FLAGS+=(--sequence-parallel); fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
fi

echo "launch: $ENTRY config=$CONFIG nproc=$NPROC TP=$TP PP=$PP DP=$((NPROC / (TP * PP))) ${PARALLEL_FLAGS[*]} $*"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$ENTRY" \
  --config "$CONFIG" "${PARALLEL_FLAGS[@]}" "$@"
