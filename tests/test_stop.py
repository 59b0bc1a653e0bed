"""The launcher's stop handler (``moe_rl.stop.GracefulStop``, issue 42) in this process, with real
signals and timers: the first signal writes the request a rank reads, the second stops at once, the
grace's end stops without a checkpoint, and ranks that stopped become the checkpoint's
``JobInterrupted``. The whole path through real ranks is tests/e2e and tests/bad_input/test_job_end.py."""

from __future__ import annotations

import signal
import time

import pytest

from moe_rl import stop
from moe_rl.stop import GracefulStop, JobInterrupted, Stopped


@pytest.fixture
def handlers():
    saved = signal.getsignal(signal.SIGALRM)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, saved)
    stop.watch(None)


@pytest.mark.unit
def test_first_signal_asks_the_ranks_then_the_grace_ends_the_job(tmp_path, capsys, handlers):
    g = GracefulStop(tmp_path, 0.2)
    stop.watch(tmp_path / stop.STOP_FILE)  # as each rank does (launch._guarded)
    assert stop.requested() == 0
    t0 = time.monotonic()
    g(signal.SIGTERM, None)
    assert stop.requested() == signal.SIGTERM  # what the learner ranks all-reduce at the step's end
    assert capsys.readouterr().err == (
        "SIGTERM: finishing the step in progress and saving a checkpoint (within stop_grace_s=0.2 s); "
        "a second SIGTERM stops at once\n"
    )
    with pytest.raises(JobInterrupted) as e:
        time.sleep(5)
    assert 0.2 <= time.monotonic() - t0 < 2
    assert (e.value.signum, e.value.exit_code, e.value.grace_s, e.value.checkpoint) == (15, 143, 0.2, None)


@pytest.mark.unit
def test_second_signal_stops_at_once_and_stopped_ranks_name_their_checkpoint(tmp_path, handlers):
    g = GracefulStop(tmp_path, 60)
    g.stopped({0: None, 1: None})  # no request: nothing to say
    g(signal.SIGINT, None)
    with pytest.raises(JobInterrupted) as e:
        g(signal.SIGINT, None)
    assert (e.value.signum, e.value.grace_s, e.value.checkpoint) == (2, None, None)
    g.stopped({0: None, 1: None})  # the run reached its last step first: it finished
    with pytest.raises(JobInterrupted) as e:
        g.stopped({0: Stopped(4, signal.SIGINT), 1: None})  # a rollout rank returns None
    assert (e.value.signum, e.value.exit_code, e.value.checkpoint) == (2, 130, 4)


@pytest.mark.unit
def test_a_torchrun_rank_takes_its_first_signal_as_the_request(handlers):
    """``handle_signals`` (an external torchrun): the first SIGTERM only sets the flag, and so do
    the repeats (Slurm's and the agent's copies of one stop): the process lives on, the first kept."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop.handle_signals()
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested() == signal.SIGTERM and stop.agreed() == signal.SIGTERM  # no group: itself
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert stop.requested() == signal.SIGTERM
    finally:
        stop._signum = 0
        for sig, h in saved.items():
            signal.signal(sig, h)
