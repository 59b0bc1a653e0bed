"""unit tier: moe_rl/step/drift.py, run from the plan moe_rl/step/plan.py resolves from
correction.*: masks, weights and the loss."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.step import drift
from moe_rl.step.plan import StepPlan
from moe_rl.types import TokenStats, TrainBatch


def _plan(preset: str | None = None, *overrides: str) -> StepPlan:
    return StepPlan.from_config(load_config(preset, list(overrides)))


def _batch():
    # 3 sequences x 4 tokens; sequence 1 drifted (rho = e^0.5 per token), the others did not
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    rollout = torch.full((3, 4), -1.0)
    old = rollout.clone()
    old[1] += 0.5
    return mask, rollout, old


def _train_batch(mask, rollout, adv, **fields):
    B, S = mask.shape
    return TrainBatch(
        torch.zeros(B, S, dtype=torch.int64),
        torch.full((B,), S),
        loss_mask_BS=mask,
        rollout_logp_BS=rollout,
        advantages_BS=adv,
        **fields,
    )


def _stats(logp):
    return TokenStats(logp, torch.zeros_like(logp), torch.zeros_like(logp))


@pytest.mark.unit
def test_default_config_keeps_everything_and_has_no_weights():
    plan = _plan()
    mask, rollout, old = _batch()
    corr, metrics = drift.drift_tensors(plan.correction, old, rollout, mask, None)
    assert torch.equal(corr.keep_BS, mask) and corr.is_weights_BS is None and metrics == {}


@pytest.mark.unit
def test_seq_mis_weights_and_rejects_the_drifted_sequence():
    plan = _plan("configs/corrections/seq_mis.yaml")
    mask, rollout, old = _batch()
    corr, metrics = drift.drift_tensors(plan.correction, old, rollout, mask, None)
    # sum_t log rho of sequence 1 = 1.0 > log 2: rejected; the others (log rho = 0) kept
    assert corr.keep_BS.any(-1).tolist() == [True, False, True]
    w = corr.is_weights_BS
    assert w[1, 1].item() == pytest.approx(2.0)  # e^1.0 truncated at is_clip = 2
    assert w[0, 1].item() == pytest.approx(1.0) and not w.requires_grad
    assert float(
        metrics["corr/rs_seq_masked_fraction"].sum / metrics["corr/rs_seq_masked_fraction"].count
    ) == pytest.approx(1 / 3)


@pytest.mark.unit
def test_trm_against_old_masks_whole_sequences_and_keeps_the_normaliser():
    plan = _plan(None, "correction.trm.max=0.05")
    mask, rollout, old = _batch()
    corr, _ = drift.drift_tensors(plan.correction, old, rollout, mask, None)
    assert corr.keep_BS.any(-1).tolist() == [True, False, True]  # k2 = 0.125 > 0.05 in sequence 1
    loss = plan.loss
    adv = torch.ones(3, 4)
    logp = old.clone().requires_grad_(True)
    mb = _train_batch(
        mask, rollout, adv, old_logp_BS=old, keep_BS=corr.keep_BS, is_weights_BS=corr.is_weights_BS
    )
    value, _ = loss(mb, _stats(logp), mask.sum().float())
    # ratio 1 everywhere: loss = -sum over KEPT tokens of A / (ALL loss tokens): 6 / 8
    assert value.item() == pytest.approx(-6 / 8)
    value.backward()
    assert logp.grad[1].abs().sum() == 0 and logp.grad[0, 1].item() == pytest.approx(-1 / 8)


@pytest.mark.unit
def test_bypass_reinforce_gradient_is_weighted_score_function():
    mask, rollout, old = _batch()
    loss = _plan("configs/corrections/bypass_reinforce.yaml").loss
    logp = old.clone().requires_grad_(True)
    adv = torch.ones(3, 4)
    value, _ = loss(_train_batch(mask, rollout, adv), _stats(logp), 8.0)
    value.backward()
    # w = min(exp(sum_t log rho), 2): 1 for sequences 0 and 2, min(e^1, 2) = 2 for sequence 1
    assert logp.grad[0, 1].item() == pytest.approx(-1 / 8)
    assert logp.grad[1, 1].item() == pytest.approx(-min(math.e, 2.0) / 8)


@pytest.mark.unit
def test_learner_refuses_a_log_prob_support_mismatch():
    from moe_rl.types import RolloutBatch

    plan = _plan(None, "correction.dvp_threshold=0.05")
    assert plan.support == "dvp:relative:0.05"  # the engine's sampling params say so
    z = torch.zeros(1, 3)
    batch = RolloutBatch(
        z.long(),
        torch.ones(1).long(),
        torch.ones(1).long(),
        z.bool(),
        z,
        [],
        torch.zeros(1).long(),
        torch.ones(1).bool(),
        logprob_support="full",
    )
    with pytest.raises(
        ValueError, match="support 'full' but the learner computes them over 'dvp:relative:0.05'"
    ):
        drift.token_inputs(plan.correction, plan.support, batch)
    batch.logprob_support = "dvp:relative:0.05"
    with pytest.raises(ValueError, match="returned no safe sets"):
        drift.token_inputs(plan.correction, plan.support, batch)


@pytest.mark.unit
def test_batch_normalised_sequence_weights_are_divided_by_their_mean_over_sequences():
    plan = _plan(None, "correction.is_level=sequence", "correction.is_batch_normalize=true")
    mask, rollout, old = _batch()
    corr, metrics = drift.drift_tensors(plan.correction, old, rollout, mask, None)
    # rho(y) = 1, min(e^1.0, 2) = 2, 1: the mean over sequences is 4/3, not the token mean 5/4
    w = corr.is_weights_BS
    assert [w[b, 1].item() for b in range(3)] == pytest.approx([0.75, 1.5, 0.75])
    assert float(metrics["corr/is_batch_norm_factor"]) == pytest.approx(4 / 3)
