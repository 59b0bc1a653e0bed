#!/usr/bin/env bash
# Lint and format check (ruff, configured in pyproject.toml): the tree must be clean under both.
# `bash scripts/lint.sh --fix` formats and applies ruff's safe fixes instead of only checking.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pip install -q -e ".[lint]"
if [ "${1:-}" = "--fix" ]; then
  .venv/bin/ruff format .
  .venv/bin/ruff check --fix .
else
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
fi
