"""The folders a job makes in the temp dir, each named by the pid of the process that owns it, and
their removal on every end (docs/reliability.md 5).

Three kinds: the launcher's report dir (``moe_rl_ranks_<launcher pid>_*``: the ranks' pid files and
failure records, moe_rl/launch.py), the rank server's exit statuses (``moe_rl_rank_exits_<server
pid>``, moe_rl/rank_server_preload.py) and the HF dir a vLLM engine starts from
(``moe_rl_vllm_<rank pid>_*``, moe_rl/rollout/vllm/engine.py). Who removes them: their owner, at
its exit (``make_dir``: a multiprocessing finalizer, which runs in a main process and in a
multiprocessing child alike); the launcher, once the ranks are gone (``remove_orphans``: a folder
whose owner is dead, e.g. a rank that failed and left by ``os._exit``); after kill -9 of the
launcher, which runs nothing, each rank as it ends on its launcher's death (``remove_owned``, the
report dir and the server's folder among them, moe_rl/launch.py); and whatever is still left, e.g.
of a launcher killed before its ranks were up, the next launcher as it starts (``remove_orphans``).
A folder whose owner's pid has been taken by a live process is kept until that one ends too.
Imports nothing from the package.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from multiprocessing import util
from pathlib import Path

RANKS, EXITS, VLLM = "moe_rl_ranks_", "moe_rl_rank_exits_", "moe_rl_vllm_"
# <prefix><owner pid>_<mkdtemp's random part>, or the rank server's <prefix><server pid>
_OWNED_NAME = re.compile(rf"(?:{RANKS}|{VLLM})(\d+)_.+|{EXITS}(\d+)")

OWNED: list[str] = []  # the folders this process made with ``make_dir`` (plus what ``own`` adds)


def owner_pid(name: str) -> int | None:
    """The pid a job folder's name carries; None for any other name (an older unnamed one too)."""
    m = _OWNED_NAME.fullmatch(name)
    return None if m is None else int(m.group(1) or m.group(2))


def make_dir(prefix: str) -> Path:
    """A new folder ``<prefix><this pid>_*`` in the temp dir, removed when this process exits."""
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}_")
    own(path)
    util.Finalize(None, shutil.rmtree, (path,), {"ignore_errors": True}, exitpriority=0)
    return Path(path)


def own(path: str | Path) -> None:
    """Count ``path`` among what ``remove_owned`` removes."""
    OWNED.append(str(path))


def remove_owned() -> None:
    """Remove every folder of ``OWNED`` (a rank whose launcher died, in its signal handler)."""
    for path in OWNED:
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_orphans(tmp: str | None = None) -> list[str]:
    """Remove the job folders in ``tmp`` (default: the temp dir) whose owner is dead; returns them."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return []
    for name in names:
        pid = owner_pid(name)
        if pid is None or _alive(pid):
            continue
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        removed.append(os.path.join(tmp, name))
    return sorted(removed)
