"""Runs the e2e tests share (each launch is ~15-30 s on 2 cores): made once per session."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.helpers import DEFAULT_4_STEPS, moe_rl


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`moe-rl train` of the embedded default (parallel.nproc=2, EP=2) for 4 steps with
    ``DEFAULT_4_STEPS``, a checkpoint at step 2 and 4: its run dir and the finished process."""
    full = tmp_path_factory.mktemp("default_run") / "full"
    return full, moe_rl("train", f"run_dir={full}", *DEFAULT_4_STEPS)
