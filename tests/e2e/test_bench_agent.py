"""e2e tier (a subprocess of ~10 s), issue 44 point 8: scripts/bench_agent.py --quick runs both
route-return arms interleaved and prints their ratio, route bytes by turns (full return above
append-only from the second turn on, by more as turns grow), the verifier's cost at its default
interval, and the clean run's mismatch rate, which is 0 at the default margin here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
NUM = r"([0-9.]+)"


def test_bench_agent_quick_prints_ratios_bytes_by_turns_and_the_verifier_cost():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_agent.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(rf"rollout time full / append: {NUM} \(median\)", out)
    rows = [
        (int(k), float(a), float(f), float(r))
        for k, a, f, r in re.findall(rf"^turns (\d+): {NUM} {NUM} {NUM} ", out, re.M)
    ]
    assert len(rows) >= 2
    for k, a, f, r in rows:
        assert r == pytest.approx(f / a, abs=1e-3) and (r > 1 if k >= 2 else r == 1)
    assert rows[-1][3] > rows[0][3]  # quadratic against linear: the gap grows with the turns
    every, share = re.search(
        rf"4 samples every (\d+) steps; {NUM} s a verify \(median\), {NUM} of the rollout", out
    ).group(1, 3)
    assert int(every) == 10 and 0 < float(share) <= 0.03
    assert re.search(
        r"clean run, margin 0\.01: 0 of \d+ compared \(row, layer\) pairs mismatch = 0\.000000", out
    )
