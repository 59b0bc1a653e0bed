"""Name -> function registries, one per algorithm family (advantages, rewards, tasks, ...).

Names are checked when the config loads; a duplicate registration is an error, not an override.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict[str, F], Generic[F]):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding ``fn`` under ``name``; a name already taken raises ValueError."""

        def deco(fn: F) -> F:
            if name in self:
                old = self[name]
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {old.__module__}.{old.__qualname__})"
                )
            self[name] = fn
            return fn

        return deco

    def check(self, name: str) -> None:
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {sorted(self)}")

    def lookup(self, name: str) -> F:
        self.check(name)
        return self[name]
