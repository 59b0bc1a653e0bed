"""When the trainer saves, and how it resumes: the run's checkpoints under ``run_dir/checkpoints``
(written atomically by ``learner/checkpoint.py``) with the trainer's own state beside them."""

from __future__ import annotations

import logging
from pathlib import Path

from moe_rl.config import RunConfig
from moe_rl.errors import RunDirError
from moe_rl.learner import checkpoint
from moe_rl.learner.learner import Learner
from moe_rl.lr import LengthLRScheduler

log = logging.getLogger(__name__)


class CheckpointManager:
    def __init__(self, cfg: RunConfig, learner: Learner, lr_sched: LengthLRScheduler) -> None:
        self.cfg, self.learner, self.lr_sched = cfg, learner, lr_sched
        self.root = Path(cfg.run_dir) / "checkpoints"

    def resume(self) -> int:
        """The first step to run: 0, or the step after the last checkpoint when resuming."""
        if not self.cfg.resume:
            return 0
        path = checkpoint.latest(self.root)
        if path is None:
            raise RunDirError(f"resume=true but {self.root} has no checkpoint")
        state = checkpoint.load(self.learner, path)
        self.lr_sched.load_state_dict(state["length_lr"])
        log.info("resumed from %s (step %d)", path, state["step"])
        return int(state["step"])

    def due(self, step: int) -> bool:
        """After step ``step`` (0-based): every ``checkpoint_every`` steps, and after the last."""
        every, done = self.cfg.checkpoint_every, step + 1
        return bool(every and done % every == 0) or done == self.cfg.steps

    def save(self, step: int) -> None:
        """The state after step ``step`` (0-based): a resumed run starts at ``step + 1``."""
        checkpoint.save(self.learner, self.root, step + 1,
                        {"seed": self.cfg.seed, "length_lr": self.lr_sched.state_dict()})
