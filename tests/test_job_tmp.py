"""moe_rl/job_tmp.py: the job's temp folders carry their owner's pid; a folder whose owner is dead
is removed, one whose owner lives (or any other name) is kept; a folder made by ``make_dir`` goes
when its process exits, a multiprocessing child's too."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from moe_rl import job_tmp


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.unit
def test_owner_pid_reads_the_three_kinds_and_nothing_else():
    assert job_tmp.owner_pid("moe_rl_ranks_123_ab1x") == 123
    assert job_tmp.owner_pid("moe_rl_vllm_77_q9") == 77
    assert job_tmp.owner_pid("moe_rl_rank_exits_4567") == 4567
    for other in (
        "moe_rl_ranks_ab1x_y",
        "moe_rl_ranks_ab1x",
        "moe_rl_rank_exits_45x",
        "moe_rl_vllm_",
        "x_moe_rl_vllm_1_a",
    ):
        assert job_tmp.owner_pid(other) is None, other


@pytest.mark.unit
def test_remove_orphans_removes_only_what_a_dead_process_owned(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    names = [f"moe_rl_ranks_{dead}_a", f"moe_rl_rank_exits_{dead}", f"moe_rl_vllm_{dead}_b"]
    kept = [f"moe_rl_ranks_{live}_c", f"moe_rl_vllm_{live}_d", "moe_rl_ranks_oldstyle", "unrelated"]
    for n in names + kept:
        (tmp_path / n).mkdir()
        (tmp_path / n / "rank0.pid").write_text("1")
    assert job_tmp.remove_orphans(str(tmp_path)) == sorted(str(tmp_path / n) for n in names)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def _child(queue) -> None:
    queue.put(str(job_tmp.make_dir(job_tmp.VLLM)))


@pytest.mark.unit
def test_make_dir_is_removed_when_its_process_exits(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: its tempdir is TMPDIR
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    path = queue.get(timeout=120)
    child.join(timeout=120)
    assert child.exitcode == 0
    assert path.startswith(str(tmp_path / f"moe_rl_vllm_{child.pid}_"))
    assert list(tmp_path.iterdir()) == []
