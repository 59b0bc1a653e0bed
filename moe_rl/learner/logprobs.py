"""Per-token log-probs and entropy from logits: pure tensor math (no collectives).

Shape suffixes: B sequences, S positions, V vocabulary.
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

    Vocabulary-parallel logits (each tensor-parallel rank holds a V/TP slice) are the caller's job,
    with sums over the local shard then an all-reduce over the TP group:
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
