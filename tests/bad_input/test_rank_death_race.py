"""bad_input tier: a killed rank is named even when its peer fails first in the launcher's eyes.

When rank 1 is killed (kill -9, the OOM killer), rank 0 fails at its next collective with a lost
connection and records that failure. Both may be dead before torch's elastic agent next polls its
ranks (every 0.1 s), and the agent then reports only one of them, the lower rank. The launcher
watches every rank's exit itself (``moe_rl.launch``) and names the one that went first: here rank 0
raises the moment rank 1 is dead, as fast as any real peer could notice, so the agent sees both
dead at once in nearly every run; the cause must still be rank 1's SIGKILL, every time."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from moe_rl.launch import spawn_local
from moe_rl.rank_errors import RankDiedError


def _dead(pid: int) -> bool:
    """A zombie (dead, not yet reaped by the launcher) or gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _rank(where: str) -> None:
    pid_file = Path(where) / "rank1.pid"
    if os.environ["RANK"] == "1":
        pid_file.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    pid = int(pid_file.read_text())
    while not _dead(pid):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    raise RuntimeError("connection closed by peer")  # what gloo says once rank 1 is gone


@pytest.mark.bad_input
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_killed_rank_is_the_cause_not_the_peer_that_noticed(tmp_path):
    for run in range(3):  # each run is a race the agent alone would lose in most runs
        where = tmp_path / str(run)
        where.mkdir()
        with pytest.raises(RankDiedError) as e:
            spawn_local(_rank, 2, str(where))
        assert (e.value.rank, e.value.exitcode) == (1, -signal.SIGKILL)
        assert str(e.value) == (
            "rank 1 was killed by SIGKILL, likely the kernel's out-of-memory killer: host memory ran out "
            "(or a kill -9 from outside); the job stopped"
        )
