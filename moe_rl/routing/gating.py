"""Top-K routers in closed form: softmax or sigmoid scores, an expert bias, group-limited top-k.

One function per step so that the built-in engine, the replay semantics and the tests share one
definition (megatron-core's ``topk_routing_with_score_function`` computes the same in the
learner; tests/routing/test_gating.py pins both to hand-computed values):

- selection: the K experts of the highest *selection* scores (softmax: the logits; sigmoid: the
  sigmoid scores plus the expert bias ``e_score_correction_bias``), restricted with groups to
  the ``group_topk`` groups whose two best selection scores sum highest (HF DeepSeek-V3 /
  GLM-4.5; megatron sums the top ``K // group_topk``, equal because the config requires 2);
- gating: the *unbiased* scores gathered at the chosen ids (softmax: renormalised over the K,
  or the full softmax's K probabilities with ``norm_topk_prob`` false; sigmoid: renormalised
  over the K), times ``routed_scaling_factor``. The bias selects, never weights; replayed ids
  are gated by exactly the same rule (:func:`gates`).

Shape suffixes: T tokens, E experts, K top-k, G expert groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.config import ModelConfig


@dataclass(frozen=True)
class RouterSpec:
    """The router of one MoE layer, from ``ModelConfig`` (HF names in the field comments there)."""

    top_k: int
    score_function: str = "softmax"  # softmax | sigmoid
    norm_topk_prob: bool = True
    num_groups: int = 0  # 0 or 1: no group limit
    group_topk: int = 0
    scaling_factor: float = 1.0

    @classmethod
    def from_model(cls, cfg: ModelConfig) -> RouterSpec:
        return cls(
            cfg.moe_router_topk,
            cfg.moe_router_score_function,
            cfg.norm_topk_prob,
            cfg.moe_router_num_groups,
            cfg.moe_router_group_topk,
            cfg.moe_router_scaling_factor,
        )

    @property
    def grouped(self) -> bool:
        return self.num_groups > 1


def selection_scores(
    logits_TE: torch.Tensor, spec: RouterSpec, bias_E: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores_TE, select_TE), fp32: what gates (unbiased) and what picks (biased for sigmoid)."""
    logits_TE = logits_TE.float()
    if spec.score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        select_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
        return scores_TE, select_TE
    # softmax: top-k of the logits is top-k of the probabilities (monotone)
    return torch.softmax(logits_TE, dim=-1), logits_TE


def group_mask(select_TE: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """bool [T, E]: the experts of each token's ``group_topk`` best groups (all True without groups)."""
    T, E = select_TE.shape
    if not spec.grouped:
        return torch.ones_like(select_TE, dtype=torch.bool)
    G = spec.num_groups
    group_score_TG = select_TE.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
    chosen_TG = torch.zeros((T, G), dtype=torch.bool, device=select_TE.device)
    chosen_TG.scatter_(1, group_score_TG.topk(spec.group_topk, dim=-1).indices, True)
    return chosen_TG[:, :, None].expand(T, G, E // G).reshape(T, E)


def topk_margin(select_TE: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """fp32 [T]: h_(K) - h_(K+1) of the selection scores (docs/math.md 7.2), both within the token's
    selected groups; +inf where no (K+1)-th candidate exists (K = E, or the groups hold only K)."""
    select_TE = select_TE.detach().float()
    if spec.grouped:
        select_TE = select_TE.masked_fill(~group_mask(select_TE, spec), float("-inf"))
    K, E = spec.top_k, select_TE.shape[-1]
    if K >= E:
        return torch.full(select_TE.shape[:1], float("inf"), device=select_TE.device)
    top_TK = select_TE.topk(K + 1, dim=-1, sorted=True).values
    return (top_TK[:, K - 1] - top_TK[:, K]).nan_to_num(nan=float("inf"))  # -inf - -inf: no candidate


def gates(scores_TE: torch.Tensor, ids_TK: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """fp32 gate weights [T, K] of the experts ``ids_TK`` (chosen natively or replayed)."""
    if spec.score_function == "softmax" and spec.norm_topk_prob:
        # softmax over the K selected logits == renormalised K probabilities
        g_TK = scores_TE.gather(1, ids_TK)
        g_TK = g_TK / g_TK.sum(-1, keepdim=True)
    else:
        g_TK = scores_TE.gather(1, ids_TK)
        if spec.score_function == "sigmoid" and spec.norm_topk_prob:
            g_TK = g_TK / (g_TK.sum(-1, keepdim=True) + 1e-20)
    return g_TK * spec.scaling_factor


def route(
    logits_TE: torch.Tensor, spec: RouterSpec, bias_E: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Native routing: (gates_TK fp32, ids_TK int64 in descending selection score, select_TE).

    ``select_TE`` (the biased scores, -inf outside the chosen groups) is what a margin is
    measured on."""
    scores_TE, select_TE = selection_scores(logits_TE, spec, bias_E)
    if spec.grouped:
        select_TE = select_TE.masked_fill(~group_mask(select_TE, spec), float("-inf"))
    ids_TK = select_TE.topk(spec.top_k, dim=-1).indices
    return gates(scores_TE, ids_TK, spec), ids_TK, select_TE


def group_violations(select_TE: torch.Tensor, ids_TK: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """bool [T]: a (replayed) id lies outside the token's own selected groups (never with no groups).

    ``select_TE``: the unmasked selection scores of the learner's router."""
    if not spec.grouped:
        return torch.zeros(ids_TK.shape[0], dtype=torch.bool, device=ids_TK.device)
    return ~group_mask(select_TE, spec).gather(1, ids_TK).all(-1)
