"""The weight sync learner -> rollout ranks (``parallel.rollout_ranks``, docs/design.md 15): the
canonical chunks of ``Learner.iter_canonical_layers`` broadcast over the sync group
(``moe_rl/placement.py``: learner rank 0, its root, and every rollout rank), a chunk at a time,
so no rank holds more than one gathered chunk, and versioned: each sync names the weight version
it carries (the number of updates behind it), so a rollout rank that missed one fails loudly.

Per chunk: a header (the version, the names, shapes and dtypes) broadcast as a pickled object,
then each tensor; a header without names ends the stream. Minimal: one broadcast per tensor."""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

ROOT = 0  # learner rank 0 is the sync group's first member


def _broadcast_object(obj: Any, group) -> Any:
    """``obj`` from the root to every member (pickled into a uint8 tensor, its length first)."""
    if group.rank == ROOT:
        data = torch.frombuffer(
            bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
        )
        group.broadcast(torch.tensor([data.numel()], dtype=torch.int64), ROOT)
        group.broadcast(data, ROOT)
        return obj
    size = group.broadcast(torch.empty(1, dtype=torch.int64), ROOT)
    data = group.broadcast(torch.empty(int(size.item()), dtype=torch.uint8), ROOT)
    return pickle.loads(data.numpy().tobytes())


def broadcast_weights(chunks: Iterable[Mapping[str, torch.Tensor]], group, version: int) -> None:
    """Root side: send every chunk of ``chunks`` (consumed in order) as weight version ``version``."""
    for chunk in chunks:
        host = {n: t.detach().to("cpu").contiguous() for n, t in chunk.items()}
        _broadcast_object((version, [(n, tuple(t.shape), t.dtype) for n, t in host.items()]), group)
        for t in host.values():
            group.broadcast(t, ROOT)
    _broadcast_object((version, None), group)  # the end of this sync


def receive_weights(group) -> tuple[int, Iterator[dict[str, torch.Tensor]]]:
    """Member side: the version of the sync the root starts next, and its chunks (the iterator must
    be consumed to the end, in step with the root: each chunk is received as it is read)."""
    version, first = _broadcast_object(None, group)

    def chunks() -> Iterator[dict[str, torch.Tensor]]:
        header = first
        while header is not None:
            yield {n: group.broadcast(torch.empty(shape, dtype=dtype), ROOT) for n, shape, dtype in header}
            v, header = _broadcast_object(None, group)
            if v != version:
                raise RuntimeError(
                    f"weight sync: a chunk of version {v} inside the sync of version {version}"
                )

    return version, chunks()
