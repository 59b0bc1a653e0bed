"""The built-in engine's early abort and per-row budgets (``EarlyAbort``; algo.over_sampling,
docs/sampling.md 6): an aborted call returns exactly the prefix of what the uninterrupted call
samples, cut at the first check that found enough complete groups; a budget stops its row there."""

from __future__ import annotations

import pytest
import torch

from moe_rl.rollout.base import EarlyAbort
from tests.step.oversample_helpers import MAX_NEW, SAMPLING, make_engine

pytestmark = pytest.mark.unit

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3], [2], [7, 7, 7], [11, 12], [13], [14, 15]]
N = 2


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def full(engine):
    return engine.generate(PROMPTS, N, SAMPLING, seed=5)


def _assert_prefix(cut, full, lens_B):
    """cut's rows are full's first ``lens_B`` generated tokens, with their log-probs and route rows."""
    assert torch.equal(cut.response_lens_B, lens_B)
    P_B = cut.prompt_lens_B
    S = cut.tokens_BS.shape[1]
    assert torch.equal(cut.tokens_BS, torch.where(cut.tokens_BS == 0, 0, full.tokens_BS[:, :S]))
    # not bitwise: a row that stopped feeds pad, so an expert's grouped matmul sees other rows
    assert torch.allclose(cut.logprobs_BS, full.logprobs_BS[:, :S] * cut.response_mask_BS, atol=1e-5, rtol=0)
    assert cut.response_mask_BS.sum() == lens_B.sum()
    for b in range(cut.num_seqs):  # the route record of the fed tokens: the same rows
        rows = int(P_B[b] + lens_B[b]) - 1
        assert torch.equal(cut.routes[b], full.routes[b][:rows])


def test_abort_returns_the_prefix_cut_at_the_first_check_with_enough_groups(engine, full):
    every, want = 2, 3
    # the uninterrupted call: row b is done after len_b tokens (stop token) or MAX_NEW; a group when
    # its last row is; the abort fires at the first multiple of `every` where `want` groups are done
    done_at_G = full.response_lens_B.view(-1, N).max(1).values
    fire = next(g for g in range(every, MAX_NEW, every) if int((done_at_G <= g).sum()) >= want)
    checks = []

    def enough(done_B, peek):
        checks.append(int(done_B.sum()))
        return int(done_B.view(-1, N).all(1).sum()) >= want

    cut = engine.generate(PROMPTS, N, SAMPLING, seed=5, abort=EarlyAbort(every, enough))
    assert len(checks) == fire // every  # one check per `every` decode steps, none after the abort
    lens_B = full.response_lens_B.clamp(max=fire)
    _assert_prefix(cut, full, lens_B)
    cut_B = full.response_lens_B > fire
    assert cut_B.any() and not cut.finished_B[cut_B].any()  # cut rows: unfinished, shorter than MAX_NEW
    assert torch.equal(cut.finished_B[~cut_B], full.finished_B[~cut_B])


def test_peek_is_the_batch_so_far(engine, full):
    seen = []

    def enough(done_B, peek):
        seen.append(peek())
        return True

    cut = engine.generate(PROMPTS, N, SAMPLING, seed=5, abort=EarlyAbort(3, enough))
    assert len(seen) == 1
    assert torch.equal(seen[0].tokens_BS, cut.tokens_BS) and torch.equal(seen[0].logprobs_BS, cut.logprobs_BS)
    _assert_prefix(cut, full, full.response_lens_B.clamp(max=3))


def test_a_budget_stops_its_row(engine, full):
    budget_B = torch.tensor([1, 2, 3, 4, 5, 12] * 3)[: len(PROMPTS) * N]
    cut = engine.generate(
        PROMPTS, N, SAMPLING, seed=5, abort=EarlyAbort(MAX_NEW, lambda d, p: False, budget_B)
    )
    _assert_prefix(cut, full, torch.minimum(full.response_lens_B, budget_B))
