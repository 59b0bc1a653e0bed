"""bad_input tier, fail fast across ranks (issue 14 point 2): a fault injected on one of two ranks
(tests/bad_input/faults.py) at start-up, mid-step inside a collective, and during a checkpoint save
ends the whole job within seconds, the launcher shows the failing rank's own error once, and no
rank waits for a peer (before: rank 0 sat in a barrier until gloo's 10-minute timeout). And a run
that goes on but stopped learning is not silent: its health alarms (point 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_helpers import ROOT, TINY

FAIL_FAST_S = 30.0  # from the fault to the end of the job (the elastic agent polls every 0.1 s)


def run_with_fault(tmp_path: Path, where: str, rank: int, kind: str, *args: str):
    stamp = tmp_path / "fault_time"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MOE_RL_FAULT_STAMP": str(stamp), "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "tests.bad_input.faults",
        where,
        str(rank),
        kind,
        "train",
        f"run_dir={tmp_path / 'run'}",
        *TINY,
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    end = time.time()
    assert stamp.is_file(), f"the fault never fired:\n{proc.stderr[-3000:]}"
    after_s = end - float(stamp.read_text())
    print(f"{where} fault on rank {rank} -> job ended {after_s:.2f} s later (pytest -s shows this)")
    return proc, after_s


@pytest.mark.bad_input
def test_fault_at_startup_is_one_line_user_error(tmp_path):
    proc, after_s = run_with_fault(tmp_path, "startup", 1, "user", "steps=2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert after_s < FAIL_FAST_S
    lines = [x for x in proc.stderr.splitlines() if "injected fault" in x]
    assert lines == ["error: rank 1: sample 3, layer 1, row 7: injected fault at startup"]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # the failed start is undone: the same command can run again


@pytest.mark.bad_input
def test_fault_mid_step_in_a_collective_shows_the_rank_traceback_once(tmp_path):
    proc, after_s = run_with_fault(tmp_path, "step", 1, "bug", "steps=2")
    assert proc.returncode == 1
    assert after_s < FAIL_FAST_S
    err = proc.stderr
    assert err.count("RankFailedError: rank 1 failed with RuntimeError: injected fault at step") == 1
    assert err.count("--- rank 1 traceback ---") == 1
    assert err.count("RuntimeError: injected fault at step") == 2  # the summary line and the rank's own
    assert "m_update = update_policy(plan, learner, train_batch, lr)" in err  # where it happened
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.bad_input
def test_fault_during_checkpoint_save_on_rank_0(tmp_path):
    proc, after_s = run_with_fault(tmp_path, "save", 0, "bug", "steps=1", "checkpoint_every=1")
    assert proc.returncode == 1
    assert after_s < FAIL_FAST_S
    assert proc.stderr.count("RankFailedError: rank 0 failed with RuntimeError: injected fault at save") == 1
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))  # nothing half-written is kept


@pytest.mark.bad_input
def test_learning_rate_that_flattens_the_policy_raises_health_alarms(tmp_path):
    """optim.lr=1e3 trains on (the run is not stopped) but no longer silently: the policy goes
    uniform (entropy ln 50) with a zero gradient, and both alarms reach events.jsonl and the report."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        f"run_dir={run}",
        "steps=3",
        "checkpoint_every=0",
        "optim.lr=1e3",
        "log.health.patience=2",
        *TINY,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["event"], e["alarm"]) for e in events] == [
        (2, "health", "entropy_uniform"),
        (2, "health", "grad_norm_zero"),
    ]
    assert events[0]["cause"] == (
        "policy entropy 3.912 nats >= 0.95 ln(V=50) = 3.716: the policy is uniform "
        "for 2 consecutive steps (steps 1-2; log.health)"
    )
    assert "[rank0] WARNING moe_rl.health: health alarm at step 2: gradient norm exactly 0" in proc.stderr
    rep = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "report", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert rep.returncode == 0, rep.stderr[-3000:]
    # the report's verdict names the first alarm's start (patience 2: step 1) and what to try
    assert rep.stdout.splitlines()[0].startswith(
        f"verdict: act: health alarm from step 1 (entropy_uniform: {events[0]['cause']}); "
        "try a lower optim.lr, "
    )
    md = (run / "report" / "report.md").read_text()
    assert "- run: health alarm grad_norm_zero at step 2: gradient norm exactly 0 in every minibatch" in md
