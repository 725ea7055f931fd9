#!/usr/bin/env bash
# Creates .venv (CPU torch first, so that pip never pulls a multi-GB CUDA build), then installs the
# project editable with the dev extras. Idempotent and quick once done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# One setup at a time: the README's two commands may start together on a fresh clone, and a venv seen half-made
# (python there, pip not yet) would fail the second.
exec 9>.venv.lock
flock 9
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "$TORCH_SPEC"
fi
if ! .venv/bin/python -c "import megatron.core, megatron.training, compression, pytest, yaml" 2>/dev/null; then
  .venv/bin/pip install -q -e ".[dev]"
fi
