"""The rollout engine interface every engine implements (built-in on CPU, vLLM on GPU).

docs/design.md 4: ``generate`` returns a :class:`RolloutBatch` in the
token layout of ``moe_rl/types.py`` plus the route record of every sample; ``load_weights`` takes
the learner's canonical (HF Qwen3-MoE) named tensors, all experts gathered: one dict, or a stream
of chunks (``Learner.iter_canonical_layers``: a layer at a time, so no rank ever holds the full
model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from moe_rl.types import RolloutBatch, SamplingParams

# One dict of canonical tensors, or an iterable of dicts (chunks) that together hold each once.
Weights = Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]

ENGINE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}  # rollout.dtype
# Canonical tensors an engine may keep in fp32 whatever ``rollout.dtype``: the router weight (the
# built-in engine always, routing is precision-sensitive; vLLM for a model whose router runs in
# fp32, else it casts it on load) and the expert bias (both engines).
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def engine_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype an engine of ``dtype`` (``ENGINE_DTYPES[rollout.dtype]``) holds canonical tensor
    ``name`` in: the weight broadcast casts to it on the learner (docs/design.md 15.2)."""
    return torch.float32 if name.endswith(FP32_SUFFIXES) else dtype


@runtime_checkable
class UpdateSource(Protocol):
    """Where in-flight weight updates come from (docs/design.md 15.1): an engine that accepts them
    polls once before each forward pass of a generate call and applies what it gets whole, between
    two forwards, never during one."""

    def poll(self) -> tuple[int, Weights] | None:
        """The next update as (weight version, canonical weights), or None when none is ready."""
        ...


def weight_chunks(weights: Weights) -> Iterator[Mapping[str, torch.Tensor]]:
    """The chunks of ``weights``: a single dict is one chunk."""
    if isinstance(weights, Mapping):
        yield weights
    else:
        yield from weights


@dataclass(frozen=True)
class EarlyAbort:
    """A generate call that may stop before every row is done (``algo.over_sampling``,
    docs/sampling.md 6): the built-in engine checks ``enough`` every ``every`` decode steps, and
    when it says so returns at once, the rows not done yet cut where they are (not finished, and
    shorter than their budget: the caller tells them from rows that hit it).

    budget_B: int64 [B] or None: the most tokens row b may generate in this call (a resumed
        partial: what ``max_new_tokens`` leaves it); None: ``max_new_tokens`` for every row.
    enough(done_B, peek): done_B bool [B] (the row emitted a stop token or used its budget), peek()
        the batch so far (as ``generate`` would return it now); true: abort the rest.
    route_starts: list[int] or None: the route rows of prompt b the caller holds already (a resumed
        partial: all but the row of its last token); an engine with ``omits_route_prefix`` (vLLM)
        returns rows from there on, the built-in engine all rows (``resume_rows`` takes either).

    vLLM checks every ``every`` engine steps (its first step prefills and samples each request's
    first token, as the built-in engine's first decode step), once every request has a token.
    """

    every: int
    enough: Callable[[torch.Tensor, Callable[[], RolloutBatch]], bool]
    budget_B: torch.Tensor | None = None
    route_starts: list[int] | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine. The support of the reported log-probs is
    per call (``RolloutBatch.logprob_support``, from ``SamplingParams``); every engine returns
    the route record of every MoE layer."""

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, seed: int) -> RolloutBatch:
        """Sample n responses per prompt; B = len(prompts) * n, sequence b answers prompt b // n."""
        ...

    def load_weights(self, weights: Weights) -> dict | None:
        """Replace all weights with the canonical named tensors, a dict or a stream of chunks
        consumed chunk by chunk (strict over all chunks: names, shapes, each tensor once); None,
        or the sync's metrics. The engines of a split world are loaded by the pipeline's sync
        owner (``moe_rl/pipeline/weight_sync.py``)."""
        ...


class ScheduledUpdates:
    """An ``UpdateSource`` that hands out fixed updates at fixed polls: ``at[i] = (version, weights)``
    is returned by poll i (0-based, counted over this source's life), None by every other poll.
    A deterministic schedule, for tests and for experiments that place an update at a chosen step."""

    def __init__(self, at: Mapping[int, tuple[int, Weights]]) -> None:
        self.at = dict(at)
        self.polls = 0

    def poll(self) -> tuple[int, Weights] | None:
        i, self.polls = self.polls, self.polls + 1
        return self.at.get(i)
