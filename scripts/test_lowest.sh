#!/usr/bin/env bash
# The floors check: every lower bound in pyproject.toml must pass the unit tier.
# Installs the LOWEST version each direct dependency allows (uv --resolution lowest-direct; e.g.
# megatron-core 0.16.1, omegaconf 2.3.0, numpy 1.26.0) into a separate venv, .venv-lowest, and runs
# `pytest -m unit` there (extra arguments go to pytest). CI runs it after scripts/test.sh.
# torch goes in first with pip and without its dependencies: pip takes the CPU wheel on this
# machine's disk, 2.13.0 is also torch's floor, so uv keeps it (it never downloads a CUDA torch
# here; checked below) and resolves torch's own dependencies (jinja2, ...) to their floors too.
# `--install-only` makes and checks the venv and stops (.ci/run does that in the background during
# the main suite, then runs this script with MOE_RL_LOWEST_VENV_READY=1: the tests only).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LOWEST_VENV:-.venv-lowest}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ "${MOE_RL_LOWEST_VENV_READY:-0}" != 1 ]; then
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --no-deps "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "uv>=0.9,<1"
"$VENV/bin/uv" pip install -q -p "$VENV/bin/python" --resolution lowest-direct -r pyproject.toml --extra test
"$VENV/bin/python" - <<'PY'
# The venv must hold torch's CPU build and, for every direct dependency, exactly its floor: a
# package above its floor means something else requires more, so the floor is not tested.
import importlib.metadata as md
import tomllib

import torch
from packaging.requirements import Requirement
from packaging.version import Version

assert torch.__version__ == "2.13.0+cpu", f"expected the CPU torch 2.13.0, got {torch.__version__}"
cuda = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia"))
assert not cuda, f"CUDA packages in the lowest-direct venv: {cuda}"
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
rows, above = [], []
for req in reqs:
    if req.marker is not None and not req.marker.evaluate():
        continue
    floors = [s.version for s in req.specifier if s.operator == ">="]
    installed = Version(md.version(req.name))
    rows.append(f"{req.name} {installed}")
    if floors and Version(installed.base_version) != Version(floors[0]):
        above.append(f"{req.name}: floor {floors[0]}, installed {installed}")
print("lowest-direct:", ", ".join(rows))
assert not above, ("direct dependencies above their floor (another package requires more; raise the "
                   "floor in pyproject.toml to the installed version):\n  " + "\n  ".join(above))
PY
fi
[ "${1:-}" = "--install-only" ] && exit 0
export WANDB_MODE=offline
PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -m unit -p no:cacheprovider -q "$@"
