#!/usr/bin/env bash
# Install into .venv and run the embedded default: a tiny MoE (megatron-core, EP=2 over 2 local
# ranks) learns verifiable string tasks by GRPO on CPU. Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/moe-rl train "$@"
