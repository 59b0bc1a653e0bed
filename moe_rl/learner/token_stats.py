"""What the loss and the old-log-prob pass need from a micro-batch's logits (``TokenStats``): the
per-token log-probs, entropy and sum pi^2, restricted to the engine's DVP safe sets and with the
exact per-token KL where the batch carries what they need; on the rank's vocabulary slice under
tensor parallelism (``VocabShard``: the vocab-parallel forms of ``learner/logprobs.py``).

Shape suffixes: B sequences, S positions, V vocabulary (or the rank's slice).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from moe_rl.corrections.dvp import restricted_logprobs
from moe_rl.corrections.trm import exact_kl_tokens
from moe_rl.learner.logprobs import (
    exact_kl_tokens_vocab_parallel,
    restricted_logprobs_vocab_parallel,
    token_logprobs_energy,
    token_logprobs_energy_vocab_parallel,
)
from moe_rl.types import TokenStats, TrainBatch


class VocabShard(NamedTuple):
    """This rank's slice [start, start + V / TP) of the vocab-parallel logits, and its TP group."""

    start: int
    group: Any


def token_stats(
    mb: TrainBatch, logits_BSV: torch.Tensor, temperature: float, vocab_shard: VocabShard | None = None
) -> TokenStats:
    """What the loss and the old-log-prob pass need from a micro-batch's logits.

    ``mb.safe_BSV`` (the engine's DVP safe sets) restricts log-probs to the same support the
    engine reported; ``mb.rollout_dist_BSV`` (rollout log-probs) adds the exact per-token
    KL(pi_rollout || pi_learner) that TRM's exact form uses. With ``vocab_shard`` (TP > 1)
    ``logits_BSV`` is the rank's vocabulary slice: each rank takes the same columns of the
    batch's full-vocabulary ``safe_BSV`` / ``rollout_dist_BSV`` and the vocab-parallel functions
    (``learner/logprobs.py``) all-reduce [B, S]-sized terms over the TP group."""
    if vocab_shard is None:
        logp_BS, ent_BS, spi_BS = token_logprobs_energy(logits_BSV, mb.tokens_BS, temperature)
    else:
        logp_BS, ent_BS, spi_BS = token_logprobs_energy_vocab_parallel(
            logits_BSV, mb.tokens_BS, temperature, vocab_shard.start, vocab_shard.group
        )
    if mb.safe_BSV is None and mb.rollout_dist_BSV is None:
        return TokenStats(logp_BS, ent_BS, spi_BS)
    z_BSV = logits_BSV[:, :-1].float() / temperature
    cols = (
        slice(None) if vocab_shard is None else slice(vocab_shard.start, vocab_shard.start + z_BSV.shape[-1])
    )
    pad = logp_BS.new_zeros((logp_BS.shape[0], 1))
    full_logp_BS = log_safe_mass_BS = exact_kl_BS = None
    if mb.safe_BSV is not None:
        safe_BSV = mb.safe_BSV[:, 1:, cols]
        r = (
            restricted_logprobs(z_BSV, safe_BSV, mb.tokens_BS[:, 1:])
            if vocab_shard is None
            else restricted_logprobs_vocab_parallel(z_BSV, safe_BSV, mb.tokens_BS[:, 1:], *vocab_shard)
        )
        full_logp_BS, log_safe_mass_BS = logp_BS, torch.cat([pad, r.log_safe_mass_BS], 1)
        logp_BS = torch.cat([pad, torch.where(r.inside_BS, r.logp_BS, torch.zeros_like(r.logp_BS))], 1)
    if mb.rollout_dist_BSV is not None:
        # generated positions carry a distribution (from the full vocabulary: the same on every TP rank)
        mask_BS = mb.rollout_dist_BSV[:, 1:].ne(0).any(-1)
        dist_BSV = mb.rollout_dist_BSV[:, 1:, cols]
        kl_BS = (
            exact_kl_tokens(dist_BSV, z_BSV, mask_BS)
            if vocab_shard is None
            else exact_kl_tokens_vocab_parallel(dist_BSV, z_BSV, vocab_shard.group, mask_BS)
        )
        exact_kl_BS = torch.cat([pad, kl_BS], 1)
    return TokenStats(logp_BS, ent_BS, spi_BS, full_logp_BS, log_safe_mass_BS, exact_kl_BS)
