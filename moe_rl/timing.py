"""Per-step wall-clock phases, as ``time/<phase>_s`` metrics (plain numbers: rank-local timings),
and the step's peak device memory (``mem/peak_gib``, the maximum over ranks)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from moe_rl.metrics import Max


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
        return {
            **{f"time/{k}_s": v for k, v in self.seconds.items()},
            "time/step_s": time.perf_counter() - self.start,
        }


def memory_metrics(device: torch.device) -> dict:
    """The step's peak allocated device memory (CUDA only; the peak counter restarts per step)."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"mem/peak_gib": Max(peak)}
