"""A stand-in for a job's launcher, for ``test_job_end`` (test-only): ``python -m
tests.bad_input.launcher_death OUT`` starts one rank the way torch's agent does (multiprocessing
spawn) that calls ``moe_rl.launch.end_with_launcher`` and then starts what outlived a killed
launcher before: a spawned server that never looks at its parent (as megatron's checkpoint results
``Manager``) and a forked child that orphans its own child (which the rank, a subreaper, inherits).
The rank writes its pid and its children's pids to OUT and waits to be ended."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import psutil

from moe_rl import launch


def _rank(launcher_pid: int, out: str) -> None:
    launch.end_with_launcher(launcher_pid)
    manager = multiprocessing.get_context("spawn").Manager()  # noqa: F841 - it must stay up
    forker = os.fork()
    if forker == 0:
        if os.fork() == 0:
            time.sleep(600)
        os._exit(0)  # its child is orphaned: re-parented to the rank
    os.waitpid(forker, 0)
    kids = [c.pid for c in psutil.Process().children()]
    Path(out + ".tmp").write_text(json.dumps({"rank": os.getpid(), "children": kids}))
    os.rename(out + ".tmp", out)
    time.sleep(600)


if __name__ == "__main__":
    rank = multiprocessing.get_context("spawn").Process(target=_rank, args=(os.getpid(), sys.argv[1]))
    rank.start()
    rank.join()
