"""When the trainer saves, and how it resumes: the run's checkpoints under ``run_dir/checkpoints``
(written atomically by ``learner/checkpoint.py``) with the trainer's own state beside them.

With ``rollout.staleness=k > 0`` the engine's k stale weight sets are resume state too: rank 0
writes them to ``checkpoints/stale_weights_step_N.pt`` (atomically, before the step's checkpoint,
so a complete checkpoint always has its file) and every rank reads them back on resume.

With ``rollout.mode=one_step_off`` the batch in flight (the next step's, generated with weights the
checkpoint no longer holds) is resume state too: the learner receives it before saving, and the
first rank of each data-parallel rank (TP and PP rank 0) writes it to
``checkpoints/in_flight_step_N_dp{d}.pt`` the same way; a resume takes its first batch from there
(docs/design.md 15). With ``rollout.mode=async`` that file holds every finished request buffered
for the dp rank at the checkpoint and the index of the next one (docs/design.md 15.3)."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.config import RunConfig, Schedule
from moe_rl.errors import CheckpointError, DiskFullError, RunDirError, disk_full_named
from moe_rl.learner import checkpoint
from moe_rl.learner.learner import Learner
from moe_rl.maths.lr import LengthLRScheduler
from moe_rl.pipeline.remote_engine import RolloutMessage
from moe_rl.pipeline.request_buffer import checkpoint_due
from moe_rl.pipeline.simulated_staleness import SimulatedStaleness

log = logging.getLogger(__name__)


def _load_named(path: Path) -> dict:
    """torch.load of a resume file; a damaged one (preflight's check reads its zip directory only)
    is a CheckpointError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise CheckpointError(
            f"{path} is truncated or corrupt ({type(e).__name__}): the checkpoint in {path.parent} "
            f"cannot be resumed; resume from another step"
        ) from None


class CheckpointManager:
    def __init__(
        self,
        cfg: RunConfig,
        learner: Learner,
        lr_sched: LengthLRScheduler,
        stale: SimulatedStaleness | None = None,
        engine=None,
    ) -> None:
        self.cfg, self.learner, self.lr_sched, self.stale = cfg, learner, lr_sched, stale
        self.root = Path(cfg.run_dir) / "checkpoints"
        # split: ``engine`` is the rollout ranks' stand-in (a RemoteEngine), and one_step_off / async
        # keep batches in flight at a checkpoint (async: a buffer of requests)
        schedule = Schedule.from_config(cfg)
        self.remote = engine if schedule.split and engine is not None else None
        self.in_flight = self.remote is not None and schedule.keeps_in_flight
        self.buffered = self.remote is not None and schedule.buffers_requests
        self.data_cursor = 0  # a resume reads it from the checkpoint (trainer_state.json)
        self.partials: dict = {"prompts": []}  # algo.over_sampling's pending groups (partials_*.pt)

    def stale_path(self, step_dir_name: str) -> Path:
        return checkpoint.stale_weights_file(self.root / step_dir_name)

    def partials_path(self, step_dir_name: str) -> Path:
        """Beside checkpoint ``step_dir_name``: this dp rank's pending groups (algo.over_sampling)."""
        return self.root / f"partials_{step_dir_name}_dp{self.learner.dims.dp_rank}.pt"

    def in_flight_path(self, step_dir_name: str) -> Path:
        return checkpoint.in_flight_file(self.root / step_dir_name, self.learner.dims.dp_rank)

    def resume(self) -> int:
        """The first step to run: 0, or the step after the last checkpoint when resuming (with the
        stale weight sets restored into ``self.stale``)."""
        if not self.cfg.resume:
            return 0
        start = self._resume()
        if self.remote is not None:
            state = None
            if self.in_flight:
                path = self.in_flight_path(f"step_{start:06d}")
                if not path.is_file():
                    raise RunDirError(
                        f"resume=true with rollout.mode={self.cfg.rollout.mode} but {path} (the "
                        f"batches in flight when the checkpoint was saved) is missing"
                    )
                state = _load_named(path)
                if ("buffered" in state) != self.buffered:  # async saves a list, one_step_off a batch
                    raise RunDirError(
                        f"resume=true with rollout.mode={self.cfg.rollout.mode} but {path} was saved by "
                        f"a run with another rollout.mode: resume with the mode it was saved with"
                    )
            if self.buffered:
                self.remote.resume(start, None, state)
            else:
                self.remote.resume(start, RolloutMessage.from_state_dict(state) if state else None)
        return start

    def _resume(self) -> int:
        path = checkpoint.latest(self.root)
        if path is None:
            raise RunDirError(f"resume=true but {self.root} has no checkpoint")
        stale = self.stale_path(path.name)
        if self.stale is not None and self.stale.k and not stale.is_file():
            raise RunDirError(
                f"resume=true with rollout.staleness={self.stale.k} but {stale} (the engine's "
                f"stale weight sets) is missing"
            )
        state = checkpoint.load(self.learner, path)
        self.lr_sched.load_state_dict(state["length_lr"])
        # the data's next index (moe_rl/step/sampling.py): the step's, unless dynamic sampling drew more
        self.data_cursor = int(state.get("data_cursor", state["step"]))
        if self.stale is not None and self.stale.k:
            self.stale.load_state_dict(_load_named(stale), self.learner.device)
        if self.cfg.algo.over_sampling.on:
            partials = self.partials_path(path.name)
            if not partials.is_file():
                raise RunDirError(
                    f"resume=true with algo.over_sampling but {partials} (the groups pending when the "
                    f"checkpoint was saved) is missing: resume with the over-sampling it was saved with"
                )
            self.partials = _load_named(partials)
        log.info("resumed from %s (step %d)", path, state["step"])
        return int(state["step"])

    def due(self, step: int) -> bool:
        """After step ``step`` (0-based): every ``checkpoint_every`` steps, and after the last."""
        return checkpoint_due(step, self.cfg.checkpoint_every, self.cfg.steps)

    def save(self, step: int, data_cursor: int | None = None, partials=None) -> None:
        """The state after step ``step`` (0-based): a resumed run starts at ``step + 1``, drawing
        its prompts from ``data_cursor`` on (default: ``step + 1``, one round per step), with the
        dp rank's pending groups ``partials`` (a ``Pending``; written with algo.over_sampling)."""
        name = f"step_{step + 1:06d}"
        dims = self.learner.dims
        if self.cfg.algo.over_sampling.on and dims.tp_rank == 0 and dims.pp_rank == 0:
            self._write(self.partials_path(name), partials.state_dict())
        if self.stale is not None and self.stale.k and (not dist.is_initialized() or dist.get_rank() == 0):
            self._save_stale(name)
        if self.in_flight:  # every learner rank receives them: its next batches
            state = (
                self.remote.take_buffered() if self.buffered else self.remote.take_in_flight().state_dict()
            )
            if dims.tp_rank == 0 and dims.pp_rank == 0:
                self._write(self.in_flight_path(name), state)
        checkpoint.save(
            self.learner,
            self.root,
            step + 1,
            {
                "seed": self.cfg.seed,
                "length_lr": self.lr_sched.state_dict(),
                "data_cursor": step + 1 if data_cursor is None else data_cursor,
            },
        )
        if not dist.is_initialized() or dist.get_rank() == 0:  # after the save's last barrier
            self._prune()

    def _save_stale(self, step_dir_name: str) -> None:
        self._write(self.stale_path(step_dir_name), self.stale.state_dict())

    def _write(self, path: Path, state: dict) -> None:
        """``state`` to ``path`` atomically (the step's checkpoint is renamed into place after it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with disk_full_named(path), open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except (DiskFullError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            tmp.unlink(missing_ok=True)
            if isinstance(e, DiskFullError) or checkpoint.disk_is_full(self.root):
                raise DiskFullError(f"no space left on device: {path}") from None
            raise
        os.replace(tmp, path)

    def _prune(self) -> None:
        """The stale weight sets and in-flight batches of checkpoints the last save pruned."""
        kept = {p.name for p in self.root.glob("step_*") if p.is_dir()}
        for prefix in ("stale_weights_", "in_flight_", "partials_"):
            for old in self.root.glob(f"{prefix}step_*.pt"):
                if old.name.removeprefix(prefix)[:11] not in kept:
                    old.unlink(missing_ok=True)
