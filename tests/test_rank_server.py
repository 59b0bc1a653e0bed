"""moe_rl/rank_server.py: a CPU launch forks its ranks from a server that imported what a rank
imports; each rank sees the launcher's environment as it is at the launch, not as it was when the
server started. The server's other rules (it dies with the launcher, it keeps a killed rank's exit
status) are held by tests/bad_input/test_job_end.py and test_rank_death_race.py."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from moe_rl import rank_server
from moe_rl.launch import spawn_local


def _rank() -> dict:
    return {
        "parent": os.getppid(),
        "megatron_imported_before_the_rank_ran": "megatron.core" in sys.modules,
        "dynamo_too": "torch._dynamo" in sys.modules,
        "set": os.environ.get("MOE_RL_TEST_SET"),
        "changed": os.environ.get("MOE_RL_TEST_CHANGED"),
        "unset": os.environ.get("MOE_RL_TEST_UNSET"),
        "rank": os.environ["RANK"],
    }


@pytest.mark.bad_input
def test_cpu_ranks_are_forked_from_the_server_with_the_launchers_environment_now(monkeypatch):
    monkeypatch.setenv("MOE_RL_TEST_CHANGED", "before")
    monkeypatch.setenv("MOE_RL_TEST_UNSET", "before")
    assert rank_server.start()
    assert rank_server.start()  # the same server
    server = rank_server.server_pid()
    monkeypatch.setenv("MOE_RL_TEST_SET", "after")
    monkeypatch.setenv("MOE_RL_TEST_CHANGED", "after")
    monkeypatch.delenv("MOE_RL_TEST_UNSET")
    out = spawn_local(_rank, 2)
    assert rank_server.server_pid() == server  # it outlives the job, for the next one
    # PR_GET_CHILD_SUBREAPER (37): the launcher was a child subreaper for the job only, so orphans
    # started later (a daemon) go to init, not to it
    was = ctypes.c_int(-1)
    assert ctypes.CDLL(None).prctl(37, ctypes.byref(was), 0, 0, 0) == 0 and was.value == 0
    for rank in (0, 1):
        assert out[rank] == {
            "parent": server,
            "megatron_imported_before_the_rank_ran": True,
            "dynamo_too": True,
            "set": "after",
            "changed": "after",
            "unset": None,
            "rank": str(rank),
        }
