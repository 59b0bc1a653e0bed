"""Per-token log-probs and entropy from logits: pure tensor math, and its vocab-parallel form
(``token_logprobs_energy_vocab_parallel``: each tensor-parallel rank holds a V / TP slice of the
logits; its only collectives are all-reduces over the group it is given).

Shape suffixes: B sequences, S positions, V vocabulary (or the rank's vocabulary slice).
"""

from __future__ import annotations

import torch


def token_logprobs(logits_BSV: torch.Tensor, tokens_BS: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
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


def token_logprobs_energy(logits_BSV: torch.Tensor, tokens_BS: torch.Tensor,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs`` plus sum_v pi(v)^2 per token (the OTB energy input, math.md 6.2).

    Same shift convention as ``token_logprobs``: column t describes the distribution
    pi_t = softmax(logits[:, t - 1] / temperature) that produced tokens[:, t]; column 0 is 0.
    Everything comes from one log_softmax tensor logp_BSV and its exp pi_BSV (the two [B, S, V]
    intermediates ``token_logprobs`` holds too); entropy and sum_v pi^2 are batched dot products
    over V (a [.., 1, V] @ [.., V, 1] matmul), so no further [B, S, V] temporary is made. No
    backward is needed: this is a forward-only quantity. Float64 logits stay float64 (tests);
    anything narrower is computed in float32.

    The energy of token t (math.md 6.2, 6.3 step 3) is
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
    return (torch.cat([pad, logp_BS], 1), torch.cat([pad, entropy_BS], 1),
            torch.cat([pad, sum_pi_sq_BS], 1))


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


def token_logprobs_energy_vocab_parallel(logits_BSV: torch.Tensor, tokens_BS: torch.Tensor, temperature: float,
                                         vocab_start: int, group) -> tuple[torch.Tensor, torch.Tensor,
                                                                           torch.Tensor]:
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
    local_XBS = torch.stack([torch.where(owned_BS, picked_BS, torch.zeros_like(picked_BS)),
                             -(pi_BS1V @ logp_BSV.unsqueeze(-1)).reshape(picked_BS.shape),
                             (pi_BS1V @ pi_BS1V.transpose(-1, -2)).reshape(picked_BS.shape)])
    logp_BS, entropy_BS, sum_pi_sq_BS = reduce_from_tensor_model_parallel_region(local_XBS, group).unbind(0)
    pad = logp_BS.new_zeros((logp_BS.shape[0], 1))
    return (torch.cat([pad, logp_BS], 1), torch.cat([pad, entropy_BS], 1),
            torch.cat([pad, sum_pi_sq_BS], 1))
