#!/usr/bin/env bash
# CI's slurm tier (issue 43): installs Debian's slurm-wlm and munge (9 packages, ~3.5 MB) where
# missing, then runs the `slurm`-marked tests (tests/e2e/test_slurm.py: a one-host Slurm started and
# stopped by scripts/slurm_local.sh, the project's sbatch script submitted to it) with
# MOE_RL_REQUIRE_SLURM=1, so a missing Slurm fails them instead of skipping. Runs as root (the
# daemons do). .ci/run runs it after scripts/test.sh; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
    || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; }
fi
export WANDB_MODE=offline MOE_RL_REQUIRE_SLURM=1
PYTHONPATH="$PWD" .venv/bin/python -m pytest -m slurm -p no:cacheprovider -q tests/e2e/test_slurm.py "$@"
