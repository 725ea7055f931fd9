#!/usr/bin/env bash
# The test command of the README: sets up .venv on first use, then runs the CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"
