"""A stop request (issue 42): the first SIGINT, SIGTERM or SIGHUP of a job finishes the step in
progress and saves a checkpoint; a second one stops at once (docs/reliability.md 9).

Where a rank learns of it: under `moe-rl train`'s own launcher, from the file ``STOP_FILE`` that
the launcher's handler writes in the job's report directory (``moe_rl.launch``), looked for at each
step boundary; under an external torchrun, from its own SIGTERM/SIGINT handler (the agent passes its
SIGTERM on), which only sets a flag: it runs at the rank's next bytecode, also when the signal came
inside a collective. The learner ranks agree on the step at each step boundary (``agreed``: a MAX
all-reduce of one int), so no rank saves alone while another enters the next step; the rollout
ranks are told with the step's weight sync (``moe_rl/pipeline/weight_sync.py``)."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.dist import comm_device

STOP_FILE = "stop"  # in the launcher's report directory: the signal number, as text
_watched: Path | None = None
_signum = 0  # the signal this rank's own handler got (an external torchrun)


@dataclass(frozen=True)
class Stopped:
    """What a learner rank returns when a stop request ended its run: the step its checkpoint
    holds (a resume starts there) and the signal that asked for it."""

    step: int
    signum: int


def watch(path: Path | None) -> None:
    """A rank of the local launcher: the launcher's request is the file ``path`` (None: none)."""
    global _watched
    _watched = path


def request(path: Path, signum: int) -> None:
    """The launcher's side: write the request for its ranks (atomically: a rank never reads half)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(int(signum)))
    os.replace(tmp, path)


def requested() -> int:
    """The signal a stop was asked with, seen by this rank (0: none)."""
    if _signum or _watched is None:
        return _signum
    try:
        return int(_watched.read_text())
    except (OSError, ValueError):  # no request (yet)
        return 0


def _on_signal(signum: int, _frame) -> None:
    global _signum
    _signum = _signum or signum


def handle_signals() -> None:
    """A rank under an external torchrun: its first SIGTERM or SIGINT only asks for the stop, and
    so do the repeats: one stop reaches a rank twice there (Slurm signals every process of the job
    step and torchrun's agent passes its own on; a terminal's Ctrl-C reaches the agent and its
    ranks). Stopping at once is the agent's: it SIGKILLs its ranks after its shutdown timeout, and
    a second signal ends the agent, and its ranks with it (``launch.end_with_launcher``)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)


def agreed() -> int:
    """At a step boundary of every learner rank: the signal any of them was asked to stop with
    (0: none), the same on all (a MAX all-reduce over the default group: the learner ranks)."""
    flag = torch.tensor([requested()], dtype=torch.int64, device=comm_device(None))
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag[0])


class JobInterrupted(BaseException):
    """The launcher got a stop signal (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` swallows it); ``exit_code`` is the shell's 128 + signal number.
    ``checkpoint``: the step of the checkpoint the ranks saved on it; ``grace_s``: the grace that
    ran out before they had (the ranks were stopped without it)."""

    def __init__(self, signum: int, checkpoint: int | None = None, grace_s: float | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.exit_code = int(signum), 128 + int(signum)
        self.checkpoint, self.grace_s = checkpoint, grace_s


class GracefulStop:
    """The launcher's handler of SIGINT, SIGTERM and SIGHUP while its ranks run: the first asks
    them to stop after their step, with a checkpoint (``requested``), and gives them ``grace_s``
    seconds (SIGALRM); the second, or the end of the grace, stops the job at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, report_dir: Path, grace_s: float) -> None:
        self.path, self.grace_s, self.signum = report_dir / STOP_FILE, grace_s, 0

    def __call__(self, signum: int, _frame) -> None:
        if self.signum:
            raise JobInterrupted(signum)
        self.signum = signum
        request(self.path, signum)
        name = signal.Signals(signum).name
        sys.stderr.write(
            f"{name}: finishing the step in progress and saving a checkpoint (within stop_grace_s="
            f"{self.grace_s:g} s); a second {name} stops at once\n"
        )
        signal.signal(signal.SIGALRM, self._expired)
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _expired(self, _signum: int, _frame) -> None:
        raise JobInterrupted(self.signum, grace_s=self.grace_s)

    def stopped(self, results: dict) -> None:
        """After the ranks returned: the checkpoint they stopped with, as ``JobInterrupted``
        (nothing when the run reached its last step first)."""
        done = [r for r in results.values() if isinstance(r, Stopped)]
        if self.signum and done:
            raise JobInterrupted(self.signum, checkpoint=done[0].step)
