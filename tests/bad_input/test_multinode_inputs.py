"""bad_input tier: scripts/torchrun_multinode.sh refuses, in one `error:` line and exit code 2, what
would otherwise fail late or on another machine: a node count that does not match the config's
parallel.nproc, a missing or unresolvable MASTER_ADDR, the rendezvous port in use. All before any
rank starts (moe_rl/multinode.py): the run directory is never made."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.cli_helpers import ROOT

USAGE = "usage: torchrun_multinode.sh NNODES NODE_RANK MASTER_ADDR [CONFIG.yaml] [key=value ...]"


def node(tmp_path, *args: str, port: int = 29400, per_node: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUS_PER_NODE": str(per_node), "MASTER_PORT": str(port), "PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "scripts" / "torchrun_multinode.sh"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def fails_with(proc: subprocess.CompletedProcess, line: str, run_dir) -> None:
    assert (proc.returncode, proc.stderr.splitlines(), proc.stdout) == (2, [line], ""), proc.stderr[-3000:]
    assert not run_dir.exists()


@pytest.mark.bad_input
def test_node_count_that_does_not_match_parallel_nproc(tmp_path):
    run = tmp_path / "run"
    fails_with(
        node(tmp_path, "3", "1", "127.0.0.1", f"run_dir={run}"),
        "error: node 1: parallel.nproc is 2 (the embedded default and the overrides) but 3 nodes x 1 "
        "ranks per node start 3: pass parallel.nproc=3 or change the node count",
        run,
    )
    # the right node count, but 2 ranks on each node
    fails_with(
        node(tmp_path, "2", "0", "127.0.0.1", f"run_dir={run}", per_node=2),
        "error: node 0: parallel.nproc is 2 (the embedded default and the overrides) but 2 nodes x 2 "
        "ranks per node start 4: pass parallel.nproc=4 or change the node count",
        run,
    )


@pytest.mark.bad_input
def test_missing_or_unresolvable_master_addr(tmp_path):
    run = tmp_path / "run"
    fails_with(
        node(tmp_path, "2", "0", f"run_dir={run}"),
        f"error: node 0: MASTER_ADDR is missing (got 'run_dir={run}' where it belongs): {USAGE}",
        run,
    )
    fails_with(
        node(tmp_path, "2", "1"),
        f"error: node 1: MASTER_ADDR is missing (got '' where it belongs): {USAGE}",
        run,
    )
    bad = node(tmp_path, "2", "1", "no-such-host.invalid", f"run_dir={run}")
    assert (bad.returncode, len(bad.stderr.splitlines())) == (2, 1), bad.stderr[-3000:]
    # the resolver's reason varies ("Name or service not known", or a DNS failure offline)
    assert bad.stderr.startswith(
        "error: node 1: MASTER_ADDR 'no-such-host.invalid' does not resolve on this node ("
    )
    assert not run.exists()


@pytest.mark.bad_input
def test_rendezvous_port_in_use_on_node_0(tmp_path):
    run = tmp_path / "run"
    with socket.socket() as held:  # another job's rendezvous store
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        fails_with(
            node(tmp_path, "2", "0", "127.0.0.1", f"run_dir={run}", port=port),
            f"error: node 0: MASTER_PORT {port} is in use on this node (Address already in use): another "
            "job's rendezvous? pass a free one, the same on every node: MASTER_PORT=N",
            run,
        )
