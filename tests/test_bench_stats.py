"""unit tier: scripts/bench_stats.py, the spread and load lines every scripts/bench_*.py prints."""

from __future__ import annotations

import pytest

from tests.script_module import script_module


def _stats():
    return script_module("bench_stats")


@pytest.mark.unit
def test_median_interval_is_the_order_statistic_interval():
    bs = _stats()
    # 20 values: [x_(6), x_(15)] covers the median with 1 - 2 P(Bin(20, 1/2) <= 5) = 1 - 2 * 21700 / 2^20
    xs = [float(v) for v in (13, 2, 20, 7, 1, 16, 9, 4, 18, 11, 6, 15, 3, 19, 8, 12, 5, 17, 10, 14)]
    assert bs.median_interval(xs) == (10.5, 6.0, 15.0, 1 - 2 * 21700 / 2**20)
    # 6 values: only [min, max] reaches 95% (1 - 2/64); an outlier moves neither the median nor the
    # lower bound
    assert bs.median_interval([1.25, 0.75, 1.5, 1.0, 1.125, 9.0]) == (1.1875, 0.75, 9.0, 62 / 64)
    # 9 values: [x_(2), x_(8)], 1 - 2 * 10 / 512
    assert bs.median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5]) == (5.0, 2.0, 8.0, 1 - 20 / 512)
    # too few for 95%: [min, max] and its smaller coverage
    assert bs.median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0, 0.75)
    assert bs.median_interval([7.0]) == (7.0, 7.0, 7.0, 0.0)
    with pytest.raises(ValueError):
        bs.median_interval([])


@pytest.mark.unit
def test_paired_ratios_and_lines():
    bs = _stats()
    assert bs.paired_ratios([2.0, 3.0, 5.0], [1.0, 2.0, 4.0]) == [2.0, 1.5, 1.25]
    with pytest.raises(ValueError):
        bs.paired_ratios([1.0], [1.0, 2.0])
    ratios = [1.25, 0.75, 1.5, 1.0, 1.125, 9.0]
    assert bs.ratio_line("ratio r3/off", ratios) == (
        "ratio r3/off 1.188 (median), 95% interval 0.750..9.000 (6 paired reps, coverage 96.9%)"
    )
    assert bs.interval_text([1.0, 1.2, 0.8]) == (
        "interval 0.800..1.200 = min..max of 3 paired reps, coverage only 75% (6 or more reps give 95%)"
    )


@pytest.mark.unit
def test_machine_load_line(monkeypatch):
    bs = _stats()
    clock = iter([(3.5, 100.0, 20.0), (5.25, 130.0, 71.0)])  # (load, wall s, CPU s) before, after

    def now():
        now.cur = next(clock)
        return now.cur

    monkeypatch.setattr(bs.os, "getloadavg", lambda: (now()[0], 0.0, 0.0))
    monkeypatch.setattr(bs.time, "perf_counter", lambda: now.cur[1])
    monkeypatch.setattr(bs, "_cpu_s", lambda: now.cur[2])
    monkeypatch.setattr(bs.os, "cpu_count", lambda: 2)
    load = bs.MachineLoad()
    assert load.line(2) == (
        "machine: 2 CPUs, load average (1 min) 3.50 before, 5.25 after; CPU time 51.0 s "
        "over 30.0 s wall = 1.70 CPUs busy for 2 worker processes"
    )
