#!/usr/bin/env bash
# Install into .venv and run the CPU test suite: unit + dist + e2e tiers (gpu tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export WANDB_MODE=offline
.venv/bin/python -m pytest "$@"
