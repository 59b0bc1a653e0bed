"""unit tier: policy versions and lag (moe_rl/maths/versions.py, RolloutBatch.version_BS): the lag,
the staleness filter and its group rule, the histogram and the k3 by lag, the route rows' lags,
and the batch helpers, each against values worked out by hand (docs/math.md 2.7)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.corrections.importance import offpolicy_metrics
from moe_rl.maths.advantages import grpo
from moe_rl.maths.versions import (
    check_versions,
    k3_by_lag,
    lag_BS,
    lag_k3_by_turn,
    lag_metrics,
    route_lag_BS,
    route_turn_BS,
    sum_by_lag,
)
from moe_rl.pipeline.request_buffer import staleness_filter
from moe_rl.types import RolloutBatch, with_version

# 4 sequences, prompt 2, responses of 4, 3, 4, 2 tokens (S = 6); the learner is at version 5
PROMPT_B = torch.tensor([2, 2, 2, 2])
RESP_B = torch.tensor([4, 3, 4, 2])
POS_S = torch.arange(6)
MASK_BS = (POS_S >= 2) & (POS_S < (PROMPT_B + RESP_B)[:, None])
VERSION_BS = torch.tensor(
    [
        [0, 0, 4, 4, 5, 5],  # an in-flight update after two tokens: lags 1 1 0 0
        [0, 0, 2, 3, 5, 0],  # two updates while generating: lags 3 2 0
        [0, 0, 5, 5, 5, 5],  # fresh
        [0, 0, 3, 3, 0, 0],  # lags 2 2
    ],
    dtype=torch.int32,
)
LAG_BS = torch.tensor(
    [[0, 0, 1, 1, 0, 0], [0, 0, 3, 2, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 2, 2, 0, 0]], dtype=torch.int64
)
GROUP_B = torch.tensor([0, 0, 1, 1])


def _mean(m) -> float:
    return float(m.sum) / float(m.count)


@pytest.mark.unit
def test_lag_is_learner_version_minus_token_version_on_generated_tokens():
    out = lag_BS(VERSION_BS, MASK_BS, 5)
    assert out.dtype == torch.int64 and torch.equal(out, LAG_BS)
    check_versions(VERSION_BS, MASK_BS, 5)  # a true batch passes


@pytest.mark.unit
@pytest.mark.parametrize(
    "edit, learner, needle",
    [
        ((0, 0, 1), 5, "1 prompt/pad positions with a version other than 0"),
        ((1, 5, 7), 5, "1 prompt/pad positions"),  # padding after the response
        ((2, 3, 6), 5, "1 generated tokens newer than the learner's version 5"),
        ((0, 4, 3), 5, "1 generated tokens older than a token before them"),  # 4 4 3 5: the 3
        ((3, 2, 0), 5, "1 generated tokens with a version below 1"),
    ],
)
def test_impossible_versions_are_refused_with_what_is_wrong(edit, learner, needle):
    bad = VERSION_BS.clone()
    b, t, v = edit
    bad[b, t] = v
    with pytest.raises(ValueError, match="RolloutBatch.version_BS: .*" + needle):
        check_versions(bad, MASK_BS, learner)


@pytest.mark.unit
def test_staleness_filter_drops_stale_samples_and_their_whole_group():
    # max_staleness 2: only sequence 1 (a token of lag 3) is stale
    keep_B, m = staleness_filter(VERSION_BS, MASK_BS, 5, 2)
    assert keep_B.tolist() == [True, False, True, True]
    assert float(m["rollout/dropped_stale"].value) == 1.0 and _mean(m["rollout/dropped_stale_frac"]) == 0.25
    # with groups its group-mate 0 goes too
    keep_B, m = staleness_filter(VERSION_BS, MASK_BS, 5, 2, GROUP_B)
    assert keep_B.tolist() == [False, False, True, True]
    assert float(m["rollout/dropped_stale"].value) == 2.0 and _mean(m["rollout/dropped_stale_frac"]) == 0.5
    # max_staleness 1: sequences 1 and 3 are stale, so both groups go
    keep_B, m = staleness_filter(VERSION_BS, MASK_BS, 5, 1, GROUP_B)
    assert keep_B.tolist() == [False, False, False, False] and float(m["rollout/dropped_stale"].value) == 4.0
    # max_staleness 3: nothing; 0: everything with any lag (sequence 2 alone is fresh)
    assert staleness_filter(VERSION_BS, MASK_BS, 5, 3, GROUP_B)[0].all()
    assert staleness_filter(VERSION_BS, MASK_BS, 5, 0)[0].tolist() == [False, False, True, False]
    # group ids need not be contiguous or sorted
    keep_B, _ = staleness_filter(VERSION_BS, MASK_BS, 5, 2, torch.tensor([7, 3, 3, 7]))
    assert keep_B.tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        staleness_filter(VERSION_BS, MASK_BS, 5, -1)


@pytest.mark.unit
def test_whole_group_drop_keeps_the_advantages_of_the_samples_kept():
    # GRPO normalises per group: the kept groups' advantages are the full batch's, exactly
    rewards_B = torch.tensor([1.0, 0.0, 0.25, 0.75])
    full_BS, _ = grpo(rewards_B, GROUP_B, MASK_BS)
    keep_B, _ = staleness_filter(VERSION_BS, MASK_BS, 5, 2, GROUP_B)
    kept_BS, _ = grpo(rewards_B[keep_B], GROUP_B[keep_B], MASK_BS[keep_B])
    assert torch.equal(kept_BS, full_BS[keep_B])
    # dropping the stale sample alone would leave sequence 0 a group of one: advantage 0, not +0.71
    alone_BS, _ = grpo(rewards_B[[0, 2, 3]], GROUP_B[[0, 2, 3]], MASK_BS[[0, 2, 3]])
    assert alone_BS[0].abs().max() == 0 and full_BS[0, 2] == pytest.approx(1 / math.sqrt(2), abs=1e-5)


@pytest.mark.unit
def test_lag_histogram_mean_and_max():
    m = lag_metrics(LAG_BS, MASK_BS, 4)
    # 13 generated tokens: lag 0 on 2 + 1 + 4, lag 1 on 2, lag 2 on 1 + 2, lag 3 on 1
    assert [_mean(m[f"rollout/lag_frac/{k}"]) for k in range(4)] == pytest.approx(
        [7 / 13, 2 / 13, 3 / 13, 1 / 13]
    )
    assert _mean(m["rollout/lag_mean"]) == pytest.approx(11 / 13) and float(m["rollout/lag_max"].value) == 3.0
    # an update inside the response: sequences 0 (lags 1 1 0 0) and 1 (3 2 0); 2 and 3 one version
    assert float(m["rollout/mixed_version_seqs"].value) == 2.0
    assert _mean(m["rollout/mixed_version_frac"]) == 0.5
    assert sorted(m) == sorted(
        [f"rollout/lag_frac/{k}" for k in range(4)]
        + ["rollout/lag_mean", "rollout/lag_max", "rollout/mixed_version_seqs", "rollout/mixed_version_frac"]
    )
    # no versions: lag 0 only
    m0 = lag_metrics(torch.zeros_like(LAG_BS), MASK_BS, 1)
    assert _mean(m0["rollout/lag_frac/0"]) == 1.0 and _mean(m0["rollout/lag_mean"]) == 0.0
    assert float(m0["rollout/mixed_version_seqs"].value) == 0.0
    # lags outside the response never count, whatever they hold
    off = lag_metrics(LAG_BS + ~MASK_BS * 9, MASK_BS, 4)
    assert _mean(off["rollout/lag_mean"]) == pytest.approx(11 / 13)
    assert float(off["rollout/mixed_version_seqs"].value) == 2.0
    with pytest.raises(IndexError):  # num_lags must exceed every lag
        lag_metrics(LAG_BS, MASK_BS, 3)


@pytest.mark.unit
def test_k3_by_lag_is_the_k3_of_each_lags_tokens():
    rollout_BS = torch.full((4, 6), -1.0, dtype=torch.float64)  # float64: the d's below exactly
    d_BS = torch.zeros(4, 6, dtype=torch.float64)
    d_BS[0, 2:4] = torch.tensor([0.1, 0.3], dtype=torch.float64)  # lag 1
    d_BS[1, 2:5] = torch.tensor([0.5, -0.2, 0.0], dtype=torch.float64)  # lags 3 2 0
    d_BS[3, 2:4] = torch.tensor([0.4, 0.4], dtype=torch.float64)  # lag 2
    d_BS[~MASK_BS] = 50.0  # off the mask: never counted
    m = k3_by_lag(rollout_BS + d_BS, rollout_BS, LAG_BS, MASK_BS, 4)

    def k3(d):
        return math.exp(d) - 1 - d

    assert _mean(m["mismatch/k3_lag0"]) == pytest.approx(0.0, abs=1e-15)
    assert _mean(m["mismatch/k3_lag1"]) == pytest.approx((k3(0.1) + k3(0.3)) / 2, rel=1e-12)
    assert _mean(m["mismatch/k3_lag2"]) == pytest.approx((k3(-0.2) + 2 * k3(0.4)) / 3, rel=1e-12)
    assert _mean(m["mismatch/k3_lag3"]) == pytest.approx(k3(0.5), rel=1e-12)
    # lags outside the response never count, whatever they hold
    junk = k3_by_lag(rollout_BS + d_BS, rollout_BS, LAG_BS + ~MASK_BS * 9, MASK_BS, 4)
    assert all(float(junk[k].sum) == float(m[k].sum) and float(junk[k].count) == float(m[k].count) for k in m)
    # with one lag it is corr/k3_kl, the same sum over the same tokens
    one = k3_by_lag(rollout_BS + d_BS, rollout_BS, torch.zeros_like(LAG_BS), MASK_BS, 1)["mismatch/k3_lag0"]
    ref = offpolicy_metrics(rollout_BS + d_BS, rollout_BS, MASK_BS)["corr/k3_kl"]
    assert (float(one.sum), float(one.count)) == (float(ref.sum), float(ref.count))
    # a lag no token has: 0 / 0 (NaN once reduced)
    empty = k3_by_lag(rollout_BS, rollout_BS, torch.zeros_like(LAG_BS), MASK_BS, 2)["mismatch/k3_lag1"]
    assert (float(empty.sum), float(empty.count)) == (0.0, 0.0)


@pytest.mark.unit
def test_lag_and_k3_by_turn_count_each_assistant_turns_sampled_tokens():
    # two conversations: prompt (turn 0), turn 1, a tool reply (turn 1, not sampled), turn 2; an
    # update landed between the turns of row 0 (lag 1 then 0) and inside turn 2 of row 1
    mask_BS = torch.tensor([[0, 1, 1, 0, 0, 1, 1], [0, 0, 1, 0, 1, 1, 1]], dtype=torch.bool)
    turn_BS = torch.tensor([[0, 1, 1, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2, 2]])
    lag_BS = torch.tensor([[0, 1, 1, 7, 7, 0, 0], [0, 0, 2, 9, 1, 1, 0]])  # off the mask: ignored
    rollout_BS = torch.full((2, 7), -1.0, dtype=torch.float64)
    d_BS = torch.tensor([[9, 0.1, 0.2, 9, 9, 0.3, 0.0], [9, 9, 0.5, 9, -0.4, 0.0, 0.2]], dtype=torch.float64)
    m = lag_k3_by_turn(rollout_BS + d_BS, rollout_BS, lag_BS, turn_BS, mask_BS, 3)

    def k3(d):
        return math.exp(d) - 1 - d

    assert sorted(m) == [f"agent/{k}/turn{t}" for k in ("k3", "lag_mean") for t in (1, 2, 3)]
    assert _mean(m["agent/lag_mean/turn1"]) == pytest.approx((1 + 1 + 2) / 3)
    assert _mean(m["agent/lag_mean/turn2"]) == pytest.approx((0 + 0 + 1 + 1 + 0) / 5)
    assert _mean(m["agent/k3/turn1"]) == pytest.approx((k3(0.1) + k3(0.2) + k3(0.5)) / 3, rel=1e-12)
    assert _mean(m["agent/k3/turn2"]) == pytest.approx((k3(0.3) + k3(-0.4) + k3(0.2)) / 5, rel=1e-12)
    assert (float(m["agent/k3/turn3"].sum), float(m["agent/k3/turn3"].count)) == (
        0.0,
        0.0,
    )  # NaN once reduced


@pytest.mark.unit
def test_route_row_t_carries_the_lag_of_token_t_plus_1_and_prompt_rows_the_prefills():
    seq_lens_B = PROMPT_B + RESP_B  # 6, 5, 6, 4: rows 0 .. T - 2
    out = route_lag_BS(LAG_BS, PROMPT_B, seq_lens_B)
    assert out.tolist() == [
        [1, 1, 1, 0, 0, 0],  # rows 0, 1 (prompt, the prefill made token 2), row 2 -> token 3, ...
        [3, 3, 2, 0, 0, 0],  # T = 5: rows 0 .. 3
        [0, 0, 0, 0, 0, 0],
        [2, 2, 2, 0, 0, 0],  # T = 4: rows 0 .. 2
    ]
    # a longer prompt: its rows all carry the first response token's lag
    lag = torch.tensor([[0, 0, 0, 4, 1, 0]])
    assert route_lag_BS(lag, torch.tensor([3]), torch.tensor([5])).tolist() == [[4, 4, 4, 1, 0, 0]]


@pytest.mark.unit
def test_sum_by_lag():
    out = sum_by_lag(torch.tensor([1.0, 2.0, 4.0, 8.0]), torch.tensor([0, 2, 0, 2]), 4)
    assert out.dtype == torch.float64 and out.tolist() == [5.0, 0.0, 10.0, 0.0]


def _batch() -> RolloutBatch:
    tokens_BS = torch.where(MASK_BS | (POS_S < 2), POS_S + 10 * torch.arange(4)[:, None], 0)
    routes = [torch.full((int(t) - 1, 2, 2), b, dtype=torch.uint8) for b, t in enumerate(PROMPT_B + RESP_B)]
    return RolloutBatch(
        tokens_BS,
        PROMPT_B.clone(),
        RESP_B.clone(),
        MASK_BS.clone(),
        torch.where(MASK_BS, -0.5, 0.0),
        routes,
        GROUP_B.clone(),
        torch.tensor([True, False, True, True]),
        dist_logp_BSV=torch.arange(4 * 6 * 3, dtype=torch.float32).view(4, 6, 3),
        safe_BSV=torch.arange(4 * 6 * 3).view(4, 6, 3) % 2 == 0,
        version_BS=VERSION_BS.clone(),
    )


@pytest.mark.unit
@pytest.mark.parametrize("index", [torch.tensor([False, False, True, True]), torch.tensor([3, 2])])
def test_select_takes_every_field_and_the_route_records(index):
    batch = _batch()
    out = batch.select(index)
    rows = [2, 3] if index.dtype == torch.bool else [3, 2]
    for name in (
        "tokens_BS",
        "prompt_lens_B",
        "response_lens_B",
        "response_mask_BS",
        "logprobs_BS",
        "group_B",
    ):
        assert torch.equal(getattr(out, name), getattr(batch, name)[rows]), name
    for name in ("finished_B", "dist_logp_BSV", "safe_BSV", "version_BS"):
        assert torch.equal(getattr(out, name), getattr(batch, name)[rows]), name
    assert [int(r[0, 0, 0]) for r in out.routes] == rows and out.num_seqs == 2
    assert out.logprob_support == batch.logprob_support
    empty = batch.select(torch.zeros(4, dtype=torch.bool))  # everything dropped: an empty batch
    assert empty.num_seqs == 0 and empty.routes == [] and empty.version_BS.shape == (0, 6)


@pytest.mark.unit
def test_with_version_sets_the_generated_tokens_and_moves_with_the_batch():
    batch = _batch()
    plain = RolloutBatch(
        *[getattr(batch, n) for n in ("tokens_BS", "prompt_lens_B", "response_lens_B")],
        batch.response_mask_BS,
        batch.logprobs_BS,
        batch.routes,
        batch.group_B,
        batch.finished_B,
    )
    assert plain.version_BS is None
    v = with_version(plain, 7)
    assert v.version_BS.dtype == torch.int32 and torch.equal(v.version_BS, torch.where(MASK_BS, 7, 0).int())
    assert with_version(batch, 7) is batch  # a batch that tracks its versions keeps them
    assert batch.to("meta").version_BS.device.type == "meta"


@pytest.mark.unit
def test_the_colocated_loop_stamps_the_version_of_the_weight_set_it_synced():
    from moe_rl.maths.versions import weight_version
    from moe_rl.pipeline.simulated_staleness import SimulatedStaleness

    assert [weight_version(u) for u in (0, 1, 5)] == [1, 2, 6]  # W_u is version u + 1; 0: no token
    # step t's rollout: W_max(0, t-k); the learner holds W_t (version t + 1)
    assert [SimulatedStaleness(1).engine_version(t) for t in range(4)] == [1, 1, 2, 3]
    assert [SimulatedStaleness(0).engine_version(t) for t in range(3)] == [1, 2, 3]
    # the built-in engine's own counter (it counts loads) is replaced by the synced set's version
    batch, m = SimulatedStaleness(2).versioned(_batch(), 3)
    assert torch.equal(batch.version_BS, torch.where(MASK_BS, 2, 0).int()) and "rollout/policy_lag" in m
    lags = lag_BS(batch.version_BS, MASK_BS, weight_version(3))
    assert torch.equal(lags, torch.where(MASK_BS, 2, 0))  # k = 2 updates behind


@pytest.mark.unit
def test_route_row_turn_is_the_turn_whose_engine_call_fed_the_token():
    # prompt p p | turn 1: a a (sampled) r r (reply) | turn 2: b b b | pad; and a short one
    turn_BS = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2, 2, 0], [0, 0, 0, 1, 1, 1, 2, 2, 0, 0]])
    mask_BS = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    out = route_turn_BS(turn_BS, mask_BS, torch.tensor([9, 8]))
    # rows 0-1 (prompt): turn 1's prefill; row 2 (a, then a): turn 1's decode; row 3 (the last a)
    # and rows 4-5 (the reply): turn 2's prefill; rows 6-7: turn 2's decode; the last token: no row
    assert out.tolist() == [[1, 1, 1, 2, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 2, 2, 2, 0, 0, 0]]
    # a turn followed by the next turn's tokens with no reply between: still the next call's
    t2 = torch.tensor([[0, 1, 1, 2, 2]])
    m2 = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.bool)
    assert route_turn_BS(t2, m2, torch.tensor([5])).tolist() == [[1, 1, 2, 2, 0]]
