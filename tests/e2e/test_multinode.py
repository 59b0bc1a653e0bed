"""Multi-node launch for real on one machine (issue 43): scripts/torchrun_multinode.sh run twice, as
node 0 and node 1 of a c10d rendezvous on 127.0.0.1, one CPU rank each (EP=2 across the nodes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.helpers import DEFAULT_4_STEPS, deterministic, metrics

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(port: int, *args: str) -> list[subprocess.Popen]:
    """Both nodes' agents (bash execs the agent: each Popen's pid is that node's torchrun)."""
    env = {**os.environ, "GPUS_PER_NODE": "1", "MASTER_PORT": str(port), "PYTHON": sys.executable}
    # the threads each of `moe-rl train`'s 2 local ranks runs (moe_rl/launch.py): equal sums
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // 2))
    cmd = ["bash", str(ROOT / "scripts" / "torchrun_multinode.sh"), "2"]
    return [
        subprocess.Popen(
            [*cmd, str(node), "127.0.0.1", *args],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for node in (0, 1)
    ]


def wait_for(path: Path, text: str, procs: list[subprocess.Popen], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.is_file() and path.read_text().strip() == text):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, f"no {text} in {path} after {timeout_s} s"
        time.sleep(0.05)


@pytest.fixture()
def end_nodes():
    """Nodes a failing test leaves running are killed, with their ranks."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            try:
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
            except psutil.Error:  # gone meanwhile
                pass
            p.kill()
            p.wait()


@pytest.mark.e2e
def test_two_nodes_train_lose_a_node_and_resume_as_one_node_does(tmp_path, default_run, end_nodes):
    full, _ = default_run
    run = tmp_path / "run"
    # steps=20: node 1 is killed right after the step-2 checkpoint, long before the end
    args = [a for a in DEFAULT_4_STEPS if not a.startswith("steps=")]
    nodes = start_nodes(free_port(), f"run_dir={run}", "steps=20", *args)
    end_nodes += nodes
    wait_for(run / "checkpoints" / "latest", "step_000002", nodes)
    os.kill(nodes[1].pid, signal.SIGKILL)  # node 1's torchrun, as a dead machine: its rank ends with it
    killed = time.monotonic()
    _, err = nodes[0].communicate(timeout=60)
    took = time.monotonic() - killed
    assert nodes[0].returncode == 1
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(
        f"error: lost rank 1 (node 1, {socket.gethostname()}): it stopped answering (its torchrun or "
        "its machine died); the job stopped at step "
    ), lines
    assert "resume with: moe-rl train " in lines[0] and lines[0].endswith("(from the checkpoint of step 2)")
    assert took < 20, f"node 0 ended {took:.1f} s after node 1 died"  # the roll call waits 3 s
    nodes[1].communicate(timeout=10)
    time.sleep(1.0)  # node 1's rank: gone with its torchrun (its parent-death signal)
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if f"run_dir={run}" in " ".join(p.info["cmdline"] or [])
    ]
    assert left == [], f"processes of the killed job still run: {left}"

    # the same two nodes resume from the step-2 checkpoint: steps 0-3 equal the one-node nproc=2 run
    resumed = start_nodes(free_port(), f"run_dir={run}", "steps=4", "resume=true")
    end_nodes += resumed
    outs = [node.communicate(timeout=300) for node in resumed]
    assert [node.returncode for node in resumed] == [0, 0], [err[-3000:] for _, err in outs]
    # rank 0 (on node 0: the first to join the rendezvous is not always node 0) prints the end lines
    assert sum(f"run finished: 4 steps in {run} (resumed from step 2)" in out for out, _ in outs) == 1
    a, b = metrics(full), metrics(run)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in range(4):
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step}: two nodes differ from one"
