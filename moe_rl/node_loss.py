"""A rank under torchrun (moe_rl/multinode.py starts one agent per node) whose collective
fails because a peer is gone names the lost node and rank. Every rank has a thread that answers a
roll call in the agents' store; the failing rank calls it, and the ranks that do not answer within
``ROLL_CALL_S`` are the lost ones (``NodeLostError``, one line from the CLI).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time

from moe_rl.errors import UserError
from moe_rl.rank_errors import NodeLostError

ROLL_CALL_S = 3.0  # how long the live ranks get to answer (their answering thread is idle)
NODE_ENV = "MOE_RL_NODE"  # the node's rank as the user numbered it (torchrun's GROUP_RANK may differ)
# the rendezvous store, which node 0's agent hosts (moe_rl/multinode.py): the roll call's; the
# ranks' own MASTER_ADDR:MASTER_PORT store is hosted by whichever node got group rank 0
STORE_ENV = "MOE_RL_RDZV_STORE"
# the exit code of a rank that lost the store (node 0 died): its agent, which lost it too, says so
STORE_LOST_EXIT = 75


def _namespace() -> str:
    run, restart = (
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )
    return f"moe_rl/{run}/{restart}"


def _client(timeout_s: float):
    from torch.distributed import TCPStore

    host, _, port = os.environ.get(STORE_ENV, "").rpartition(":")
    return TCPStore(
        host or os.environ["MASTER_ADDR"],
        int(port or os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _answer_roll_call(store, ns: str, rank: int) -> None:
    try:
        store.wait([f"{ns}/roll_call"], datetime.timedelta(days=30))
        store.set(f"{ns}/alive/{rank}", "1")
    except Exception:  # noqa: BLE001 - the store's host is gone: nobody is calling
        pass


def run_rank(worker, cfg, prepared):
    """This rank's ``worker(cfg, prepared)`` under torchrun (its result returned), naming a lost
    node if one ends it."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ns, store = _namespace(), None
    if world > 1:
        store = _client(60.0)
        where = f"node {os.environ.get(NODE_ENV, os.environ.get('GROUP_RANK', '?'))}, {socket.gethostname()}"
        store.set(f"{ns}/where/{rank}", where)
        answer = threading.Thread(target=_answer_roll_call, args=(_client(60.0), ns, rank), daemon=True)
        answer.start()
    try:
        return worker(cfg, prepared)
    except UserError:
        raise
    except Exception:
        if store is None:
            raise
        try:
            lost = _roll_call(store, ns, rank, world)
        except Exception:  # noqa: BLE001 - the store is gone with node 0, which hosts it
            sys.stderr.flush()
            os._exit(STORE_LOST_EXIT)  # no second line: this node's agent names node 0
        if lost:
            raise NodeLostError(lost) from None
        raise


def _roll_call(store, ns: str, rank: int, world: int) -> dict[int, str]:
    """The ranks that do not answer within ``ROLL_CALL_S``, with where they ran."""
    store.set(f"{ns}/roll_call", str(rank))
    missing = set(range(world)) - {rank}
    deadline = time.monotonic() + ROLL_CALL_S
    while missing and time.monotonic() < deadline:
        missing = {r for r in missing if not store.check([f"{ns}/alive/{r}"])}
        time.sleep(0.05)
    return {r: store.get(f"{ns}/where/{r}").decode() for r in missing}
