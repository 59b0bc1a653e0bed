"""The rollout engine interface every engine implements (built-in on CPU, vLLM on GPU).

design.md, "The rollout engine interface": ``generate`` returns a :class:`RolloutBatch` in the
token layout of ``moe_rl/types.py`` plus the route record of every sample; ``load_weights`` takes
the learner's canonical (HF Qwen3-MoE) named tensors, all experts gathered.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from moe_rl.types import RolloutBatch, SamplingParams


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine.

    Attributes:
        logprob_support: the support the reported log-probs are normalised over; "full" means
            log softmax(logits / temperature) over the whole vocabulary, whatever top-k/top-p
            did to the sampling distribution. (A DVP safe-set support may come later.)
        returns_routes: whether ``RolloutBatch.routes`` holds the Top-K ids of every MoE layer
            (needed by routing replay R3).
    """

    logprob_support: str
    returns_routes: bool

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                 seed: int) -> RolloutBatch:
        """Sample n responses per prompt; B = len(prompts) * n, sequence b answers prompt b // n."""
        ...

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Replace all weights with the canonical named tensors (strict: names and shapes)."""
        ...
