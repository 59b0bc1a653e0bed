"""Multi-node launch: one torchrun agent per node (scripts/torchrun_multinode.sh, scripts/slurm_train.sbatch).

Node side (``python -m moe_rl.multinode``): checks what would otherwise fail late or far away
(a node count that does not match the config's ``parallel.nproc``, a missing or unresolvable
``MASTER_ADDR``, the rendezvous port already in use on the node that hosts it), each as one
``error:`` line before any rank starts, then runs torch's torchrun (``torch.distributed.run``)
with its failure report replaced by one line.

The ranks' side, a lost node named: moe_rl/node_loss.py. Torch is imported after the checks.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from moe_rl.errors import UserError, one_line
from moe_rl.node_loss import NODE_ENV, STORE_ENV, STORE_LOST_EXIT


def _check_master(addr: str) -> None:
    if not addr or addr.endswith((".yaml", ".yml")) or "=" in addr:
        raise UserError(
            f"MASTER_ADDR is missing (got {addr!r} where it belongs): "
            "usage: torchrun_multinode.sh NNODES NODE_RANK MASTER_ADDR [CONFIG.yaml] [key=value ...]"
        )
    try:
        socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError) as e:  # UnicodeError: an empty label ("a..b")
        why = getattr(e, "strerror", None) or one_line(e)
        raise UserError(f"MASTER_ADDR {addr!r} does not resolve on this node ({why})") from None


def _check_port_free(port: int) -> None:
    """The rendezvous host's store listens on ``port``: taken, torchrun would join whatever holds it."""
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is free
        try:
            s.bind(("", port))
        except OSError as e:
            raise UserError(
                f"MASTER_PORT {port} is in use on this node ({e.strerror}): another job's "
                "rendezvous? pass a free one, the same on every node: MASTER_PORT=N"
            ) from None


def _check_world(args: list[str], nnodes: int, per_node: int) -> None:
    from moe_rl.config import load_run_config

    path = args[0] if args and "=" not in args[0] else None
    cfg = load_run_config(path, args[1:] if path else args)
    if cfg.parallel.nproc != nnodes * per_node:
        src = path or "the embedded default"
        raise UserError(
            f"parallel.nproc is {cfg.parallel.nproc} ({src} and the overrides) but {nnodes} nodes x "
            f"{per_node} ranks per node start {nnodes * per_node}: pass parallel.nproc="
            f"{nnodes * per_node} or change the node count"
        )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage text
        print(f"error: scripts/torchrun_multinode.sh: {message}", file=sys.stderr)
        sys.exit(2)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m moe_rl.multinode")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--per-node", type=int, required=True)
    p.add_argument("--master-addr", default="")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--rdzv-id", required=True)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def _store_lost(who: str, a: argparse.Namespace) -> str:
    return (
        f"error: {who}: lost node 0, which hosts the rendezvous store at {a.master_addr}:{a.master_port} "
        "(its torchrun or its machine died); the job stopped"
    )


def main(argv: list[str]) -> int:
    a = _parse(argv)
    train = [x for x in a.train_args if x != "--"]
    who = f"node {a.node_rank}"
    try:
        _check_master(a.master_addr)
        if a.node_rank == 0:
            _check_port_free(a.master_port)
        _check_world(train, a.nnodes, a.per_node)
    except UserError as e:
        print(f"error: {who}: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    os.environ[NODE_ENV] = str(a.node_rank)
    os.environ[STORE_ENV] = f"{a.master_addr}:{a.master_port}"
    if os.environ.get("MOE_RL_DEBUG", "") in ("", "0"):
        # c10d's C++ warnings with their stack frames when a peer's store connection drops: the
        # one line below says it (read when libtorch loads: set before torch is imported)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from moe_rl.rank_errors import RankDiedError

    # torch's own failure and signal reports would repeat the ranks' lines, worse
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    torchrun = [
        f"--nnodes={a.nnodes}",
        f"--node_rank={a.node_rank}",
        f"--nproc_per_node={a.per_node}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={a.master_addr}:{a.master_port}",
        f"--rdzv_id={a.rdzv_id}",
        # node 0 hosts the store (torchrun would let any node on MASTER_ADDR's host race for it)
        f"--rdzv_conf=is_host={int(a.node_rank == 0)}",
        "--max_restarts=0",
        "-m",
        "moe_rl.cli",
        "train",
        *train,
    ]
    try:
        run(get_args_parser().parse_args(torchrun))
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        if failure.exitcode == STORE_LOST_EXIT:
            print(_store_lost(who, a), file=sys.stderr)
            return 1
        if failure.exitcode > 0:  # the rank printed why (one line, or a bug's traceback)
            return failure.exitcode
        print(f"error: {who}: {RankDiedError(rank, failure.exitcode)}", file=sys.stderr)
        return 1
    except SignalException as e:
        print(f"interrupted ({signal.Signals(e.sigval).name}): {who} stopped its ranks", file=sys.stderr)
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 - the rendezvous: a node that never came, a lost store
        if a.node_rank != 0 and "store" in str(e).lower():  # its ranks end with this agent
            print(_store_lost(who, a), file=sys.stderr)
            return 1
        print(
            f"error: {who}: the rendezvous at {a.master_addr}:{a.master_port} failed: {one_line(e)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
