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
