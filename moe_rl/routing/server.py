"""The route server: per MoE layer, the replay targets of the current micro-batch, a FIFO that
serves them again to activation recomputation, and the check that every route was consumed.

Fail closed: a layer's routes are consumed exactly once per micro-batch in the forward (a second
forward without new routes raises: stale data), and, with recomputation, served again from the
FIFO; at the end of a pass every layer must have consumed every micro-batch and emptied its
FIFO, or the pass raises naming layer and count.

Shape suffixes: N rows (tokens of a micro-batch), L this model's MoE layers, K top-k.
"""

from __future__ import annotations

from collections import deque

import torch


class ReplayError(RuntimeError):
    """Replay could not be served exactly as required; the message names layer and counts."""


class RouteServer:
    def __init__(self, layer_ids: list[int]) -> None:
        """``layer_ids``: global layer number of each MoE layer this model (stage) holds."""
        self.layer_ids = list(layer_ids)
        self._target: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._fifo: list[deque[torch.Tensor]] = [deque() for _ in layer_ids]
        self.served_forward = [0] * len(layer_ids)
        self.served_backward = [0] * len(layer_ids)
        self._queue = False
        self.num_micro_batches = 0

    def begin_pass(self, queue_for_recompute: bool) -> None:
        """``queue_for_recompute``: forwards keep their routes for a recompute in the backward."""
        self._queue = queue_for_recompute
        self.num_micro_batches = 0
        for i in range(len(self.layer_ids)):
            self._target[i] = None
            self._fifo[i].clear()
            self.served_forward[i] = self.served_backward[i] = 0

    def load(self, targets_NLK: torch.Tensor) -> None:
        """A micro-batch's targets, one [N, K] column block per layer (-1: route natively)."""
        self.num_micro_batches += 1
        for i in range(len(self.layer_ids)):
            self._target[i] = targets_NLK[:, i]

    def serve(self, i: int, num_rows: int, recompute: bool) -> torch.Tensor:
        """Layer ``i``'s targets for this forward (or, with ``recompute``, the queued ones)."""
        layer = self.layer_ids[i]
        if recompute:
            if not self._fifo[i]:
                raise ReplayError(f"layer {layer}: recompute asked for routes but none are queued")
            target_NK = self._fifo[i].popleft()
            self.served_backward[i] += 1
        else:
            target_NK = self._target[i]
            if target_NK is None:
                raise ReplayError(
                    f"layer {layer}: forward without routes for this micro-batch (stale or missing data)"
                )
            self._target[i] = None
            self.served_forward[i] += 1
            if self._queue:
                self._fifo[i].append(target_NK)
        if target_NK.shape[0] != num_rows:
            raise ReplayError(f"layer {layer}: {target_NK.shape[0]} routes for {num_rows} tokens")
        return target_NK

    def check_forward(self) -> None:
        """After a micro-batch's forward: every layer consumed its routes."""
        n = self.num_micro_batches
        for i, layer in enumerate(self.layer_ids):
            if self.served_forward[i] != n:
                raise ReplayError(
                    f"layer {layer}: consumed {self.served_forward[i]} of {n} micro-batches' routes"
                )
            if self._target[i] is not None:
                raise ReplayError(f"layer {layer}: routes of the last micro-batch were never used")

    def check_consumed(self) -> None:
        """After a pass: every forward consumed its routes and every queued route was recomputed."""
        self.check_forward()
        for i, layer in enumerate(self.layer_ids):
            if self._fifo[i]:
                raise ReplayError(
                    f"layer {layer}: {len(self._fifo[i])} queued routes were not consumed by recompute"
                )
