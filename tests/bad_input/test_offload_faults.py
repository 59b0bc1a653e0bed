"""bad_input tier, issue 32 point 2: a fault while the learner is offloaded for generation
(``parallel.offload_during_rollout=true``, moe_rl/learner/offload.py) ends the job cleanly, and
the run resumes exactly from its last checkpoint.

One run dir, three starts, against an uninterrupted 3-step run with offload on: a RuntimeError in
rank 1's generation of step 1 (exit 1, the rank's error once, the step-1 checkpoint kept); a
resume that gets Ctrl-C (SIGINT to the process group) inside rank 1's generation of step 2 (exit
130, the one "interrupted" line, no process left in the job's session); a resume to the end. Every
logged metric but timings equals the uninterrupted run's, the offloaded bytes included."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_helpers import TINY, last_lines, left_in_session, run_faulted
from tests.e2e.helpers import deterministic, metrics, moe_rl

ARGS = ["steps=3", "checkpoint_every=1", "parallel.offload_during_rollout=true", *TINY]


def _faulted(tmp_path: Path, kind: str, *args: str) -> tuple[int, str, int]:
    """`moe-rl train ARGS` with rank 1's second generation faulted; (exit code, stderr, session)."""
    return run_faulted(["generate", "1", kind, "train", *args])


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


@pytest.mark.bad_input
def test_fault_and_ctrl_c_during_offloaded_generation_end_cleanly_and_resume_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    moe_rl("train", f"run_dir={full}", *ARGS)

    code, err, _ = _faulted(tmp_path, "bug", f"run_dir={part}", *ARGS)
    assert code == 1, err[-3000:]
    assert err.count("RankFailedError: rank 1 failed with RuntimeError: injected fault at generate") == 1
    assert (sorted(metrics(part)), _latest(part)) == ([0], "step_000001")

    code, err, sid = _faulted(tmp_path, "sigint", f"run_dir={part}", "resume=true")
    assert code == 130, err[-3000:]
    [line] = last_lines(err, "interrupted")
    assert line.startswith("interrupted (SIGINT) at step 2; resume with: "), line
    assert "Traceback" not in err and "error:" not in err
    assert left_in_session(sid) == []
    assert (sorted(metrics(part)), _latest(part)) == ([0, 1], "step_000002")

    moe_rl("train", f"run_dir={part}", "resume=true")
    a, b = metrics(full), metrics(part)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in range(3):
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step} differs after the faults"
    assert a[2]["mem/offloaded_optimizer_gib"] > 0 and a[2]["mem/offloaded_params_gib"] > 0
