"""Per-step wall-clock phases, as ``time/<phase>_s`` metrics (plain numbers: rank-local timings)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StepTimer:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """Every phase, and the whole step so far."""
        return {**{f"time/{k}_s": v for k, v in self.seconds.items()}, "time/step_s": time.perf_counter() - self.start}
