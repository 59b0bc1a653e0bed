"""Per-tensor checksums of the weight sync (``rollout.sync_check``; docs/design.md 14.4).

The learner checksums what the engine must hold after a sync (``expected``: each tensor in the
engine's dtype, and for FP8 the blockwise quantize -> dequantize of it, recomputed on the
learner), the engine checksums what it holds; the two agree bit for bit or the sync was wrong.

The checksum is exact integer arithmetic over the tensor's bits, so it does not depend on the
reduction order (device, threads): the bits (int view of the dtype's width, widened to int64) in
rows of ``ROW`` values, each row a dot product with fixed column weights mod ``PRIME``, the rows
summed with a weight per row index mod ``PRIME``. A permutation of values (a wrong expert order, a
transposed or shifted layout) changes it, as does any changed bit; no intermediate exceeds 2^62.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moe_rl.rollout.base import engine_dtype
from moe_rl.rollout.fp8 import fake_quant_weight

ROW = 256
PRIME = 2**31 - 1
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_COLS: dict[torch.device, torch.Tensor] = {}


def _cols(device: torch.device) -> torch.Tensor:
    """The fixed column weights in [1, 2^12), from a fixed seed (the same on every rank)."""
    if device not in _COLS:
        g = torch.Generator().manual_seed(0x5EED)
        _COLS[device] = torch.randint(1, 2**12, (ROW,), generator=g, dtype=torch.int64).to(device)
    return _COLS[device]


def checksum(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar tensor (on ``t``'s device, not synchronized) over ``t``'s bits and their
    positions. |bits| < 2^31 (int64 tensors: their low 31 bits), column weights < 2^12, ROW = 2^8:
    a row's dot product < 2^51; reduced mod PRIME, times a row weight < 2^31: < 2^62."""
    flat = t.detach().contiguous().reshape(-1)
    bits = flat.view(_INT_OF_WIDTH[flat.element_size()]).to(torch.int64)
    if flat.element_size() == 8:
        bits = bits % PRIME
    pad = -bits.numel() % ROW
    rows = torch.nn.functional.pad(bits, (0, pad)).view(-1, ROW)
    dots = (rows * _cols(t.device)).sum(1) % PRIME
    idx = torch.arange(1, rows.shape[0] + 1, dtype=torch.int64, device=t.device)
    row_w = (idx * 2654435761) % PRIME
    return ((dots * row_w) % PRIME).sum()


def checksums(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``checksum`` of each tensor, by name (device scalars: read them once, together)."""
    return {n: checksum(t) for n, t in named.items()}


def expected(name: str, t: torch.Tensor, dtype: torch.dtype, fp8: frozenset[str]) -> torch.Tensor:
    """What an engine of ``dtype`` (``rollout.dtype``) holds after loading ``t`` as ``name``: cast to
    the dtype it keeps that name in, and through blockwise FP8 and back when ``name`` is in ``fp8``."""
    held = t.detach().to(engine_dtype(name, dtype))
    return fake_quant_weight(held) if name in fp8 else held


def first_mismatch(sent: Mapping[str, int], held: Mapping[str, int]) -> str | None:
    """The first name (sorted) whose checksums differ or that one side lacks; None if all agree."""
    for name in sorted(set(sent) | set(held)):
        if sent.get(name) != held.get(name):
            return name
    return None


def as_ints(named: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Device scalars -> ints, with one transfer."""
    names = list(named)
    if not names:
        return {}
    values = torch.stack([named[n] for n in names]).cpu().tolist()
    return dict(zip(names, values))
