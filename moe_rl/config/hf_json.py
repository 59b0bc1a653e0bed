"""An HF ``config.json`` read by type (no torch): every key through one reader (``Keys``), so a
boolean is a JSON boolean, an integer a JSON integer, a number either, and ``"false"`` or 4.6 where
those belong is refused naming the file and the key, never coerced. What the keys mean per model
family is ``hf_model.py``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.errors import CheckpointError
from moe_rl.fsutil import read_json

CONFIG = "config.json"


def refuse(path: Path, key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: key {key!r} = {value!r}: {why}")


_REQUIRED = object()
_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object"}
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "list"}


def _is(value: Any, kind: type) -> bool:
    """JSON's types as written, nothing coerced: a bool is not an int, a float (4.0 too) is not an
    int, an int is a number."""
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind)


@dataclass(frozen=True)
class Keys:
    """``config.json`` read by type: every key is read through ``get``, so a value of the wrong type
    (``"false"`` for a boolean, 4.6 for an integer) is refused naming the file and the key instead
    of being coerced. ``prefix``: the dotted name of a nested object (``rope_scaling.``)."""

    raw: dict
    path: Path
    prefix: str = ""

    def get(self, key: str, kind: type, default: Any = _REQUIRED, items: type | None = None) -> Any:
        """``key``'s value, of ``kind`` (a list of ``items``); absent or null: ``default`` (HF
        writes null for "the default"), or CheckpointError if it is required."""
        name, value = self.prefix + key, self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                state = "null" if key in self.raw else "missing"
                raise CheckpointError(f"{self.path}: required key {name!r} is {state}")
            return default
        if kind is list:
            if not isinstance(value, list) or not all(_is(v, items) for v in value):
                raise refuse(self.path, name, value, f"expected a list of {_KIND_NAMES[items].split()[1]}s")
            return list(value)
        if not _is(value, kind):
            got = next(n for t, n in _JSON_TYPES.items() if isinstance(value, t))
            raise refuse(self.path, name, value, f"expected {_KIND_NAMES[kind]}, got a JSON {got}")
        return float(value) if kind is float else value

    def sub(self, key: str) -> Keys:
        """The object at ``key`` (absent or null: an empty one) as its own typed reader."""
        return Keys(dict(self.get(key, dict, {})), self.path, f"{self.prefix}{key}.")


def require(hf: Keys, key: str, kind: type, ok, why: str, default: Any = None) -> None:
    value = hf.get(key, kind, default)
    if not ok(value):
        raise refuse(hf.path, hf.prefix + key, value, why)


def read_hf_config(ckpt_dir: str | Path) -> dict:
    """``ckpt_dir/config.json`` as a dict; CheckpointError names the file."""
    path = Path(ckpt_dir) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist (an HF checkpoint directory has a config.json)")
    hf = read_json(path)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got a {type(hf).__name__}")
    return hf


def hf_keys(ckpt_dir: str | Path) -> Keys:
    """``ckpt_dir/config.json``'s typed reader (``Keys``)."""
    return Keys(read_hf_config(ckpt_dir), Path(ckpt_dir) / CONFIG)
