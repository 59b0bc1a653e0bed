"""How a rank of a job ended, as the CLI prints it: a bug's traceback (``RankFailedError``), a rank
gone without a Python exception (``RankDiedError``), or, under torchrun, ranks of another node gone
(``NodeLostError``, found by ``moe_rl.node_loss``'s roll call). Imports nothing of the package, so
the launcher, the roll call and the node wrapper (``moe_rl.multinode``) share it one way."""

from __future__ import annotations

import signal


class RankFailedError(RuntimeError):
    """A rank of a local job raised something that is not a user error (a bug): its traceback."""


class RankDiedError(RuntimeError):
    """A rank of a local job ended without a Python exception: killed by a signal, or exited.
    ``exitcode``: multiprocessing's (-N: signal N); None when it was not seen (``_peers_dead``)."""

    def __init__(self, rank: int, exitcode: int | None) -> None:
        if exitcode is None:
            how = "its exit status was not seen"
        elif exitcode < 0:
            name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else "?"
            how = f"signal {-exitcode}, {name}"
        else:
            how = f"exit code {exitcode}, without a Python exception"
        if self.sigkilled_by(exitcode):  # what a rank killed for memory shows; a kill -9 looks the same
            what = "was killed by SIGKILL, likely the kernel's out-of-memory killer: host memory ran out"
            super().__init__(f"rank {rank} {what} (or a kill -9 from outside); the job stopped")
        else:
            super().__init__(f"rank {rank} died ({how}); the job stopped")
        self.rank, self.exitcode = rank, exitcode

    @staticmethod
    def sigkilled_by(exitcode: int | None) -> bool:
        return exitcode == -signal.SIGKILL

    @property
    def sigkilled(self) -> bool:
        return self.sigkilled_by(self.exitcode)


class NodeLostError(RankDiedError):
    """Under torchrun: a collective failed because ranks of another node are gone (rank -> where
    it ran, from ``moe_rl.node_loss``'s roll call); the CLI prints it as a ``RankDiedError``."""

    def __init__(self, lost: dict[int, str]) -> None:
        ranks = ", ".join(f"rank {r} ({where})" for r, where in sorted(lost.items()))
        RuntimeError.__init__(
            self, f"lost {ranks}: it stopped answering (its torchrun or its machine died); the job stopped"
        )
        self.rank, self.exitcode = min(lost), None
