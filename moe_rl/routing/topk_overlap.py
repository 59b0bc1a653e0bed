"""Overlap of two Top-K expert choices of the same tokens (set difference and overlap@K): pure tensor math.

Shape suffixes: N rows (tokens), K top-k.
"""

from __future__ import annotations

import torch


def topk_agreement(a_NK: torch.Tensor, b_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether the two expert *sets* differ, and their overlap |a & b| / K. Any
    leading dimensions (rows, or rows x layers) are kept: [..., K] -> [...].

    Order within a row does not matter (engines return ids in descending-logit order; a replayed
    set gathered from a record may not be)."""
    differs_N = (a_NK.sort(-1).values != b_NK.sort(-1).values).any(-1)
    overlap_N = (a_NK[..., :, None] == b_NK[..., None, :]).any(-1).sum(-1).to(torch.float32) / a_NK.shape[-1]
    return differs_N, overlap_N
