"""THE rollout ranks' loop (``parallel.rollout_ranks``, docs/design.md 15): receive the weights,
generate each served data-parallel rank's batch exactly as a colocated engine would (the same
prompts and seed), send it to every learner rank of that dp rank, repeat.

Rollout rank j serves the learner dp ranks d with d % engines == j (``Split.server``). The loop's
schedule is ``rollout.mode``'s:

- sync: batch t is generated with W_t, after the learner's sync of W_t;
- one_step_off: batch t + 1 is generated with W_t while the learner trains step t (batch 0 with
  W_0), so every batch after the first is one update stale. The batch is sent (``isend``) before
  the rank joins the next weight broadcast, and the send is waited on only after the learner has
  taken it: a gloo send completes when its peer receives. The rank always runs one batch ahead,
  also past the last step: the learner takes that batch into its last checkpoint, so a resumed run
  (with more steps) starts from it, exactly as the uninterrupted run would have.

The step a run starts at is the version of the first weight sync (a resume's checkpoint step)."""

from __future__ import annotations

import logging
import time

from moe_rl.config import RunConfig
from moe_rl.dist import ParallelDims
from moe_rl.placement import exchange_dp_ranks
from moe_rl.rollout.factory import build_engine, engine_tp
from moe_rl.rollout.remote import BATCH_TAG, RolloutMessage
from moe_rl.seeding import GENERATE, step_seed
from moe_rl.step.plan import StepPlan
from moe_rl.tasks.task import Task, build_task
from moe_rl.weights.broadcast import receive_weights

log = logging.getLogger(__name__)


class _Server:
    """One rollout rank: its engine, the dp ranks it serves and where their batches go."""

    def __init__(self, cfg: RunConfig, dims: ParallelDims, task: Task) -> None:
        p, tp = dims.placement, engine_tp(cfg)
        self.cfg, self.task, self.bridge, self.sync = cfg, task, p.bridge, p.sync
        dp_of = exchange_dp_ranks(self.bridge, -1)  # every world rank's learner dp rank
        me, engines, self.dp = p.split.role_rank(p.rank), p.split.engines(tp), cfg.data_parallel
        self.sends = me % tp == 0  # an engine's first rank sends; its TP peers only generate
        self.served = [d for d in range(self.dp) if d % engines == me // tp]
        self.dests = {d: [r for r, x in enumerate(dp_of) if x == d] for d in self.served}
        self.sampling = StepPlan.from_config(cfg, task.tokenizer.eos_ids).sampling
        self.engine = build_engine(cfg, task.tokenizer.pad_id, dims.device)
        self.version = -1

    def load(self) -> float:
        """Join the next weight sync and apply it (never while sampling); seconds waited + applied."""
        t0 = time.perf_counter()
        version, chunks = receive_weights(self.sync)
        if self.version >= 0 and version != self.version + 1:
            raise RuntimeError(
                f"weight sync of version {version} after version {self.version}: one was missed"
            )
        self.engine.load_weights(chunks)
        self.version = version
        return time.perf_counter() - t0

    def generate(self, step: int, waited_s: float) -> list[RolloutMessage]:
        """Step ``step``'s batch of every served dp rank, with the weights loaded now."""
        r, out = self.cfg.rollout, []
        for d in self.served:
            t0 = time.perf_counter()
            prompts = [
                p.prompt_ids
                for p in self.task.source.sample_step(
                    step, r.prompts_per_step // self.dp, d, self.dp, self.cfg.seed
                )
            ]
            seed = step_seed(self.cfg.seed, step, d, GENERATE)
            batch = self.engine.generate(prompts, r.samples_per_prompt, self.sampling, seed=seed)
            waits = {
                "time/rollout_wait_weights_s": waited_s,
                "time/rollout_generate_s": time.perf_counter() - t0,
            }
            out.append(
                RolloutMessage(step, d, seed, prompts, r.samples_per_prompt, self.version, batch, waits)
            )
        return out

    def send(self, msgs: list[RolloutMessage]) -> list:
        """Start sending each message to every learner rank of its dp rank; the works to wait on."""
        if not self.sends:
            return []
        return [
            w
            for m in msgs
            for dst in self.dests[m.dp_rank]
            for w in self.bridge.send_object(m, dst, BATCH_TAG)
        ]


def _wait(works: list) -> float:
    t0 = time.perf_counter()
    for w in works:
        w.wait()
    return time.perf_counter() - t0


def serve_rollouts(cfg: RunConfig, dims: ParallelDims, task: Task | None = None) -> None:
    """A rollout rank's whole run (see the module docstring); ``task``: preflight's, when it ran in
    this process (an external torchrun)."""
    if task is None:
        cfg, task = build_task(cfg, start_pool=False)  # the same prompts as the learner ranks
    s = _Server(cfg, dims, task)
    waited = s.load()
    start = s.version
    if cfg.rollout.mode == "sync":
        for step in range(start, cfg.steps):
            works = s.send(s.generate(step, waited))
            waited = s.load()  # the learner broadcasts W_{step+1} after it took the batch and updated
            _wait(works)
        return
    # one_step_off: batch `start` is W_0's (a new run) or in the learner's checkpoint (a resume)
    works = s.send(s.generate(start, waited)) if start == 0 else []
    for step in range(start, cfg.steps):
        msgs = s.generate(step + 1, waited)  # with W_step, while the learner trains step `step`
        _wait(works)  # batch `step`: the learner took it at the start of its step
        works = s.send(msgs)
        waited = s.load()  # W_{step+1}, broadcast after the learner's update
    _wait(works)  # the batch past the last step: the learner's last checkpoint takes it
