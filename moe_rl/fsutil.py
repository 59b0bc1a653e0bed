"""Small file-system helpers shared by the run checkpoints (``moe_rl/learner/checkpoint.py``), the
HF checkpoint reader and writer (``moe_rl/weights/hf.py``), the init-weights reader
(``moe_rl/weights/warmstart.py``) and the run's saved config (``moe_rl/trainer.py``): files read
with a CheckpointError naming the file, written atomically. Imports only ``moe_rl.errors`` from
the package."""

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


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temporary file and a rename: a crash leaves
    the old content or the new, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
