"""Lay route records out exactly like the learner lays out tokens, one micro-batch at a time.

megatron's router flattens its [S, B, E] logits to [S * B, E], so replay targets are
sequence-major: row ``s * B + b`` is token s of sequence b. For each row the target is:
- the record's Top-K ids (prompt and response rows);
- -1 (route natively) where the record has no row: the last token of every sequence, and rows a
  multi-turn record did not carry (MISSING);
- for padding tokens, distinct experts spread evenly over the EP ranks (never all expert 0, which
  would pile every pad token onto one rank; four peer frameworks hit that hot spot).

Shape suffixes: B sequences, S positions, N = S * B rows, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import torch

from moe_rl.routing.record import RouteBatch, RouteHeader, missing_id


def pad_routes(
    num_rows: int, top_k: int, num_experts: int, ep_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """int64 [num_rows, K]: K distinct experts per row, consecutive rows cycling over EP ranks.

    Ordinal m = row * K + k maps to expert (m % ep) * (E / ep) + (m // ep) % (E / ep): K
    consecutive ordinals are distinct modulo E, so a row never repeats an expert, and every rank
    gets the same share of pad tokens."""
    per_rank = num_experts // ep_size
    m_NK = (
        torch.arange(num_rows, device=device)[:, None] * top_k + torch.arange(top_k, device=device)[None, :]
    ) % num_experts
    return (m_NK % ep_size) * per_rank + (m_NK // ep_size) % per_rank


def token_rows(x_BS: torch.Tensor) -> torch.Tensor:
    """A per-token [B, S] tensor as the router's rows [S * B] (row s * B + b: token s of sequence b)."""
    return x_BS.t().reshape(-1)


def layout(
    routes: RouteBatch, seq_lens_B: torch.Tensor, seq_len: int, ep_size: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Replay targets for one micro-batch, on the records' device (the host, for the learner).

    Args:
        routes: the B sequences' records, in micro-batch order.
        seq_lens_B: int64 [B] tokens per sequence (prompt + response).
        seq_len: S, the micro-batch's padded length.
    Returns:
        targets_NLK: int64 [S * B, L, K]; -1 = route natively.
        recorded_N: bool [S * B], rows whose target comes from a record (agreement is measured there).
        counts: 0-dim tensors "rows_expected" (real tokens except the last of each sequence) and
            "rows_missing" (of those, rows without a recorded route), for routing/missing_frac.
    """
    header = routes.header
    B, L, K = routes.num_samples, len(header.layer_ids), header.top_k
    device = routes.ids_NLK.device
    seq_lens_B = seq_lens_B.to(device)
    targets_NLK = torch.full((seq_len * B, L, K), -1, dtype=torch.int64, device=device)
    ids_NLK = routes.ids_NLK.to(torch.int64)
    ids_NLK[ids_NLK == missing_id(header.dtype)] = -1
    flat_N = routes.position_N * B + routes.sample_N
    targets_NLK[flat_N] = ids_NLK
    recorded_N = torch.zeros(seq_len * B, dtype=torch.bool, device=device)
    recorded_N[flat_N] = (ids_NLK >= 0).all(-1).all(-1)
    pad_N = (torch.arange(seq_len, device=device)[:, None] >= seq_lens_B[None, :]).reshape(-1)
    num_pad = int(pad_N.sum())
    pad_NK = pad_routes(num_pad, K, header.num_experts, ep_size, device)
    targets_NLK[pad_N] = pad_NK[:, None, :].expand(num_pad, L, K)
    expected = (seq_lens_B - 1).clamp(min=0).sum().double()
    counts = {"rows_expected": expected, "rows_missing": expected - recorded_N.sum().double()}
    return targets_NLK, recorded_N, counts


def unlayout(
    native_NLK: torch.Tensor, seq_lens_B: torch.Tensor, prompt_len_B: torch.Tensor, header: RouteHeader
) -> RouteBatch:
    """The inverse for recording (R2): a micro-batch's [S * B, L, K] routes -> records of its B
    sequences, rows 0 .. T_b - 2 (the last token's routing is not part of a record)."""
    B, device = int(seq_lens_B.shape[0]), native_NLK.device
    rows_B = (seq_lens_B.to(device) - 1).clamp(min=0)
    first_B = torch.cumsum(rows_B, 0) - rows_B
    sample_N = torch.repeat_interleave(torch.arange(B, device=device), rows_B)
    pos_N = torch.arange(int(rows_B.sum()), device=device) - first_B[sample_N]
    ids_NLK = native_NLK[pos_N * B + sample_N].to(header.dtype)
    return RouteBatch(ids_NLK, rows_B, torch.zeros_like(rows_B), prompt_len_B.to(device), header)
