#!/usr/bin/env bash
# Wheels for scripts/gpu_smoke.sh on a GPU machine without network that already has CUDA torch
# (and transformers, safetensors, matplotlib, jinja2, click, tqdm, psutil, einops, pyyaml):
# megatron-core 0.19.x for Python 3.12, omegaconf, antlr4-python3-runtime (its runtime dependency;
# PyPI has only an sdist, so it is built into a wheel here) and the test extras. Run it where PyPI is
# reachable; the folder (about 3 MB) stays far under the device tool's 64 MiB. The project itself
# runs from its source tree (PYTHONPATH), so it needs no wheel.
#
#   bash scripts/make_gpu_wheels.sh OUT_DIR [PYTHON_VERSION=3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: make_gpu_wheels.sh OUT_DIR [PYTHON_VERSION]}
PYV=${2:-3.12}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
dl() { $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --platform manylinux2014_x86_64 \
         --platform manylinux_2_28_x86_64 --platform any -d "$OUT" "$@"; }
dl "megatron-core>=0.19,<0.20" "omegaconf>=2.3,<2.5" "html5lib>=1.1" "webencodings" "pytest-timeout>=2.3"
$PY -m pip wheel -q --no-deps -w "$OUT" "antlr4-python3-runtime==4.9.3"
ls -la "$OUT"
du -sh "$OUT"
