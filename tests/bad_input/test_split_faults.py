"""bad_input tier, issue 33 point 8: in a split world (``parallel.rollout_ranks``) a fault on a
rollout rank or on a learner rank ends the whole job within seconds (the peers wait in a bridge
receive or a weight broadcast), with one line naming the rank and its role, and nothing of the job
left running (tests/bad_input/faults.py injects the fault). In each ``rollout.mode`` whose loop
differs: sync, and async (max_staleness=1), whose rollout ranks also run a background weight
receive and a sender thread per served dp rank that must not keep a process alive."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.bad_input.faults import STALE
from tests.cli_helpers import TINY, left_in_session, run_faulted

FAIL_FAST_S = 30.0
SPLIT = ["steps=2", "parallel.nproc=4", "parallel.rollout_ranks=2", "parallel.expert_parallel=2", *TINY]
MODES = {"sync": [], "async": ["rollout.mode=async", "rollout.max_staleness=1", "checkpoint_every=0"]}


def _faulted(tmp_path: Path, where: str, rank: int, kind: str, mode: str) -> tuple[int, str, float, int]:
    """(exit code, stderr, seconds from the fault to the job's end, the job's session id)."""
    stamp = tmp_path / "fault_time"
    args = [where, str(rank), kind, "train", f"run_dir={tmp_path / 'run'}", *SPLIT, *MODES[mode]]
    code, err, pid = run_faulted(args, {"MOE_RL_FAULT_STAMP": str(stamp)})
    end = time.time()
    assert stamp.is_file(), f"the fault never fired:\n{err[-3000:]}"
    return code, err, end - float(stamp.read_text()), pid


@pytest.mark.bad_input
@pytest.mark.parametrize("mode", MODES)
def test_a_rollout_rank_that_raises_ends_the_job_naming_rank_and_role(tmp_path, mode):
    # rank 3 = rollout rank 1; its second generate is step 1's batch (sync) or its dp rank's
    # request 1 (async): the learners of that dp rank wait for it
    code, err, after_s, sid = _faulted(tmp_path, "generate", 3, "bug", mode)
    assert code == 1, err[-3000:]
    assert after_s < FAIL_FAST_S
    line = "RankFailedError: rank 3 (rollout rank 1) failed with RuntimeError: injected fault at generate"
    assert err.count(line) == 1, err[-3000:]
    assert left_in_session(sid) == []


@pytest.mark.bad_input
@pytest.mark.parametrize("mode", MODES)
def test_a_learner_rank_that_raises_ends_the_job_naming_rank_and_role(tmp_path, mode):
    # the rollout ranks wait in the weight broadcast after step 0's batch (sync), or generate on
    # with a background receive waiting for it and senders waiting for the learners (async)
    code, err, after_s, sid = _faulted(tmp_path, "step", 1, "user", mode)
    assert code == 2, err[-3000:]
    assert after_s < FAIL_FAST_S
    lines = [x for x in err.splitlines() if "injected fault" in x]
    assert lines == ["error: rank 1 (learner rank 1): sample 3, layer 1, row 7: injected fault at step"]
    assert "Traceback" not in err
    assert left_in_session(sid) == []


@pytest.mark.bad_input
@pytest.mark.parametrize("mode", MODES)
def test_a_stale_tensor_on_a_rollout_rank_fails_the_checked_sync_naming_it(tmp_path, mode):
    """rollout.sync_check=true: rank 3's (rollout rank 1's) second load leaves one tensor stale; the
    root's checksums, broadcast after the weights, catch it on that rank (async: at the engine's
    first poll after the load) and the job ends naming the tensor."""
    stamp = tmp_path / "fault_time"
    args = ["stale_load", "3", "bug", "train", f"run_dir={tmp_path / 'run'}", *SPLIT, *MODES[mode]]
    code, err, sid = run_faulted([*args, "rollout.sync_check=true"], {"MOE_RL_FAULT_STAMP": str(stamp)})
    assert stamp.is_file(), f"the fault never fired:\n{err[-3000:]}"
    assert code == 1, err[-3000:]
    line = (
        "RankFailedError: rank 3 (rollout rank 1) failed with SyncCheckError: weight sync check failed "
        f"at sync 1: engine tensor '{STALE}': checksum "
    )
    assert err.count(line) == 1, err[-3000:]
    assert left_in_session(sid) == []
