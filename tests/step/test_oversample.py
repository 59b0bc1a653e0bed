"""Over-sampling with early abort and partial rollouts (moe_rl.step.oversample.py) over the real
built-in engine: a resumed response keeps every earlier token's log-prob, version and route row
(the re-prefill's rows discarded but the one that fed the first resumed token); drop counts and the
length bias; the staleness bound; an exact resume of the pending groups through their checkpoint
form; dynamic sampling's signal in the abort."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from moe_rl.metrics import reduce_metrics
from moe_rl.rollout.base import EarlyAbort
from moe_rl.routing.provenance import COMPUTED, REPREFILL
from moe_rl.step.oversample import Pending, collect_over, generate_round, remote_round, resume_rows
from moe_rl.step.sampling import groups_with_signal
from tests.step.oversample_helpers import (
    MAX_NEW,
    PAD_ID,
    SAMPLING,
    N,
    draw,
    generator,
    make_engine,
    plan,
    score,
    weights,
)

pytestmark = pytest.mark.unit


def _step(p, engine, cursor, pending):
    got, pending = collect_over(p, generator(engine), draw, score, cursor, pending, engine.version)
    return got, pending, reduce_metrics(got.metrics)


def test_a_resumed_response_keeps_its_earlier_tokens_and_routes():
    engine = make_engine(1)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3], [2]]
    cut = engine.generate(prompts, 2, SAMPLING, seed=5, abort=EarlyAbort(3, lambda d, p: True))
    old = cut.select(~cut.finished_B)  # the rows the abort cut (3 tokens each)
    assert old.num_seqs >= 2 and bool((old.response_lens_B == 3).all())
    v1 = engine.token_logprobs(old.tokens_BS)
    engine.load_weights(weights(2), version=2)
    end_R = old.prompt_lens_B + old.response_lens_B
    ids = [row[:e].tolist() for row, e in zip(old.tokens_BS, end_R.tolist())]
    budget = MAX_NEW - old.response_lens_B
    cont = engine.generate(ids, 1, SAMPLING, seed=6, abort=EarlyAbort(MAX_NEW, lambda d, p: False, budget))
    got = resume_rows(old, cont, PAD_ID)
    assert torch.equal(got.response_lens_B, old.response_lens_B + cont.response_lens_B)
    assert bool((got.response_lens_B <= MAX_NEW).all())
    v2 = engine.token_logprobs(got.tokens_BS)  # no-cache forwards of the joined rows, temperature 1
    for r, e in enumerate(end_R.tolist()):
        p, t = int(old.prompt_lens_B[r]), int(got.prompt_lens_B[r] + got.response_lens_B[r])
        assert torch.equal(got.tokens_BS[r, :e], old.tokens_BS[r, :e])
        # earlier tokens: the log-prob and version they were sampled with (v1), never v2's
        assert torch.equal(got.logprobs_BS[r, p:e], old.logprobs_BS[r, p:e])
        assert torch.allclose(got.logprobs_BS[r, p:e], v1[r, p:e], atol=2e-5)
        assert (got.version_BS[r, p:e] == 1).all() and (got.version_BS[r, e:t] == 2).all()
        assert torch.allclose(got.logprobs_BS[r, e:t], v2[r, e:t], atol=2e-5)
        assert got.response_mask_BS[r].sum() == t - p and got.response_mask_BS[r, p:t].all()
        # route rows: the recorded ones before the last earlier token; its row is the re-prefill's
        assert got.routes[r].shape[0] == t - 1
        assert torch.equal(got.routes[r][: e - 1], old.routes[r][: e - 1])
        assert torch.equal(got.routes[r][e - 1 :], cont.routes[r][e - 1 :])
        prov = got.route_prov[r]
        assert (prov.version_N[: e - 1] == 1).all() and (prov.source_N[: e - 1] == COMPUTED).all()
        assert prov.source_N[e - 1] == REPREFILL and prov.version_N[e - 1] == 2
        assert (prov.source_N[e:] == COMPUTED).all() and (prov.version_N[e - 1 :] == 2).all()
    # an engine that omits the rows the caller holds (vLLM, EarlyAbort.route_starts): the same join
    for late in (0, 1):  # from old's last token's row (the re-prefill's), or one row too late
        omitted = dataclasses.replace(
            cont,
            routes=[c[e - 1 + late :] for c, e in zip(cont.routes, end_R.tolist())],
            route_prov=[p.slice(e - 1 + late, p.num_rows) for p, e in zip(cont.route_prov, end_R.tolist())],
        )
        if late:
            with pytest.raises(ValueError, match="row 0's continuation has no route row for position"):
                resume_rows(old, omitted, PAD_ID)
            continue
        same = resume_rows(old, omitted, PAD_ID)
        assert all(torch.equal(x, y) for x, y in zip(same.routes, got.routes))
        for x, y in zip(same.route_prov, got.route_prov):
            assert torch.equal(x.version_N, y.version_N) and torch.equal(x.source_N, y.source_N)


def test_drop_trains_the_first_complete_groups_and_counts_the_rest():
    engine = make_engine(1)
    got, pending, m = _step(plan(factor=2.0, on_abort="drop", need=4), engine, 0, Pending([]))
    assert pending.batch is None and got.batch.num_seqs == 4 * N
    assert bool((got.batch.finished_B | (got.batch.response_lens_B == MAX_NEW)).all())  # trained: complete
    assert m["sampling/dropped_aborted"] == 4 * N  # 8 started: 4 trained
    assert m["sampling/aborted"] >= 1  # the abort cut at least one response
    assert m["sampling/kept_len_mean"] == pytest.approx(got.batch.response_lens_B.float().mean().item())
    # the length bias the drop shows: the dropped responses (cut where they were) run longer here
    assert m["sampling/dropped_len_mean"] > m["sampling/kept_len_mean"]
    generated = m["sampling/response_tokens_generated"]
    assert generated == got.batch.response_lens_B.sum() + m["sampling/dropped_len_mean"] * 4 * N
    signal_P = groups_with_signal(got.scores.accuracy_B, got.batch.group_B, 4)
    useful = got.batch.response_lens_B.view(4, N)[signal_P].sum()
    assert m["sampling/useful_token_frac"] == pytest.approx(float(useful) / generated)


def test_without_dynamic_sampling_the_counts_are_of_trained_groups_with_signal():
    """sampling/groups_kept is the trained groups with signal, as on the colocated rounds without
    over-sampling (docs/sampling.md 5); the surplus complete groups the drop throws away are counted
    apart, not as generated groups with or without signal."""
    got, _, m = _step(plan(factor=2.0, on_abort="drop", need=4), make_engine(1), 0, Pending([]))
    signal = int(groups_with_signal(got.scores.accuracy_B, got.batch.group_B, 4).sum())
    assert signal == 3  # the seeded round trains one group without signal: the counts differ
    assert m["sampling/groups_kept"] == signal
    assert m["sampling/groups_generated"] == 4 and m["sampling/groups_dropped_all_equal"] == 4 - signal
    assert m["sampling/useful_frac"] == signal / 4
    # 8 groups started: 4 trained, 2 complete beyond them (surplus), 2 cut by the abort
    assert m["sampling/dropped_surplus"] == 2 and m["sampling/dropped_aborted"] == (8 - 4) * N
    assert 8 - 4 - m["sampling/dropped_surplus"] <= m["sampling/aborted"]


def _run(p, first: int, steps: int, pending: Pending, split: bool = False):
    """Steps ``first`` .. ``steps - 1`` from ``pending``, the weights moving on after each (step t
    generates with version t + 1); each step's batch, metrics and the groups it left pending.
    ``split``: each round as on a rollout rank (``_remote``)."""
    engine, out = make_engine(first + 1), []
    for step in range(first, steps):
        if split:
            got, pending = collect_over(
                p, None, None, score, step, pending, engine.version, None, _remote(p, engine)
            )
            m = reduce_metrics(got.metrics)
        else:
            got, pending, m = _step(p, engine, step, pending)
        out.append((got, m, pending))
        engine.load_weights(weights(step + 2), version=step + 2)
    return out


def _checkpointed(pending: Pending) -> Pending:
    """The pending groups through their checkpoint form (torch.save, a weights_only load)."""
    buf = io.BytesIO()
    torch.save(pending.state_dict(), buf)
    buf.seek(0)
    return Pending.from_state_dict(torch.load(buf, weights_only=True))


def test_partial_rollouts_resume_under_new_weights_and_resume_exactly():
    p = plan(factor=2.0, on_abort="partial", need=4)
    full = _run(p, 0, 3, Pending([]))
    resumed = _run(p, 1, 3, _checkpointed(full[0][2]))  # a fresh engine, as a resumed run has
    assert sum(m["sampling/resumed"] for _, m, _ in full) >= 1  # cut responses were continued
    for step, ((a, ma, _), (b, mb, _)) in enumerate(zip(full[1:], resumed), start=1):
        assert a.batch.num_seqs == 4 * N
        for f in ("tokens_BS", "logprobs_BS", "version_BS", "response_mask_BS", "group_B"):
            assert torch.equal(getattr(a.batch, f), getattr(b.batch, f)), (step, f)
        assert all(torch.equal(x, y) for x, y in zip(a.batch.routes, b.batch.routes))
        assert all(
            torch.equal(x.source_N, y.source_N) for x, y in zip(a.batch.route_prov, b.batch.route_prov)
        )
        assert ma == pytest.approx(mb, nan_ok=True)
    for step, (a, ma, _) in enumerate(full):
        v = step + 1  # this step's version: earlier tokens are exactly 1 behind (max_staleness 1)
        older = a.batch.response_mask_BS & (a.batch.version_BS < v)
        assert bool((a.batch.version_BS[older] == v - 1).all())
        assert ma["sampling/resumed_tokens"] == older.sum()
        assert ma["sampling/resumed_token_lag_mean"] == (
            1 if older.any() else pytest.approx(float("nan"), nan_ok=True)
        )
        assert ma["sampling/partial_dropped_stale"] % N == 0  # whole groups


def _remote(p, engine):
    """A split run's round (parallel.rollout_ranks): the learner sends its pending groups in the
    request (their checkpoint form: ``RoundRequest.pending``), the rollout rank runs
    ``generate_round`` with them and sends the round back, the learner reads it (``remote_round``)."""

    def run_round(index: int, want: int, pending: Pending):
        got = generate_round(p, generator(engine), draw, score, index, want, _checkpointed(pending))
        return remote_round(p, got.batch, got.prompts, pending)

    return run_round


@pytest.mark.parametrize("dynamic", [False, True])
def test_split_partial_rounds_are_the_colocated_rounds(dynamic):
    # the rollout rank resumes the learner's pending groups: every batch, pending group and count
    # (resumed, tokens generated, aborted) as colocated; with dynamic sampling over several rounds
    p = plan(factor=2.0, on_abort="partial", need=4, dynamic=dynamic)
    here, there = _run(p, 0, 3, Pending([])), _run(p, 0, 3, Pending([]), split=True)
    assert sum(m["sampling/resumed"] for _, m, _ in there) > 0
    for (a, ma, pa), (b, mb, pb) in zip(here, there):
        for f in ("tokens_BS", "logprobs_BS", "version_BS", "response_mask_BS", "group_B"):
            assert torch.equal(getattr(a.batch, f), getattr(b.batch, f)), f
        assert all(torch.equal(x, y) for x, y in zip(a.batch.routes, b.batch.routes))
        assert ma == pytest.approx(mb, nan_ok=True, rel=0, abs=0)
        assert pa.prompts == pb.prompts


def test_a_partial_older_than_max_staleness_is_dropped_and_counted():
    p = plan(factor=2.0, on_abort="partial", need=4, staleness=1)
    engine = make_engine(1)
    _, pending, _ = _step(p, engine, 0, Pending([]))
    assert pending.batch is not None
    rows = pending.batch.num_seqs
    engine.load_weights(weights(3), version=3)  # two updates later: its tokens would lag 2
    got, _, m = _step(p, engine, 1, pending)
    assert m["sampling/partial_dropped_stale"] == rows and m["sampling/resumed"] == 0
    assert bool((got.batch.version_BS[got.batch.response_mask_BS] == 3).all())


def test_with_dynamic_sampling_the_abort_waits_for_groups_with_signal():
    p = plan(factor=3.0, on_abort="drop", need=2, dynamic=True)
    got, _, m = _step(p, make_engine(1), 0, Pending([]))
    signal_P = groups_with_signal(got.scores.accuracy_B, got.batch.group_B, 2)
    assert m["sampling/cap_reached"] == 0 and bool(signal_P.all())  # every trained group has signal
    assert m["sampling/rounds"] == 1  # the abort waited for groups with signal: one round held them
    assert m["sampling/groups_kept"] == 2
    assert m["sampling/useful_frac"] == pytest.approx(
        (m["sampling/groups_generated"] - m["sampling/groups_dropped_all_equal"])
        / m["sampling/groups_generated"]
    )


def test_a_peek_without_versions_as_vllm_gives_the_same_steps():
    """vLLM's peek carries no version_BS (its round's call stamps them when it returns): under
    dynamic sampling the abort's check joins it with the pending complete rows (which have them),
    and the steps must be those of a versioned peek (the built-in engine's)."""

    def vllm_like(engine):
        generate = generator(engine)

        def call(ids, index, abort):
            def enough(done_B, peek):
                return abort.enough(done_B, lambda: dataclasses.replace(peek(), version_BS=None))

            return generate(ids, index, dataclasses.replace(abort, enough=enough))

        return call

    p = plan(factor=2.0, on_abort="partial", need=2, dynamic=True)
    runs = []
    for gen in (generator, vllm_like):
        engine, pending, out = make_engine(1), Pending([]), []
        for step in range(3):
            got, pending = collect_over(p, gen(engine), draw, score, step, pending, engine.version)
            out.append((got, reduce_metrics(got.metrics), pending))
            engine.load_weights(weights(step + 2), version=step + 2)
        runs.append(out)
    # the case of the fix: a step began with pending rows already complete (surplus groups)
    assert any(pend.batch is not None and bool(pend.done_B.any()) for _, _, pend in runs[0][:-1])
    for (a, ma, _), (b, mb, _) in zip(*runs):
        for f in ("tokens_BS", "logprobs_BS", "version_BS", "group_B"):
            assert torch.equal(getattr(a.batch, f), getattr(b.batch, f)), f
        assert ma == pytest.approx(mb, nan_ok=True)
