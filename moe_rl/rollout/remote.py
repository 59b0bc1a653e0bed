"""The learner side of ``parallel.rollout_ranks`` (docs/design.md 15): ``RemoteEngine`` stands in
for the engine on learner ranks, so the training loop runs unchanged. ``generate`` receives this
data-parallel rank's batch from the rollout rank that serves it (over the bridge), checks it
answers this step's prompts and seed, and hands it on; ``load_weights`` broadcasts the learner's
canonical chunks to the rollout ranks (learner rank 0) or consumes them in step (the gather is
collective over the learner ranks). The rollout ranks' loop is ``moe_rl/rollout_loop.py``.

One-step-off: the batch of step t + 1 is generated while the learner trains step t, so it is in
flight at a checkpoint; ``take_in_flight`` receives it so the checkpoint can hold it, and
``resume`` hands the saved one back as the first step's batch (it was generated with weights the
checkpoint no longer has)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from moe_rl.maths.versions import weight_version
from moe_rl.metrics import Max
from moe_rl.placement import exchange_dp_ranks
from moe_rl.rollout.base import Weights, weight_chunks
from moe_rl.types import RolloutBatch, SamplingParams, with_version
from moe_rl.weights.broadcast import broadcast_weights

BATCH_TAG = 1  # the bridge's tag for batches (rollout -> learner)


@dataclass(frozen=True)
class RolloutMessage:
    """One data-parallel rank's batch of one step, as a rollout rank sends it."""

    step: int
    dp_rank: int
    seed: int
    prompts: list[list[int]]
    n: int
    version: int  # the weight version it was generated with (updates behind it)
    batch: RolloutBatch
    # the rollout rank's seconds: waiting for the weights of this batch, generating it, and
    # waiting for the learner to take its previous batch
    waits: dict[str, float]

    def state_dict(self) -> dict:
        """Tensors, lists and numbers only (``torch.load(weights_only=True)`` reads it back)."""
        b = {f.name: getattr(self.batch, f.name) for f in dataclasses.fields(self.batch)}
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "batch": b}

    @classmethod
    def from_state_dict(cls, state: dict) -> RolloutMessage:
        return cls(**{**state, "batch": RolloutBatch(**state["batch"])})


class RemoteEngine:
    """``RolloutEngine`` on a learner rank of a split world (see the module docstring)."""

    def __init__(self, dims, engine_tp: int = 1, ahead: bool = False) -> None:
        p = dims.placement
        self.ahead = ahead  # one-step-off: the next step's batch is in flight at a checkpoint
        self.bridge, self.sync, self.dp_rank = p.bridge, p.sync, dims.dp_rank
        exchange_dp_ranks(self.bridge, dims.dp_rank)  # the rollout ranks learn where batches go
        self.src = self.bridge.members.index(p.split.server(dims.dp_rank, engine_tp))
        self.version = -1  # the weight version last synced (= the step the learner is at)
        self.next_version = 0  # the next sync's
        self.pending: RolloutMessage | None = None  # received ahead of its step (a checkpoint)

    def resume(self, start: int, in_flight: RolloutMessage | None) -> None:
        """Continue at step ``start`` (its weights are synced next), with the batch a one-step-off
        run had in flight when it saved (None: the rollout ranks generate step ``start``'s)."""
        self.next_version, self.pending = start, in_flight

    def load_weights(self, weights: Weights) -> None:
        chunks = weight_chunks(weights)
        if self.sync is not None:  # learner rank 0: the broadcast's root
            broadcast_weights(chunks, self.sync, self.next_version)
        else:
            for _ in chunks:  # the gather is collective over the learner ranks
                pass
        self.version, self.next_version = self.next_version, self.next_version + 1

    def _receive(self) -> RolloutMessage:
        return self.bridge.recv_object(self.src, BATCH_TAG)

    def take_in_flight(self) -> RolloutMessage | None:
        """The next step's batch, received now (one-step-off: the rollout rank has sent it); None
        when nothing is in flight (sync)."""
        if self.ahead and self.pending is None:
            self.pending = self._receive()
        return self.pending

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, seed: int) -> RolloutBatch:
        t0 = time.perf_counter()
        msg, self.pending = self.pending or self._receive(), None
        waited = time.perf_counter() - t0
        got = (msg.step, msg.dp_rank, msg.seed, msg.n, msg.prompts)
        if got != (self.version, self.dp_rank, seed, n, prompts):
            raise RuntimeError(
                f"rollout batch mismatch on data-parallel rank {self.dp_rank}: got step {msg.step}, "
                f"dp rank {msg.dp_rank}, seed {msg.seed}, n {msg.n}; expected step {self.version}, "
                f"seed {seed}, n {n}" + ("" if msg.prompts == prompts else " (other prompts)")
            )
        lag = self.version - msg.version
        metrics = {
            "rollout/version_lag": float(lag),
            "time/wait_batch_s": Max(torch.tensor(waited)),
            **{k: Max(torch.tensor(v)) for k, v in msg.waits.items()},
        }
        # version_BS: the weights the batch was generated with (W_u is version u + 1, docs/math.md 2.7)
        batch = with_version(dataclasses.replace(msg.batch, version_BS=None), weight_version(msg.version))
        return dataclasses.replace(batch, engine_metrics=metrics)
