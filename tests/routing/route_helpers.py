"""Shared by the route-record tests (tests never import each other's modules): a small MoE config,
its route header, and a batch of random but valid route records."""

from __future__ import annotations

import torch

from moe_rl.config import ModelConfig
from moe_rl.routing.record import RouteBatch, RouteHeader, RouteRecord

CFG = ModelConfig(vocab_size=50, num_layers=4, first_k_dense=1, num_experts=8, moe_router_topk=2)
HEADER = RouteHeader.for_model(CFG)


def random_routes(num_tokens: list[int], seed: int = 0) -> RouteBatch:
    """One record per sample of ``num_tokens[i]`` tokens (prompt of 2): ``t - 1`` rows of 3 MoE
    layers, top-2 of 8 distinct experts per row."""
    g = torch.Generator().manual_seed(seed)
    recs = []
    for t in num_tokens:
        ids = torch.rand(t - 1, 3, 8, generator=g).argsort(-1)[..., :2]  # distinct per row
        recs.append(RouteRecord(ids.to(torch.uint8), prompt_len=2, start=0, header=HEADER))
    return RouteBatch.from_records(recs)
