"""What the checkpoint tests share: a small batch per rank and two losses (a real NLL, and one
with zero gradient everywhere, which the learner skips)."""

from __future__ import annotations

import torch

from moe_rl.types import TrainBatch
from tests.models import TINY_MOE_L2_ALL_MOE as MODEL


def batch(rank: int) -> TrainBatch:
    g = torch.Generator().manual_seed(100 + rank)
    tokens_BS = torch.randint(3, MODEL.vocab_size, (4, 12), generator=g)
    lens_B = torch.tensor([12, 9, 7, 12])
    pos_S = torch.arange(12)
    return TrainBatch(tokens_BS, lens_B, loss_mask_BS=(pos_S[None] >= 3) & (pos_S[None] < lens_B[:, None]))


def nll(mb, st, normalizer):
    return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}


def zero_signal(mb, st, normalizer):
    return (st.logp_BS * (mb.loss_mask_BS & False)).sum() / normalizer, {}
