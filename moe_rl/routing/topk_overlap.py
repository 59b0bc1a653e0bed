"""Overlap of two Top-K expert choices of the same tokens (set difference and overlap@K), and
flips counted by the Top-K margin: pure tensor math.

Shape suffixes: N rows (tokens), K top-k, L layers, M margin buckets.
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


# Top-K margin buckets of the flip counts (docs/math.md 7.2): [0, 1e-3), [1e-3, 1e-2), [1e-2, 1e-1),
# [1e-1, inf); 1e-1 is log.router_margin_eps's default, 1e-2 to 1e-3 the bf16 resolution of a logit
# of size 2.5 to 0.25 (|h| 2^-8)
MARGIN_EDGES = (1e-3, 1e-2, 1e-1)
MARGIN_BUCKETS = ("lt1e-3", "1e-3_1e-2", "1e-2_1e-1", "ge1e-1")


def flips_by_margin(differs_NL: torch.Tensor, margin_NL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flips_M, pairs_M), float64: per margin bucket (``MARGIN_BUCKETS``), the (row, layer) pairs
    whose expert set differs, and all pairs, bucketed by ``margin_NL``."""
    edges = torch.tensor(MARGIN_EDGES, dtype=margin_NL.dtype, device=margin_NL.device)
    bucket = torch.bucketize(margin_NL.reshape(-1), edges, right=True)
    M = len(MARGIN_BUCKETS)
    pairs_M = torch.bincount(bucket, minlength=M).double()
    flips_M = torch.bincount(bucket, weights=differs_NL.reshape(-1).double(), minlength=M)
    return flips_M, pairs_M
