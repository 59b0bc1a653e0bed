"""TrainBatch micro-batching: fixed-size groups and token-budget buckets (sorted by length)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.types import TrainBatch


def _batch() -> TrainBatch:
    lens_B = torch.tensor([14, 9, 12, 5, 14, 7])
    tokens_BS = torch.arange(6 * 14).view(6, 14) * (torch.arange(14)[None] < lens_B[:, None])
    return TrainBatch(tokens_BS, lens_B, loss_mask_BS=tokens_BS > 0, advantages_BS=tokens_BS.float() / 7)


@pytest.mark.unit
def test_token_budget_buckets_sorted_by_length() -> None:
    b = _batch()
    mbs, order_B = b.micro_batches_by_tokens(30)
    assert order_B.tolist() == [0, 4, 2, 1, 5, 3]  # longest first, ties in batch order
    assert [tuple(mb.tokens_BS.shape) for mb in mbs] == [(2, 14), (2, 12), (2, 7)]  # each B * S <= 30
    assert [mb.seq_lens_B.tolist() for mb in mbs] == [[14, 14], [12, 9], [7, 5]]
    for key in ("tokens_BS", "loss_mask_BS", "advantages_BS"):
        joined = torch.cat(
            [torch.nn.functional.pad(getattr(mb, key), (0, 14 - getattr(mb, key).shape[1])) for mb in mbs]
        )
        assert torch.equal(joined, getattr(b.select(order_B), key))
        assert torch.equal(joined[torch.argsort(order_B)], getattr(b, key))
    one, order = b.micro_batches_by_tokens(5)  # every sequence over budget: one each
    assert [mb.num_seqs for mb in one] == [1] * 6 and order.tolist() == [0, 4, 2, 1, 5, 3]
    all_in, _ = b.micro_batches_by_tokens(1000)
    assert [tuple(mb.tokens_BS.shape) for mb in all_in] == [(6, 14)]
    padded, _ = b.micro_batches_by_tokens(30, token_multiple=16, seq_multiple=2)
    assert [tuple(mb.tokens_BS.shape) for mb in padded] == [(2, 16), (2, 16), (2, 8)]
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        b.micro_batches_by_tokens(0)


@pytest.mark.unit
def test_fixed_size_micro_batches_unchanged() -> None:
    b = _batch()
    mbs = b.micro_batches(4)
    assert [tuple(mb.tokens_BS.shape) for mb in mbs] == [(4, 14), (2, 14)]
    assert torch.equal(mbs[0].tokens_BS, b.tokens_BS[:4]) and torch.equal(
        mbs[1].advantages_BS, b.advantages_BS[4:]
    )
    assert mbs[0].tokens_BS.data_ptr() == b.tokens_BS.data_ptr()  # consecutive rows: views, no copy
