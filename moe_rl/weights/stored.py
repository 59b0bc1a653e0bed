"""Canonical weights in safetensors files: checked from the file headers, read on demand.

Start-up never holds the whole model (issue 32, docs/design.md 2.2): preflight checks names, shapes
and dtypes from the headers alone (``read_header``: safetensors' ``safe_open`` parses the JSON
header and checks that the data region covers the file; no tensor data is read), and each rank
then reads only the tensors and slices its shard holds (``StoredWeights.read``: ``get_slice`` of
rows or columns), in their stored dtype; they are converted when copied into a parameter.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_rl.errors import CheckpointError
from moe_rl.fsutil import open_safetensors

# safetensors' dtype names (its header's "dtype" field)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, as its header describes it (``shape`` and ``dtype`` are
    what ``CanonicalCheck`` reads, as from a tensor)."""

    path: Path
    name: str  # its name in the file (an HF family's own, see weights/hf.py)
    shape: tuple[int, ...]
    dtype: torch.dtype


def read_header(path: Path, what: str = "") -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Every tensor of a safetensors file (name -> StoredTensor) and its metadata, from the header
    only. CheckpointError (after ``what``, e.g. the config key) for a file that is not safetensors
    or is cut short, or a tensor of a dtype torch has not."""
    out: dict[str, StoredTensor] = {}
    with open_safetensors(path, what) as f:
        meta = dict(f.metadata() or {})
        for name in f.keys():
            s = f.get_slice(name)
            stored = s.get_dtype()
            if stored not in DTYPES:
                raise CheckpointError(
                    f"{what}{path}: tensor {name!r} has dtype {stored}, which torch has not"
                )
            out[name] = StoredTensor(path, name, tuple(s.get_shape()), DTYPES[stored])
    return out, meta


class StoredWeights(Mapping[str, StoredTensor]):
    """Canonical name -> where the tensor is stored; ``read`` loads one tensor or one slice.

    Used as a context manager, the files stay open across reads (one header parse per file);
    outside one, each read opens its file."""

    def __init__(self, tensors: Mapping[str, StoredTensor], what: str = "") -> None:
        self.tensors, self.what = dict(tensors), what
        self._stack: ExitStack | None = None
        self._open: dict[Path, Any] = {}

    def __getitem__(self, name: str) -> StoredTensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __enter__(self) -> StoredWeights:
        self._stack = ExitStack()
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack, self._open = self._stack, None, {}
        if stack is not None:
            stack.close()

    def _file(self, path: Path, stack: ExitStack) -> Any:
        if path not in self._open:
            self._open[path] = stack.enter_context(open_safetensors(path, self.what))
        return self._open[path]

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """Tensor ``name`` in its stored dtype; with ``dim`` (0 or 1) only ``[start, stop)`` along it."""
        t = self.tensors[name]
        if self._stack is not None:
            return _read(self._file(t.path, self._stack), t.name, dim, start, stop)
        with ExitStack() as once:
            f = once.enter_context(open_safetensors(t.path, self.what))
            return _read(f, t.name, dim, start, stop)

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor, whole, in its stored dtype: the whole model (tools, tests, the engines'
        first load); training ranks read their shard through ``read``."""
        with self:
            return {k: self.read(k) for k in self.tensors}


def _read(f: Any, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
    if dim is None:
        return f.get_tensor(name)
    s = f.get_slice(name)
    if dim == 0:
        return s[start:stop]
    if dim == 1:
        return s[:, start:stop]
    raise ValueError(f"tensor {name!r}: slices are read along dim 0 or 1, not {dim}")
