"""Per-step wall-clock phases, as ``time/<phase>_s`` metrics (plain numbers: rank-local timings),
the step's peak device memory (``mem/peak_gib``, the maximum over ranks), and the process's peak
host memory per phase (``MemoryTimeline``: ``run_dir/memory_timeline.jsonl``, docs/design.md 2.2)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from moe_rl.metrics import Max


def host_memory() -> tuple[int, int]:
    """(peak RSS so far, current RSS) of this process in bytes, from /proc/self/status (VmHWM,
    VmRSS); (0, 0) where there is none (not Linux)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0, 0
    kb = {
        k: int(v.split()[0])
        for k, v in (ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
        if k in ("VmHWM", "VmRSS")
    }
    return kb.get("VmHWM", 0) * 1024, kb.get("VmRSS", 0) * 1024


class MemoryTimeline:
    """This process's RSS at the end of each named phase, and its peak so far (VmHWM, sampled: the
    phase after which it has risen is the one that reached it; nothing is reset, so the process's
    own peak, and ``getrusage``'s, stay whole for other tools). Records are kept until ``attach``
    names the file (the run directory exists only after start-up), then appended to it as they
    come, one JSON line each (every rank appends its own lines to the one file)."""

    def __init__(self, rank: int | str = 0) -> None:
        self.rank = rank
        self.records: list[dict] = []
        self.path: Path | None = None

    @contextmanager
    def span(self, name: str, step: int | None = None) -> Iterator[None]:
        t0 = time.time()  # wall clock: scripts/gpu_smoke.sh's device samples are matched by time
        try:
            yield
        finally:
            peak, rss = host_memory()
            self.records.append(
                {
                    "rank": self.rank,
                    "step": step,
                    "phase": name,
                    "peak_rss_gib": round(peak / 2**30, 4),
                    "rss_gib": round(rss / 2**30, 4),
                    "t0": round(t0, 3),
                    "t1": round(time.time(), 3),
                }
            )
            self._flush()

    def attach(self, path: Path) -> None:
        """From now on the records go to ``path`` (those kept so far first)."""
        self.path = Path(path)
        self._flush()

    def _flush(self) -> None:
        if self.path is None or not self.records:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)  # rank 0 may not have made run_dir yet
        with open(self.path, "a", encoding="utf-8") as f:  # lines < 4 KiB: O_APPEND keeps them whole
            f.write("".join(json.dumps(r) + "\n" for r in self.records))
        self.records = []


class StepTimer:
    """A step's phases in seconds (``time/<phase>_s``); with a ``MemoryTimeline``, each phase's peak
    host RSS goes to it too."""

    def __init__(self, memory: MemoryTimeline | None = None, step: int | None = None) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.memory, self.step = memory, step

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        with self.memory.span(name, self.step) if self.memory is not None else nullcontext():
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
