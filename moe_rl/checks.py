"""The checks every config dataclass's ``__post_init__`` runs: one ``ConfigError`` naming the key."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from moe_rl.errors import ConfigError


def check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


def check_finite(cfg: Any, prefix: str) -> None:
    """Every float field of one config dataclass is finite (``optim.lr=inf`` is refused here, not
    trained on)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key '{prefix}.{f.name}': {value} is not a finite number")


def one_of(value: str, key: str, choices: tuple[str, ...] | list[str]) -> None:
    hint = (
        " (YAML reads unquoted on/off/yes/no as booleans: quote the value)"
        if value in ("True", "False")
        else ""
    )
    check(value in choices, key, f"{value!r} is not one of {sorted(choices)}{hint}")
