"""A rank's result as bytes for ``tests/dist_harness.py run_ranks``: a tensor put on the harness's
queue as it is travels as a shared-memory handle that dies with its rank, and the queue's pipe
holds about 64 KiB until the ranks have ended (larger results block the rank: compare big tensors
in the ranks, by digest)."""

from __future__ import annotations

import hashlib
import io

import torch


def packed(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpacked(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def digests(named: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Per tensor its dtype, shape and the SHA-256 of its bytes: equal bits, compared in the test
    process without moving the tensors."""
    return {
        n: (str(t.dtype), tuple(t.shape), hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest())
        for n, t in named.items()
    }
