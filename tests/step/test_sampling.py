"""Dynamic sampling (moe_rl/step/sampling.py): the all-equal filter, the rounds, the top-up at the
cap, the batch assembly, and the filter key (the verifier's accuracy, never the shaped reward by
default)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.config.dynamic_sampling import DynamicSamplingConfig
from moe_rl.maths.advantages import estimate_advantages
from moe_rl.maths.policy_specs import AdvantageSpec
from moe_rl.metrics import Sum, reduce_metrics
from moe_rl.routing.provenance import Provenance
from moe_rl.step.sampling import collect, concat_batches, groups_with_signal
from moe_rl.tasks.task import StepScores, step_scores
from moe_rl.types import RolloutBatch

pytestmark = pytest.mark.unit

N = 4  # samples per prompt


def rollout(num_prompts: int, length: int, first_token: int) -> RolloutBatch:
    """``num_prompts`` x N sequences of a 2-token prompt and ``length - 2`` response tokens; token
    values count up from ``first_token`` so every sequence is told apart."""
    b = num_prompts * N
    tokens_BS = torch.arange(first_token, first_token + b * length).view(b, length)
    mask_BS = torch.zeros(b, length, dtype=torch.bool)
    mask_BS[:, 2:] = True
    return RolloutBatch(
        tokens_BS=tokens_BS,
        prompt_lens_B=torch.full((b,), 2),
        response_lens_B=torch.full((b,), length - 2),
        response_mask_BS=mask_BS,
        logprobs_BS=-mask_BS.float(),
        routes=[torch.full((length - 1, 1, 2), i, dtype=torch.uint8) for i in range(b)],
        group_B=torch.arange(num_prompts).repeat_interleave(N),
        finished_B=torch.ones(b, dtype=torch.bool),
    )


def test_a_group_carries_signal_iff_its_values_differ():
    values_B = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.5, 0.5, 0, 0, 0, 1e-7])
    group_B = torch.arange(4).repeat_interleave(4)
    assert groups_with_signal(values_B, group_B, 4).tolist() == [False, True, False, True]
    # a group id with no samples has no signal; ids need not be sorted
    assert groups_with_signal(torch.tensor([0.0, 1.0]), torch.tensor([2, 2]), 3).tolist() == [
        False,
        False,
        True,
    ]


def test_concat_pads_each_field_and_renumbers_groups():
    a, b = rollout(1, 5, 0), rollout(2, 7, 100)
    out = concat_batches([a, b], pad_id=-1)
    assert out.tokens_BS.shape == (12, 7)
    assert out.tokens_BS[:4, 5:].eq(-1).all() and out.tokens_BS[:4, :5].equal(a.tokens_BS)
    assert not out.response_mask_BS[:4, 5:].any() and out.logprobs_BS[:4, 5:].eq(0).all()
    assert out.group_B.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert [int(r[0, 0, 0]) for r in out.routes] == list(range(4)) + list(range(8))
    # the route rows' provenance goes with its routes, sample for sample (else ingest refuses the batch)
    assert out.route_prov is None  # none given
    a, b = (
        dataclasses.replace(
            x, route_prov=[Provenance.computed(torch.full((r.shape[0],), v)) for r in x.routes]
        )
        for x, v in ((a, 1), (b, 2))
    )
    out = concat_batches([a, b], pad_id=-1)
    assert [(p.num_rows, int(p.version_N[0])) for p in out.route_prov] == [(4, 1)] * 4 + [(6, 2)] * 8


def scores_of(acc_P: list[list[float]], penalty: float = 0.0) -> StepScores:
    """Per-prompt accuracy lists -> StepScores; the shaped reward adds ``penalty * j`` to sample j
    (an overlong penalty that differs within every group)."""
    acc_B = torch.tensor([x for row in acc_P for x in row])
    shaped_B = acc_B + penalty * torch.arange(N).repeat(len(acc_P))
    m = {"reward/mean": 0.5}  # a plain number: merged as is
    return StepScores(shaped_B, acc_B, None, m)


# per data-cursor index: 4 groups' accuracies (1 = solved); G = a group with signal
ROUNDS = {
    10: [[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]],  # groups 1, 3 carry signal
    11: [[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]],  # group 2
    12: [[0, 1, 1, 1], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]],  # groups 0, 1, 2
    13: [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
}


def run(ds: DynamicSamplingConfig, rounds=ROUNDS, penalty=0.0):
    drawn = []

    def generate(index):
        drawn.append(index)
        return [f"p{index}.{g}" for g in range(4)], rollout(4, 6, 1000 * index)

    def score(prompts, batch):
        return scores_of(rounds[int(prompts[0][1:3])], penalty)

    got = collect(ds, generate, score, cursor=10, pad_id=-1)
    m = reduce_metrics(got.metrics)
    return got, drawn, m


def test_rounds_go_on_until_the_step_has_its_groups_with_signal():
    got, drawn, m = run(DynamicSamplingConfig(enabled=True, max_rounds=4))
    assert drawn == [10, 11, 12] and got.rounds == 3  # the cursor advances by 3
    # no group of the trained batch has all-zero advantages, for every group estimator
    assert group_advantage_peaks(got).gt(0.1).all()
    # the first 4 groups with signal, in generation order; the surplus (12.2) is not trained
    assert got.prompts == ["p10.1", "p10.3", "p11.2", "p12.0"]
    assert got.batch.group_B.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert got.batch.tokens_BS[:, 0].tolist() == [10000 + 6 * b for b in (4, 5, 6, 7, 12, 13, 14, 15)] + [
        11000 + 6 * b for b in (8, 9, 10, 11)
    ] + [12000 + 6 * b for b in (0, 1, 2, 3)]
    assert got.scores.accuracy_B.view(4, N).tolist() == [
        ROUNDS[10][1],
        ROUNDS[10][3],
        ROUNDS[11][2],
        ROUNDS[12][0],
    ]
    assert (m["sampling/rounds"], m["sampling/groups_generated"], m["sampling/groups_kept"]) == (3, 12, 4)
    assert m["sampling/groups_dropped_all_equal"] == 6 and m["sampling/useful_frac"] == 6 / 12
    assert m["sampling/cap_reached"] == 0 and m["sampling/response_tokens_generated"] == 3 * 16 * 4


ESTIMATORS = ("grpo", "rloo", "otb", "otb_multiturn")


def group_advantage_peaks(got) -> torch.Tensor:
    """[estimator, group]: the largest |advantage| of each trained group, by each group estimator
    (GRPO, RLOO, the Optimal Token Baseline and its multi-turn form) on the collected batch."""
    b = got.batch
    extra = {"logp_BS": b.logprobs_BS, "sum_pi_sq_BS": torch.full(b.logprobs_BS.shape, 0.5)}
    peaks = []
    for name in ESTIMATORS:
        adv_BS, _ = estimate_advantages(
            AdvantageSpec(name, True), got.scores.rewards_B, b.group_B, b.response_mask_BS, extra
        )
        peaks.append(adv_BS.abs().view(-1, N * b.tokens_BS.shape[1]).amax(dim=1))
    return torch.stack(peaks)


def test_at_the_cap_the_step_trains_what_it_has_topped_up_and_says_so():
    got, drawn, m = run(DynamicSamplingConfig(enabled=True, max_rounds=2))
    assert drawn == [10, 11] and got.rounds == 2
    # each estimator: the 3 groups with signal train, the topped-up one's advantages are ~0 (OTB's
    # are r * eps / (W + eps), not an exact 0: docs/math.md 6.2)
    peaks = group_advantage_peaks(got)
    assert peaks[:, :3].gt(0.1).all() and peaks[:, 3].lt(1e-6).all()
    # 3 groups with signal, then the first dropped ones to the step's 4 groups
    assert got.prompts == ["p10.1", "p10.3", "p11.2", "p10.0"]
    assert (m["sampling/groups_kept"], m["sampling/cap_reached"], m["sampling/useful_frac"]) == (3, 1, 3 / 8)


def test_off_one_round_trained_whole_and_counted():
    got, drawn, m = run(DynamicSamplingConfig(enabled=False, max_rounds=4))
    assert drawn == [10] and got.rounds == 1 and got.prompts == [f"p10.{g}" for g in range(4)]
    assert (m["sampling/groups_kept"], m["sampling/groups_dropped_all_equal"], m["sampling/cap_reached"]) == (
        2,
        2,
        0,
    )


def test_the_filter_reads_accuracy_not_the_shaped_reward():
    """A length penalty that differs inside each group makes every group's shaped reward unequal:
    filtered on it (filter=reward, the verl-recipe #125 trap) nothing is dropped; on accuracy the
    all-solved and all-failed groups are."""
    _, drawn, m = run(DynamicSamplingConfig(enabled=True), penalty=-0.01)
    assert drawn == [10, 11, 12] and m["sampling/groups_dropped_all_equal"] == 6
    _, drawn, m = run(DynamicSamplingConfig(enabled=True, filter="reward"), penalty=-0.01)
    assert drawn == [10] and m["sampling/groups_dropped_all_equal"] == 0


def test_multi_turn_rounds_filter_on_the_environments_reward_and_keep_their_columns():
    """agent.env (moe_rl/agentic/loop.py): the environment's reward (``env_reward_B``, scored by
    the real ``step_scores``) decides the groups; the turn column, per-token versions and the
    route rows' provenance follow their sequences; the loop's own counts cover every round once."""
    cfg = load_config(None, [f"rollout.samples_per_prompt={N}"])
    env = {20: ROUNDS[10], 21: ROUNDS[13], 22: ROUNDS[11], 23: ROUNDS[12]}  # 21: no group with signal

    def generate(index):
        b = rollout(4, 6, 1000 * index)
        turn_BS = torch.zeros_like(b.tokens_BS, dtype=torch.int16)
        turn_BS[:, 2:] = 1 + index % 2  # the response: turn 1 (even index) or 2
        return [SimpleNamespace(task="calc", index=index)] * 4, dataclasses.replace(
            b,
            env_reward_B=torch.tensor(env[index]).flatten().float(),
            turn_BS=turn_BS,
            version_BS=b.response_mask_BS.int() * (index - 19),  # W_index-20: version index - 19
            route_prov=[Provenance.computed(torch.full((r.shape[0],), index)) for r in b.routes],
            engine_metrics={"agent/tool_calls": Sum(float(index))},
        )

    got = collect(
        DynamicSamplingConfig(enabled=True), generate, lambda p, b: step_scores(cfg, None, p, b), 20, -1
    )
    m = reduce_metrics(got.metrics)
    assert got.rounds == 4 and m["sampling/groups_dropped_all_equal"] == 2 + 4 + 3 + 1
    index_B = got.batch.tokens_BS[:, 0] // 1000  # the round each trained sequence came from
    assert index_B.tolist() == [20] * 8 + [22] * 4 + [23] * 4
    assert got.scores.accuracy_B.equal(got.batch.env_reward_B)
    assert got.batch.turn_BS[:, 2:].eq((1 + index_B % 2)[:, None]).all()
    assert got.batch.version_BS[:, 2:].eq((index_B - 19)[:, None]).all()
    assert [int(p.version_N[0]) for p in got.batch.route_prov] == index_B.tolist()
    assert reduce_metrics(got.batch.engine_metrics)["agent/tool_calls"] == 20 + 21 + 22 + 23
