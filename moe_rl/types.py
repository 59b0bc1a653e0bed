"""Batches that move between the rollout engine, the rewards and the learner.

Shape suffixes: B sequences, S padded sequence length, T tokens of one sequence,
L MoE layers, K router top-k.

Token layout (engine and learner agree on it): every sequence is prompt + response, left-aligned
and right-padded to S with the pad id. ``logprobs_BS[b, t]`` is log p(tokens[b, t] | tokens[b, :t])
under softmax(logits / temperature) over the full vocabulary; it is only meaningful where
``response_mask_BS`` is true (the generated tokens), and 0 elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    # Dynamic Vocabulary Pruning: sample only from the safe set of ``dvp_rule`` and report
    # log-probs renormalised over it; 0 = off (full vocabulary).
    dvp_threshold: float = 0.0
    dvp_rule: str = "relative"  # relative (p >= threshold * max p) | top_p (smallest set of mass >= threshold)
    return_dist: bool = False  # also return the full rollout distribution per generated token

    @property
    def logprob_support(self) -> str:
        """The support the reported log-probs are normalised over; the learner must match it."""
        return f"dvp:{self.dvp_rule}:{self.dvp_threshold:g}" if self.dvp_threshold > 0 else "full"


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
    # with SamplingParams.return_dist / dvp_threshold, at every generated position (0 elsewhere):
    dist_logp_BSV: torch.Tensor | None = None  # float32 log softmax(logits / T) over the vocabulary
    safe_BSV: torch.Tensor | None = None  # bool, the DVP safe set the token was sampled from

    @property
    def num_seqs(self) -> int:
        return int(self.tokens_BS.shape[0])
