"""Small file-system helpers shared by the run checkpoints (``moe_rl/learner/checkpoint.py``) and the
HF checkpoint reader and writer (``moe_rl/weights/hf.py``), and the init-weights reader
(``moe_rl/weights/warmstart.py``): files read with a CheckpointError naming the file. Imports only
``moe_rl.errors`` from the package."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moe_rl.errors import CheckpointError


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    """A JSON file's content; CheckpointError naming the file (and line) when it is not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


@contextmanager
def open_safetensors(path: Path, name: str = "") -> Iterator[Any]:
    """``safe_open(path)``; CheckpointError naming the file (after ``name``, e.g. the config key)
    when it is not a (complete) safetensors file, also for errors raised while tensors are read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{name}{path}: not a readable safetensors file, or a truncated one ({str(e).splitlines()[0]})"
        ) from None
