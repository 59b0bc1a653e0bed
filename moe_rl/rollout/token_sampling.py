"""Sampling one token per row from the engine's logits (pure): top-k / top-p filtering and the
exponential race, with the log-prob the learner recomputes (the built-in engine's; vLLM's DVP
logits processor is checked against it)."""

from __future__ import annotations

import torch

from moe_rl.corrections.correction_specs import DvpSpec
from moe_rl.corrections.dvp import safe_set_for


def filter_logits(scaled_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (-inf) the tokens top-k / top-p exclude from the sampling distribution.

    top_k: keep the k largest (ties at the k-th value kept); 0 = off.
    top_p: keep the smallest prefix of tokens, by descending probability, whose mass reaches
        top_p (the most likely token is always kept); 1 = off.
    """
    out_BV = scaled_BV
    if 0 < top_k < scaled_BV.shape[-1]:
        kth_B1 = torch.topk(out_BV, top_k, dim=-1).values[:, -1:]
        out_BV = out_BV.masked_fill(out_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(out_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV  # exclusive cumsum
        drop_sorted_BV = mass_before_BV >= top_p  # the mass already reached top_p before it
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        out_BV = out_BV.masked_fill(drop_BV, float("-inf"))
    return out_BV


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
    dvp: DvpSpec = DvpSpec(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sample one token per row; return (tokens_B int64, logprobs_B float32, the full log-probs
    [B, V], and the DVP safe set [B, V] or None).

    The sample comes from softmax(filter(logits / temperature)); the log-prob is that of the
    chosen token under log softmax(logits / temperature) over the full vocabulary (the
    built-in engine's docstring, moe_rl/rollout/builtin.py), or, with ``dvp`` on, over the DVP
    safe set it was sampled from.
    Sampling uses the exponential-race trick argmax(p / Exp(1)) (as vLLM does): one vectorized
    draw per step, and a token with p = 0 can never win.
    """
    scaled_BV = logits_BV.float() / temperature
    logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)
    filtered_BV = filter_logits(scaled_BV, top_k, top_p)
    safe_BV = None
    reported_BV = logprobs_BV
    if dvp.on:  # DVP: sample from the safe set only, report log-probs renormalised over it
        safe_BV = safe_set_for(dvp, scaled_BV[:, None, :])[:, 0]
        filtered_BV = filtered_BV.masked_fill(~safe_BV, float("-inf"))
        reported_BV = torch.log_softmax(scaled_BV.masked_fill(~safe_BV, float("-inf")), dim=-1)
    probs_BV = torch.softmax(filtered_BV, dim=-1)
    race_BV = torch.empty_like(probs_BV).exponential_(generator=generator)
    tokens_B = torch.argmax(probs_BV / race_BV, dim=-1)
    return tokens_B, reported_BV.gather(-1, tokens_B[:, None]).squeeze(-1), logprobs_BV, safe_BV
