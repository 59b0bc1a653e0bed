"""Statistics shared by the benchmarks (scripts/bench_*.py): the spread of a paired ratio over
interleaved repetitions, and the load the machine was under while they ran.

A benchmark times A and B alternately (A B, B A, A B, ...), so drift and other load hit both alike;
each repetition gives one paired ratio A_i / B_i. ``median_interval`` gives their median and a
distribution-free confidence interval for it from order statistics: [x_(k), x_(n+1-k)] of the
sorted values covers the true median with probability 1 - 2 P(Binomial(n, 1/2) <= k - 1), for
any continuous distribution, exactly (no resampling, no seed). The largest k whose coverage
reaches 95% is used; with fewer than 6 repetitions even [min, max] covers less than 95%
(1 - 2^(1-n): 75% at n = 3), and the line says so. A bootstrap interval of the median is
narrower than this and covers less than it claims at the 3-20 repetitions these scripts make.

``MachineLoad`` records os.getloadavg() before and after, and the CPU time of this process and
its finished children (the benchmark's rank processes or `moe-rl train` runs) against wall time:
CPUs busy well below the worker count, or a load above the CPU count, means other work shared the
machine and its figures carry that noise.

    python scripts/bench_replay.py ...   # imports this module from scripts/ (its own directory)
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Sequence

LEVEL = 0.95


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """num_i / den_i per repetition (the two lists pair up by index)."""
    if len(num) != len(den):
        raise ValueError(
            f"paired ratios need as many numerators as denominators, got {len(num)} and {len(den)}"
        )
    return [a / b for a, b in zip(num, den)]


def _binom_half_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_interval(xs: Sequence[float], level: float = LEVEL) -> tuple[float, float, float, float]:
    """(median, low, high, coverage): the order-statistic interval [x_(k), x_(n+1-k)] (1-based) with
    the largest k whose coverage 1 - 2 P(Bin(n, 1/2) <= k-1) is >= level; k = 1 ([min, max]) when
    none is, and then coverage < level. One value: (x, x, x, 0.0)."""
    if not xs:
        raise ValueError("median_interval needs at least one value")
    s = sorted(float(x) for x in xs)
    n = len(s)
    median = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    k = 1
    while k < (n + 1) // 2 and 1 - 2 * _binom_half_cdf(k, n) >= level:
        k += 1  # the interval from the (k+1)-th value still covers enough
    coverage = max(0.0, 1 - 2 * _binom_half_cdf(k - 1, n))
    return median, s[k - 1], s[n - k], coverage


def interval_text(xs: Sequence[float], fmt: str = ".3f", level: float = LEVEL) -> str:
    """'95% interval 0.951..1.020 (n paired reps, coverage 96.9%)', or the min..max and a warning
    when the reps are too few for ``level``."""
    _, lo, hi, cov = median_interval(xs, level)
    n = len(xs)
    if cov >= level:
        return f"{level:.0%} interval {lo:{fmt}}..{hi:{fmt}} ({n} paired reps, coverage {cov:.1%})"
    return (
        f"interval {lo:{fmt}}..{hi:{fmt}} = min..max of {n} paired reps, coverage only {cov:.0%} "
        f"(6 or more reps give {level:.0%})"
    )


def ratio_line(label: str, ratios: Sequence[float]) -> str:
    """'<label> 1.012 (median), 95% interval ...': the paired ratios' median and interval."""
    return f"{label} {median_interval(ratios)[0]:.3f} (median), {interval_text(ratios)}"


def _cpu_s() -> float:
    """User + system CPU seconds of this process and of its children that have ended."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class MachineLoad:
    """Load average and CPU time from construction to ``line()``."""

    def __init__(self) -> None:
        self.load0, self.wall0, self.cpu0 = os.getloadavg()[0], time.perf_counter(), _cpu_s()

    def line(self, workers: int) -> str:
        load1, wall, cpu = os.getloadavg()[0], time.perf_counter() - self.wall0, _cpu_s() - self.cpu0
        return (
            f"machine: {os.cpu_count()} CPUs, load average (1 min) {self.load0:.2f} before, "
            f"{load1:.2f} after; "
            f"CPU time {cpu:.1f} s over {wall:.1f} s wall = {cpu / max(wall, 1e-9):.2f} "
            f"CPUs busy for {workers} worker process{'es' if workers != 1 else ''}"
        )
