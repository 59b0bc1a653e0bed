"""Small file-system helpers shared by the run checkpoints (``moe_rl/learner/checkpoint.py``) and the
HF checkpoint writer (``moe_rl/hf_checkpoint.py``); imports nothing from the package."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
