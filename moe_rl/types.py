"""Batches that move between the rollout engine, the rewards and the learner.

Shape suffixes: B sequences, S padded sequence length, T tokens of one sequence,
L MoE layers, K router top-k.

Token layout (engine and learner agree on it): every sequence is prompt + response, left-aligned
and right-padded to S with the pad id. ``logprobs_BS[b, t]`` is log p(tokens[b, t] | tokens[b, :t])
under softmax(logits / temperature) over the full vocabulary; it is only meaningful where
``response_mask_BS`` is true (the generated tokens), and 0 elsewhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_rl.corrections.correction_specs import DvpSpec
from moe_rl.routing.provenance import Provenance
from moe_rl.routing.record import RouteBatch


@dataclass(frozen=True)
class Prompt:
    """One prompt to roll out.

    prompt_ids: token ids, bos first, then the prompt text.
    answer: the reference answer text (no eos).
    reward: name of the reward function in ``moe_rl.tasks.rewards.REWARDS``.
    task: label for per-task metrics (the generator name, or a dataset row's data source).
    text: the prompt as text (what a text reward is handed; "" for generated tasks).
    extra: the dataset row's other fields (handed to a ``python:`` reward).
    """

    prompt_ids: list[int]
    answer: str
    reward: str
    task: str
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    # Dynamic Vocabulary Pruning (``correction.dvp``, carried unchanged): sample only from the
    # spec's safe set and report log-probs renormalised over it; DvpSpec() = off (full vocabulary)
    dvp: DvpSpec = field(default_factory=DvpSpec)
    return_dist: bool = False  # also return the full rollout distribution per generated token
    long_tail_frac: float = 0.0  # rollout.long_tail_frac: samples that ignore the stop tokens (built-in)

    @property
    def logprob_support(self) -> str:
        """The support the reported log-probs are normalised over; the learner must match it."""
        return f"dvp:{self.dvp.rule}:{self.dvp.threshold:g}" if self.dvp.on else "full"


@dataclass
class RolloutBatch:
    """What an engine returns for B = len(prompts) * n sequences (prompt-major order).

    tokens_BS: int64 [B, S] prompt + response, right-padded with the pad id.
    prompt_lens_B / response_lens_B: int64 [B]; the response includes its stop token.
    response_mask_BS: bool [B, S], true on generated tokens.
    logprobs_BS: float32 [B, S], the engine's log-probs of the generated tokens.
    routes: B tensors [T_b - 1, L, K] of the narrowest unsigned dtype (the route record);
        row t is the Top-K expert ids chosen when token t was the input. Jagged (T_b differs).
    group_B: int64 [B], index of the prompt each sequence answers.
    finished_B: bool [B], the sequence ended with a stop token (else it hit max_new_tokens).
    version_BS: int32 [B, S] or None: the weight version of the forward pass that produced each
        generated token's log-prob and its route row; 0 on prompt/pad positions (versions are
        >= 1: W_u, the weights after u learner updates, is version u + 1; docs/math.md 2.7). Route
        row t is the input side of the pass that produced token t + 1's log-prob, so it carries
        token t + 1's version; the prompt rows are the prefill's, i.e. the first response token's
        (``moe_rl.maths.versions.route_lag_BS``). None: the engine does not record versions (the
        trainer stamps the weights it synced with, ``with_version``).
    """

    tokens_BS: torch.Tensor
    prompt_lens_B: torch.Tensor
    response_lens_B: torch.Tensor
    response_mask_BS: torch.Tensor
    logprobs_BS: torch.Tensor
    routes: list[torch.Tensor]
    group_B: torch.Tensor
    finished_B: torch.Tensor
    logprob_support: str = "full"
    version_BS: torch.Tensor | None = None
    # with SamplingParams.return_dist / dvp, at every generated position (0 elsewhere):
    dist_logp_BSV: torch.Tensor | None = None  # float32 log softmax(logits / T) over the vocabulary
    safe_BSV: torch.Tensor | None = None  # bool, the DVP safe set the token was sampled from
    # what a remote engine reports with the batch (moe_rl/pipeline/remote_engine.py: the weight version
    # lag, the waits of both roles), logged with the step's rollout metrics; {} for a local engine
    engine_metrics: dict[str, Any] = field(default_factory=dict)
    # multi-turn (agent.env; moe_rl/agentic/loop.py): int16 [B, S] each token's turn (0 the prompt,
    # k the assistant turn k and the tool reply after it; response_mask_BS marks the sampled ones),
    # and float32 [B] the environment's reward of each trajectory; None for single-turn batches
    turn_BS: torch.Tensor | None = None
    env_reward_B: torch.Tensor | None = None
    # per route row (as ``routes``): the weight version, source and turn behind it
    # (moe_rl/routing/provenance.py; both engines fill it); None: an engine that records none
    route_prov: list[Provenance] | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.tokens_BS.shape[0])

    def select(self, idx_B: torch.Tensor) -> RolloutBatch:
        """The sequences ``idx_B`` (int64 indices, or a bool [B] keep mask), in that order: every
        per-sequence and per-token field (``dist_*`` and ``safe_*`` included), and their route
        records. ``group_B`` keeps its ids: GRPO groups are whatever ids remain (the caller keeps
        groups whole, ``moe_rl.pipeline.request_buffer.staleness_filter``)."""
        idx_B = idx_B.nonzero().squeeze(1) if idx_B.dtype == torch.bool else idx_B
        picked = {
            f.name: getattr(self, f.name)[idx_B.to(getattr(self, f.name).device)]
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        idx = idx_B.tolist()
        prov = None if self.route_prov is None else [self.route_prov[i] for i in idx]
        return dataclasses.replace(self, routes=[self.routes[i] for i in idx], route_prov=prov, **picked)

    def response_ids(self, pad_id: int) -> torch.Tensor:
        """The generated tokens of each sequence, left-aligned and right-padded: int64 [B, R]
        (R the longest response)."""
        lens_B = self.response_lens_B
        r_max = int(lens_B.max())
        pos_R = torch.arange(r_max, device=lens_B.device)
        idx_BR = (self.prompt_lens_B[:, None] + pos_R[None, :]).clamp(max=self.tokens_BS.shape[1] - 1)
        valid_BR = pos_R[None, :] < lens_B[:, None]
        return torch.where(valid_BR, self.tokens_BS.gather(1, idx_BR), torch.full_like(idx_BR, pad_id))

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every [B]/[B, S] tensor on ``device`` (route records stay where they are)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def with_version(batch: RolloutBatch, version: int) -> RolloutBatch:
    """``batch`` with every generated token, and every route row with provenance, at weight
    ``version`` (an engine that does not track versions: all its tokens come from the weights it
    was last synced with); a batch that already carries versions is returned as it is."""
    if batch.version_BS is not None:
        return batch
    version_BS = torch.where(
        batch.response_mask_BS, torch.tensor(version, dtype=torch.int32, device=batch.tokens_BS.device), 0
    ).to(torch.int32)
    prov = batch.route_prov
    if prov is not None:  # the route rows too: an engine's own count would read as stale rows
        prov = [
            dataclasses.replace(p, version_N=torch.where(p.version_N > 0, version, 0).to(torch.int32))
            for p in prov
        ]
    return dataclasses.replace(batch, version_BS=version_BS, route_prov=prov)


@dataclass(frozen=True)
class TrainBatch:
    """What the learner's passes consume, built once per step by ``moe_rl.step.prepare`` and never
    mutated: minibatches (``select``) and micro-batches (``micro_batches``) are new batches.

    Every per-token tensor is [B, S] (``*_BSV``: [B, S, V]) in the token layout above; fields a
    pass does not need stay None. A log-prob pass needs ``tokens_BS`` and ``seq_lens_B`` (and
    the DVP / exact-KL inputs when set); an update also the loss inputs.

    routes: the routes the pass replays (R3: the rollout's, R2: the old pass's), or None.
    old_routes: the old-log-prob pass's native routes, only compared with (the monitor's
        update-induced flips). Route records stay on the CPU: they are laid out per micro-batch
        and the layout is moved to the router's device (``routing/replay.py``).
    """

    tokens_BS: torch.Tensor
    seq_lens_B: torch.Tensor  # int64 [B], prompt + response tokens
    loss_mask_BS: torch.Tensor | None = None  # bool, the tokens the loss counts
    old_logp_BS: torch.Tensor | None = None
    advantages_BS: torch.Tensor | None = None
    rollout_logp_BS: torch.Tensor | None = None
    is_weights_BS: torch.Tensor | None = None  # decoupled rollout IS weights
    keep_BS: torch.Tensor | None = None  # rejection / TRM keep mask (decoupled)
    ref_logp_BS: torch.Tensor | None = None  # reference policy (KL term)
    safe_BSV: torch.Tensor | None = None  # bool, the engine's DVP safe sets
    rollout_dist_BSV: torch.Tensor | None = None  # rollout log-probs over the vocabulary (exact-KL TRM)
    routes: RouteBatch | None = None
    old_routes: RouteBatch | None = None
    # int64, column t: the version lag of route row t (the old pass's router flips by lag)
    route_lag_BS: torch.Tensor | None = None
    # int64, column t: the agent turn whose engine call computed route row t (the flips by turn)
    route_turn_BS: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.tokens_BS.shape[0])

    def replace(self, **changes) -> TrainBatch:
        return dataclasses.replace(self, **changes)

    def _map(self, per_token, per_seq, per_routes) -> TrainBatch:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif isinstance(v, RouteBatch):
                out[f.name] = per_routes(v)
            else:
                out[f.name] = per_token(v) if v.dim() >= 2 else per_seq(v)
        return TrainBatch(**out)

    def select(self, idx_B: torch.Tensor) -> TrainBatch:
        """The sequences ``idx_B`` (in that order)."""
        cpu_B = idx_B.cpu()
        return self._map(
            lambda v: v[idx_B.to(v.device)], lambda v: v[idx_B.to(v.device)], lambda r: r.select(cpu_B)
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        """Every tensor on ``device`` (no copy where it is already there); routes stay on the CPU."""
        return self._map(lambda v: v.to(device), lambda v: v.to(device), lambda r: r)

    def micro_batches(self, size: int, token_multiple: int = 1, seq_multiple: int = 1) -> list[TrainBatch]:
        """Consecutive groups of ``size`` sequences, each trimmed to its longest sequence, then
        padded so that B * S is a multiple of ``token_multiple`` (TE's FP8 GEMMs need 16) and S a
        multiple of ``seq_multiple`` (sequence parallelism splits S over the TP ranks). Padding
        is zeros: out of every mask, and pad routes in the replay layout."""
        lens = self.seq_lens_B.tolist()  # one host sync per pass: slicing needs Python ints
        return [
            self._chunk(list(range(start, min(start + size, len(lens)))), lens, token_multiple, seq_multiple)
            for start in range(0, len(lens), size)
        ]

    def micro_batches_by_tokens(
        self, max_tokens: int, token_multiple: int = 1, seq_multiple: int = 1
    ) -> tuple[list[TrainBatch], torch.Tensor]:
        """Micro-batches by token budget (verl's dynamic batch size): sequences sorted by length,
        longest first, and packed greedily while (sequences x longest length) <= ``max_tokens``; a
        sequence longer than the budget gets a micro-batch of its own. Each is trimmed and padded
        as in ``micro_batches``.

        Returns:
            micro_batches: the batches, in packing order.
            order_B: int64 [B], micro-batch position -> original sequence index (concatenating the
                micro-batches' rows gives ``self.select(order_B)``; ``argsort(order_B)`` undoes it).
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        lens = self.seq_lens_B.tolist()
        order = sorted(range(len(lens)), key=lambda b: -lens[b])  # stable: ties keep their order
        groups: list[list[int]] = []
        for b in order:  # lengths only fall, so the group's first sequence is its longest
            if groups and (len(groups[-1]) + 1) * lens[groups[-1][0]] <= max_tokens:
                groups[-1].append(b)
            else:
                groups.append([b])
        return (
            [self._chunk(g, lens, token_multiple, seq_multiple) for g in groups],
            torch.tensor(order, dtype=torch.long, device="cpu"),
        )

    def _chunk(self, idx: list[int], lens: list[int], token_multiple: int, seq_multiple: int) -> TrainBatch:
        """The sequences ``idx`` (in that order), trimmed to their longest and padded (see micro_batches)."""
        s_max, b = max(lens[i] for i in idx), len(idx)
        step = math.lcm(token_multiple // math.gcd(b, token_multiple), seq_multiple)  # S is a multiple of it
        extra = -(-s_max // step) * step - s_max
        consecutive = idx == list(range(idx[0], idx[0] + b))
        idx_B = torch.tensor(idx, dtype=torch.long, device="cpu")  # made on the host, like route records

        def rows(v: torch.Tensor) -> torch.Tensor:  # slicing (a view) where the rows are consecutive
            return v[idx[0] : idx[0] + b] if consecutive else v[idx_B.to(v.device)]

        def positions(v: torch.Tensor) -> torch.Tensor:
            v = rows(v)[:, :s_max]
            return torch.nn.functional.pad(v, [0, 0] * (v.dim() - 2) + [0, extra]) if extra else v

        return self._map(positions, rows, lambda r: r.select(idx_B))


@dataclass(frozen=True)
class TokenStats:
    """Per-token outputs of a log-prob pass, each [B, S] (column t: the distribution of token t)."""

    logp_BS: torch.Tensor  # over the full vocabulary, or over the DVP safe set when one is given
    entropy_BS: torch.Tensor
    sum_pi_sq_BS: torch.Tensor
    full_logp_BS: torch.Tensor | None = None  # DVP: over the full vocabulary
    log_safe_mass_BS: torch.Tensor | None = None  # DVP: log of the safe set's probability mass
    exact_kl_BS: torch.Tensor | None = None  # KL(pi_rollout || pi_learner), from the rollout's distributions

    def fields(self) -> dict[str, torch.Tensor]:
        """The statistics that were computed, by field name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
