"""Per-token log-probs and entropy from logits: pure tensor math, and its vocab-parallel forms
(each tensor-parallel rank holds a V / TP slice of the logits; the only collectives are [B, S]-sized
all-reduces over the group given): ``token_logprobs_energy_vocab_parallel`` (log-prob, entropy,
sum pi^2), ``restricted_logprobs_vocab_parallel`` (DVP, ``corrections.dvp.restricted_logprobs``)
and ``exact_kl_tokens_vocab_parallel`` (exact-KL TRM, ``corrections.trm.exact_kl_tokens``).

Shape suffixes: B sequences, S positions, V vocabulary (or the rank's vocabulary slice).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from moe_rl.corrections.dvp import RestrictedLogprobs
from moe_rl.corrections.trm import chunked_kl


def token_logprobs(
    logits_BSV: torch.Tensor, tokens_BS: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of each token given its prefix, under softmax(logits / temperature).

    Args:
        logits_BSV: logits at every position; position t predicts token t + 1.
        tokens_BS: the token ids the logits were computed on.
    Returns:
        logp_BS: logp_BS[b, t] = log p(tokens[b, t] | tokens[b, :t]); column 0 is 0.
        entropy_BS: entropy of the distribution that produced tokens[b, t]; column 0 is 0.
    """
    logp_BSV = torch.log_softmax(logits_BSV[:, :-1].float() / temperature, dim=-1)
    target_BS = tokens_BS[:, 1:].unsqueeze(-1)
    logp_BS = logp_BSV.gather(-1, target_BS).squeeze(-1)
    entropy_BS = -(logp_BSV.exp() * logp_BSV).sum(-1)
    pad = logp_BS.new_zeros((logp_BS.shape[0], 1))
    return torch.cat([pad, logp_BS], 1), torch.cat([pad, entropy_BS], 1)


def token_logprobs_energy(
    logits_BSV: torch.Tensor, tokens_BS: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs`` plus sum_v pi(v)^2 per token (the OTB energy input, docs/math.md 6.2).

    Same shift convention as ``token_logprobs``: column t describes the distribution
    pi_t = softmax(logits[:, t - 1] / temperature) that produced tokens[:, t]; column 0 is 0.
    Everything comes from one log_softmax tensor logp_BSV and its exp pi_BSV (the two [B, S, V]
    intermediates ``token_logprobs`` holds too); entropy and sum_v pi^2 are batched dot products
    over V (a [.., 1, V] @ [.., V, 1] matmul), so no further [B, S, V] temporary is made. No
    backward is needed: this is a forward-only quantity. Float64 logits stay float64 (tests);
    anything narrower is computed in float32.

    The energy of token t (docs/math.md 6.2, 6.3 step 3) is
        w_t = 1 - 2 pi_t(y_t) + sum_v pi_t(v)^2 = || e_{y_t} - pi_t ||^2
            = || d log pi_t(y_t) / d z_t ||^2,   z_t = logits_t / temperature,
    i.e. temperature^2 * || d log pi_t(y_t) / d logits_t ||^2 (the chain rule through the scaling).

    Vocabulary-parallel logits (each tensor-parallel rank holds a V/TP slice) go through
    ``token_logprobs_energy_vocab_parallel``: sums over the local shard, then an all-reduce over
    the TP group:
        logZ       = log all_reduce_sum(sum_local exp(z - max)) + max   (max: all_reduce_max)
        log pi(y)  = all_reduce_sum(z_y - logZ on the rank owning y, 0 elsewhere)
        sum pi^2   = all_reduce_sum(sum_local exp(2 (z - logZ)))
        entropy    = all_reduce_sum(-sum_local pi * (z - logZ))
    which is this function's math on each shard (megatron's vocab-parallel cross entropy already
    does the first two).

    Args:
        logits_BSV: logits at every position; position t predicts token t + 1.
        tokens_BS: the token ids the logits were computed on.
    Returns:
        logp_BS, entropy_BS: as ``token_logprobs``.
        sum_pi_sq_BS: sum_v pi_t(v)^2 of the distribution that produced tokens[b, t]; column 0 is 0.
    """
    dtype = torch.promote_types(logits_BSV.dtype, torch.float32)
    logp_BSV = torch.log_softmax(logits_BSV[:, :-1].to(dtype) / temperature, dim=-1)
    logp_BS = logp_BSV.gather(-1, tokens_BS[:, 1:].unsqueeze(-1)).squeeze(-1)
    pi_BS1V = logp_BSV.exp().unsqueeze(-2)
    entropy_BS = -(pi_BS1V @ logp_BSV.unsqueeze(-1)).reshape(logp_BS.shape)
    sum_pi_sq_BS = (pi_BS1V @ pi_BS1V.transpose(-1, -2)).reshape(logp_BS.shape)
    pad = logp_BS.new_zeros((logp_BS.shape[0], 1))
    return (torch.cat([pad, logp_BS], 1), torch.cat([pad, entropy_BS], 1), torch.cat([pad, sum_pi_sq_BS], 1))


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` in the forward and in the backward (a value every rank's terms use)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def token_logprobs_energy_vocab_parallel(
    logits_BSV: torch.Tensor, tokens_BS: torch.Tensor, temperature: float, vocab_start: int, group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs_energy`` when ``logits_BSV`` is this rank's vocabulary slice
    [vocab_start, vocab_start + V) of megatron's vocab-parallel output layer.

    Three collectives over ``group``: the max (no gradient: logsumexp does not depend on it), the
    partition sum, then (target log-prob, entropy, sum pi^2) stacked in one all-reduce.
    Gradients: the outputs are identical on every rank and so is the loss built from them, so
    the last all-reduce passes its gradient through unchanged (megatron's
    reduce_from_tensor_model_parallel_region); the partition sum feeds every rank's local terms,
    so its gradient is all-reduced too (``_AllReduceSum``), else each rank would miss the other
    slices' dependence on it.
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
    )

    dtype = torch.promote_types(logits_BSV.dtype, torch.float32)
    z_BSV = logits_BSV[:, :-1].to(dtype) / temperature
    max_BS1 = z_BSV.detach().amax(-1, keepdim=True)
    dist.all_reduce(max_BS1, op=dist.ReduceOp.MAX, group=group)
    shifted_BSV = z_BSV - max_BS1
    sum_exp_BS = _AllReduceSum.apply(shifted_BSV.exp().sum(-1), group)
    logp_BSV = shifted_BSV - sum_exp_BS.log().unsqueeze(-1)  # globally normalised, local columns
    target_BS = tokens_BS[:, 1:] - vocab_start
    owned_BS = (target_BS >= 0) & (target_BS < logp_BSV.shape[-1])
    picked_BS = logp_BSV.gather(-1, target_BS.clamp(0, logp_BSV.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    pi_BS1V = logp_BSV.exp().unsqueeze(-2)
    local_XBS = torch.stack(
        [
            torch.where(owned_BS, picked_BS, torch.zeros_like(picked_BS)),
            -(pi_BS1V @ logp_BSV.unsqueeze(-1)).reshape(picked_BS.shape),
            (pi_BS1V @ pi_BS1V.transpose(-1, -2)).reshape(picked_BS.shape),
        ]
    )
    logp_BS, entropy_BS, sum_pi_sq_BS = reduce_from_tensor_model_parallel_region(local_XBS, group).unbind(0)
    pad = logp_BS.new_zeros((logp_BS.shape[0], 1))
    return (torch.cat([pad, logp_BS], 1), torch.cat([pad, entropy_BS], 1), torch.cat([pad, sum_pi_sq_BS], 1))


def _logsumexp_vocab_parallel(xs: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """logsumexp over the last dimension, split over ``group``, of each [..., V] tensor in ``xs``
    (one stacked all-reduce of the maxima, no gradient: a logsumexp does not depend on its shift;
    one of the partition sums, with ``_AllReduceSum``). -inf where every rank's entries are -inf.

    The gradient is right when the results feed each rank's LOCAL terms, summed over the group
    afterwards (as ``token_logprobs_energy_vocab_parallel`` does): a result used as is, identical
    on every rank, would have its gradient counted once per rank.
    """
    import torch.distributed as dist

    max_X = torch.stack([x.detach().amax(-1) for x in xs])
    dist.all_reduce(max_X, op=dist.ReduceOp.MAX, group=group)
    some_X = torch.isfinite(max_X)  # else no finite entry anywhere (an empty DVP safe set)
    shift_X = torch.where(some_X, max_X, torch.zeros_like(max_X))
    sum_X = _AllReduceSum.apply(
        torch.stack([(x - s.unsqueeze(-1)).exp().sum(-1) for x, s in zip(xs, shift_X)]), group
    )
    # (sum >= 1 where some_X: the max contributes exp(0); the 1 elsewhere keeps log's gradient finite)
    lse_X = torch.where(
        some_X,
        torch.where(some_X, sum_X, torch.ones_like(sum_X)).log() + shift_X,
        torch.full_like(sum_X, -math.inf),
    )
    return list(lse_X.unbind(0))


def restricted_logprobs_vocab_parallel(
    logits_BSV: torch.Tensor, safe_BSV: torch.Tensor, tokens_BS: torch.Tensor, vocab_start: int, group
) -> RestrictedLogprobs:
    """``corrections.dvp.restricted_logprobs`` when ``logits_BSV`` and ``safe_BSV`` are this
    rank's vocabulary slice [vocab_start, vocab_start + V); the same outputs on every rank.

    Three [B, S]-sized collectives over ``group``: the maxima of the logits and of the safe
    logits (no gradient), their partition sums (logZ and logZ_safe), then one all-reduce of the
    stacked per-token terms: z_y - logZ_safe and z_y - logZ from the rank owning y (0 elsewhere),
    the safe flag of y from its owner, and logZ_safe - logZ from the group's first rank only (a
    value every rank has; summed once, so its gradient is counted once). Gradients: as
    ``token_logprobs_energy_vocab_parallel`` (the last all-reduce passes its gradient through;
    the partition sums all-reduce theirs). A position whose safe set is empty on every rank gets
    log safe mass -inf; a sampled token outside the safe set log-prob -inf with zero gradient.
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
    )

    z_BSV = logits_BSV if logits_BSV.dtype in (torch.float32, torch.float64) else logits_BSV.float()
    lse_full_BS, lse_safe_BS = _logsumexp_vocab_parallel(
        [z_BSV, z_BSV.masked_fill(~safe_BSV, -math.inf)], group
    )
    target_BS = tokens_BS.long() - vocab_start
    owned_BS = (target_BS >= 0) & (target_BS < z_BSV.shape[-1])
    idx_BS1 = target_BS.clamp(0, z_BSV.shape[-1] - 1).unsqueeze(-1)
    z_y_BS = z_BSV.gather(-1, idx_BS1).squeeze(-1)
    inside_BS = owned_BS & safe_BSV.gather(-1, idx_BS1).squeeze(-1)
    zero_BS = torch.zeros_like(z_y_BS)
    first = dist.get_rank(group) == 0
    local_XBS = torch.stack(
        [
            torch.where(inside_BS, z_y_BS - lse_safe_BS, zero_BS),
            torch.where(owned_BS, z_y_BS - lse_full_BS, zero_BS),
            lse_safe_BS - lse_full_BS if first else zero_BS,
            inside_BS.to(z_y_BS.dtype),
        ]
    )
    logp_BS, full_logp_BS, log_safe_mass_BS, inside_f_BS = reduce_from_tensor_model_parallel_region(
        local_XBS, group
    ).unbind(0)
    inside_BS = inside_f_BS > 0.5
    return RestrictedLogprobs(
        torch.where(inside_BS, logp_BS, torch.full_like(logp_BS, -math.inf)),
        full_logp_BS,
        log_safe_mass_BS,
        inside_BS,
    )


@torch.no_grad()
def exact_kl_tokens_vocab_parallel(
    rollout_logits_BSV: torch.Tensor,
    train_logits_BSV: torch.Tensor,
    group,
    mask_BS: torch.Tensor | None = None,
    *,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """``corrections.trm.exact_kl_tokens`` when both inputs are this rank's vocabulary slice of the
    same columns: KL(pi_roll || pi_train) = sum over ranks of sum_local p_roll (log p_roll - log
    p_train), both log-probs normalised over the whole vocabulary. Three [tokens]-sized
    collectives per chunk of ``chunk_tokens`` masked positions (the two maxima, the two partition
    sums, the KL terms). No gradient: TRM only masks with it (``corrections.trm.trm_mask``
    detaches it). ``mask_BS`` must be the same on every rank of ``group`` (the chunks' collectives
    pair up); the result is the same on every rank.
    """
    import torch.distributed as dist

    def rows_kl(roll_NV: torch.Tensor, train_NV: torch.Tensor) -> torch.Tensor:
        lse_roll, lse_train = _logsumexp_vocab_parallel([roll_NV, train_NV], group)
        log_p, log_q = roll_NV - lse_roll.unsqueeze(-1), train_NV - lse_train.unsqueeze(-1)
        kl_N = (log_p.exp() * (log_p - log_q)).sum(-1)
        dist.all_reduce(kl_N, group=group)
        return kl_N

    return chunked_kl(rollout_logits_BSV, train_logits_BSV, mask_BS, chunk_tokens, rows_kl)
