"""Routing replay in megatron-core: the learner routes tokens through given experts.

Built on megatron-core's own ``RouterReplay`` (``moe_enable_routing_replay``): every MoE router
owns one instance, and ``megatron_patches.router_replay_hook`` lets an instance delegate its
top-k choice to a per-layer hook installed here. Per pass (old log-probs, update, reference)
the learner picks a mode:

- ``observe``: route natively, compare with the given routes (routing agreement, replay off);
- ``record``:  route natively and keep the routes (R2: the old-policy pass records them);
- ``replay``:  force the given indices; gate values are recomputed from the live router logits
  (``scores.gather``), so the router keeps its gradient; rows without a route (the last token
  of each sequence, MISSING rows) route natively; padding rows get the spread pad routes.

Fail closed: every micro-batch's routes are consumed exactly once per layer in the forward (a
second forward without new routes raises: stale data), and, with activation recomputation,
served again from a FIFO on recompute; at the end of a pass every layer must have consumed
every micro-batch (and emptied its FIFO), or the pass raises naming layer and count. A fused
router (which bypasses replay) is refused when the controller is built.

Agreement is measured from the same forward (native top-k is computed anyway), on rows whose
target came from a record: per layer, the fraction of rows whose native expert set differs from
the given one, and overlap@K; per token, whether any layer differs and how many. An update pass
can also be given ``old_routes`` (the old-log-prob pass's native routes, kept with
``keep_native``): the same comparison against them is the update-induced flip rate of the
router-gradient monitor (``router_grad/update_flip_*``), with or without replay.

Sequence parallelism (TP > 1): megatron scatters the [S, B, H] hidden states over the TP ranks
along S (``scatter_to_sequence_parallel_region``), so TP rank r routes positions
[r S / TP, (r + 1) S / TP) of every sequence: with sequence-major rows that is the contiguous
block of rows [r N / TP, (r + 1) N / TP). Targets are laid out for the whole micro-batch and
sliced to that block; recorded routes are all-gathered back over the TP group; the agreement
metrics, counted on the rank's block, are summed over the TP group when the pass ends (so every
TP rank returns the same, complete values).

Pipeline parallelism (``stage_group``, PP > 1): each stage's controller hooks only its own MoE
layers (``_LayerHook.pos`` is the layer's position in the full route record, so targets are laid
out for every layer and each stage takes its own). What needs every layer waits for the end of
the pass (collectives inside the pipeline schedule would interleave with its send/recv): the
recorded routes and the per-token flip indicators ([L, N], other stages' layers zero) are summed
over the stages in one all-reduce, then the per-token metrics and the route records are built
on every stage; the per-layer agreement metrics (and their sums over layers) are summed over the
stages, each key taken as zero where a stage does not own the layer, so every stage returns the
same keys and values.

Shape suffixes: N rows (S * B tokens of a micro-batch), L MoE layers, K top-k.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from moe_rl.dist import all_gather_rows, all_reduce_sum, comm_device
from moe_rl.metrics import Mean
from moe_rl.routing.layout import layout, unlayout
from moe_rl.routing.record import RouteBatch, RouteHeader
from moe_rl.routing.stats import topk_agreement

MODES = ("observe", "record", "replay")


class ReplayError(RuntimeError):
    """Replay could not be served exactly as required; the message names layer and counts."""


class _LayerHook:
    """What a RouterReplay instance calls instead of its own top-k (see router_replay_hook)."""

    def __init__(self, owner: RouteReplay, pos: int, layer_id: int, idx: int) -> None:
        """``pos``: the layer's index in the route record; ``idx``: among this model's (stage's) hooks."""
        self.owner, self.pos, self.layer_id, self.idx = owner, pos, layer_id, idx
        self.target_NK: torch.Tensor | None = None
        self.old_NK: torch.Tensor | None = None  # the old-log-prob pass's native routes (compare only)
        self.fifo: deque[torch.Tensor] = deque()
        self.served_forward = 0
        self.served_backward = 0

    def __call__(self, scores: torch.Tensor, topk: int, compute_native):
        return self.owner._route(self, scores, topk, compute_native)


class RouteReplay:
    """Drives the routers of one megatron model (policy or reference: each has its own)."""

    def __init__(self, gpt, header: RouteHeader, ep_size: int, recompute: bool,
                 seq_shard: tuple[int, int, object] = (0, 1, None), stage_group=None) -> None:
        """``seq_shard``: (TP rank, TP size, TP group) of sequence parallelism; (0, 1, None) without.
        ``stage_group``: the pipeline-parallel group when PP > 1 (this model is one stage)."""
        from megatron_patches import router_replay_hook

        if not router_replay_hook.is_applied():
            raise ReplayError("megatron_patches.router_replay_hook is not applied (megatron_patches.apply_all)")
        self.header, self.ep_size, self.recompute = header, ep_size, recompute
        self.sp_rank, self.sp_size, self.sp_group = seq_shard
        self.stage_group = stage_group
        self.hooks: list[_LayerHook] = []
        for layer in gpt.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            layer_id = layer.layer_number - 1  # megatron numbers layers from 1, globally
            if getattr(router.config, "moe_router_fusion", False):
                raise ReplayError(f"layer {layer_id}: the fused router bypasses routing replay")
            if router.router_replay is None:
                raise ReplayError(f"layer {layer_id}: built without moe_enable_routing_replay")
            hook = _LayerHook(self, header.layer_ids.index(layer_id), layer_id, len(self.hooks))
            router.router_replay.moe_rl_controller = hook
            self.hooks.append(hook)
        if not self.hooks:
            raise ReplayError("the model has no MoE router to replay")
        self.mode: str | None = None
        self.monitor = None  # a RouterGradMonitor, observing the update passes' routing
        self.phase = "forward"
        self._reset()

    # ---- one pass over micro-batches ------------------------------------------------------
    def _reset(self) -> None:
        self.phase = "forward"
        self.num_micro_batches = 0
        self._recorded: list[RouteBatch] = []
        self._native_parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # ([N, L, K] all layers, seq_lens_B)
        self._token_differs: list[tuple[str, torch.Tensor]] = []  # (prefix, bool [L, N_recorded] all layers)
        self._stage_keys: set[str] = set()  # per-layer sums: each stage holds its own layers' part
        self._native_LNK: list[torch.Tensor | None] = [None] * len(self.hooks)
        self._differs: list[torch.Tensor | None] = [None] * len(self.hooks)
        self._old_differs: list[torch.Tensor | None] = [None] * len(self.hooks)
        self._metrics: dict = {}
        self._sharded_keys: set[str] = set()  # counted on this rank's sequence block only
        self._mb: tuple | None = None
        self._has_targets = False
        for h in self.hooks:
            h.target_NK, h.old_NK, h.served_forward, h.served_backward = None, None, 0, 0
            h.fifo.clear()

    @contextmanager
    def run(self, mode: str, with_backward: bool, prefix: str = "routing/", keep_native: bool = False,
            old_prefix: str = "router_grad/update_") -> Iterator[RouteReplay]:
        """One pass in ``mode``; with a backward (and recompute) the routes are queued for it.
        ``keep_native`` keeps the native routes in any mode (``recorded()``); comparisons with
        ``old_routes`` are filed under ``old_prefix``. Checks on exit that every route was
        consumed exactly once."""
        if mode not in MODES:
            raise ValueError(f"replay mode {mode!r} is not one of {MODES}")
        self._reset()
        self.mode, self.prefix, self.with_backward = mode, prefix, with_backward
        self.keep_native, self.old_prefix = keep_native or mode == "record", old_prefix
        try:
            yield self
            self._check_consumed()
            self._finish_pass()
            self._reduce_sequence_shards()
        finally:
            self.mode = None

    def begin_micro_batch(self, routes: RouteBatch | None, seq_lens_B: torch.Tensor, seq_len: int,
                          old_routes: RouteBatch | None = None) -> None:
        """Before a micro-batch's forward: lay its routes (and ``old_routes``) out like its tokens."""
        self.phase = "forward"
        self.num_micro_batches += 1
        B = int(seq_lens_B.shape[0])
        self._mb = (seq_lens_B, seq_len)
        self._has_targets = routes is not None
        if old_routes is not None:
            if old_routes.num_samples != B:
                raise ReplayError(f"micro-batch of {B} sequences has {old_routes.num_samples} old-pass routes")
            old_NLK, old_recorded_N, _ = layout(old_routes, seq_lens_B, seq_len, self.ep_size)
            old_NLK, self._old_recorded_N = self._local_rows(old_NLK), self._local_rows(old_recorded_N)
            for h in self.hooks:
                h.old_NK = old_NLK[:, h.pos].contiguous()
        if routes is None and self.mode in ("record", "observe"):
            return  # without rollout routes: record and/or compare with old routes only
        if routes is None or routes.num_samples != B:
            raise ReplayError(f"{self.mode}: micro-batch of {B} sequences has "
                              f"{None if routes is None else routes.num_samples} route records")
        targets_NLK, recorded_N, counts = layout(routes, seq_lens_B, seq_len, self.ep_size)
        targets_NLK, self._recorded_N = self._local_rows(targets_NLK), self._local_rows(recorded_N)
        for h in self.hooks:
            h.target_NK = targets_NLK[:, h.pos].contiguous()
        self._add(f"{self.prefix}missing_frac", Mean(counts["rows_missing"], counts["rows_expected"]))

    def end_forward(self) -> None:
        """After a micro-batch's forward (its loss is computed): recompute, if any, comes next."""
        self.phase = "backward"
        if self.keep_native:
            seq_lens_B, _ = self._mb
            native_NLK = self._all_layers(self._native_LNK, dim=1)
            if self.sp_size > 1:  # every TP rank routed its own block of rows: join them
                native_NLK = all_gather_rows(native_NLK.contiguous(), self.sp_group)
            self._native_parts.append((native_NLK, seq_lens_B))
        if self._has_targets and all(d is not None for d in self._differs):
            self._token_differs.append((self.prefix, self._all_layers(self._differs, dim=0)[:, self._recorded_N]))
        if any(d is not None for d in self._old_differs):
            unused = [h.layer_id for h, d in zip(self.hooks, self._old_differs) if d is None]
            if unused:
                raise ReplayError(f"layers {unused}: old-pass routes of this micro-batch were never compared")
            old_LN = self._all_layers(self._old_differs, dim=0)[:, self._old_recorded_N]
            self._token_differs.append((self.old_prefix, old_LN))
        self._native_LNK = [None] * len(self.hooks)
        self._differs = [None] * len(self.hooks)
        self._old_differs = [None] * len(self.hooks)

    def _all_layers(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Stack this stage's per-layer tensors at their positions in the full record along
        ``dim``; other stages' layers are zero."""
        local = torch.stack(parts, dim=dim)
        if len(self.hooks) == len(self.header.layer_ids):
            return local
        shape = list(local.shape)
        shape[dim] = len(self.header.layer_ids)
        pos = torch.tensor([h.pos for h in self.hooks], device=local.device)
        return local.new_zeros(shape).index_copy_(dim, pos, local)

    def _finish_pass(self) -> None:
        """After the last micro-batch: join the stages (PP), then per-token metrics and records."""
        if self.stage_group is not None:
            self._join_stages()
        for prefix, differs_LN in self._token_differs:
            n = torch.tensor(float(differs_LN.shape[1]))
            self._add(f"{prefix}flip_token_frac", Mean(differs_LN.any(0).float().sum(), n), sharded=True)
            self._add(f"{prefix}flip_layers_per_token", Mean(differs_LN.float().sum(), n), sharded=True)
        for native_NLK, seq_lens_B in self._native_parts:
            self._recorded.append(unlayout(native_NLK.cpu(), seq_lens_B, torch.zeros_like(seq_lens_B), self.header))

    def _join_stages(self) -> None:
        """PP: every layer's routes and flip indicators on every stage (one all-reduce; each layer
        is non-zero on its own stage only), and the per-layer metric sums over the stages."""
        group = self.stage_group
        device = comm_device(group)
        parts = [t for t, _ in self._native_parts] + [d for _, d in self._token_differs]
        if parts:
            flat = all_reduce_sum(torch.cat([p.reshape(-1).to(device, torch.int64) for p in parts]), group)
            joined, off = [], 0
            for p in parts:
                joined.append(flat[off:off + p.numel()].view(p.shape))
                off += p.numel()
            n = len(self._native_parts)
            self._native_parts = [(j.to(t.dtype), s) for j, (t, s) in zip(joined[:n], self._native_parts)]
            self._token_differs = [(k, j > 0) for j, (k, _) in zip(joined[n:], self._token_differs)]
        key_sets: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(key_sets, sorted(self._stage_keys), group=group)
        keys = sorted(set().union(*key_sets))
        if not keys:
            return
        zero = Mean(0.0, 0.0)
        vals = [torch.as_tensor(x).to(device=device, dtype=torch.float64).reshape(())
                for k in keys for x in (self._metrics.get(k, zero).sum, self._metrics.get(k, zero).count)]
        packed = all_reduce_sum(torch.stack(vals), group)
        for i, k in enumerate(keys):
            self._metrics[k] = Mean(packed[2 * i], packed[2 * i + 1])
        self._sharded_keys.update(keys)

    def recorded(self) -> RouteBatch:
        """R2: the routes recorded over the pass's micro-batches, in batch order."""
        if not self._recorded:
            raise ReplayError("nothing was recorded")
        parts = self._recorded
        return RouteBatch(torch.cat([p.ids_NLK for p in parts]), torch.cat([p.rows_B for p in parts]),
                          torch.cat([p.start_B for p in parts]), torch.cat([p.prompt_len_B for p in parts]),
                          self.header)

    def metrics(self) -> dict:
        return dict(self._metrics)

    # ---- the per-layer decision ------------------------------------------------------------
    def _route(self, hook: _LayerHook, scores: torch.Tensor, topk: int, compute_native):
        native_probs, native_NK = compute_native(scores)
        if self.monitor is not None and self.monitor.active:
            if self.phase == "forward":  # not again on recompute
                self.monitor.observe_forward(hook.pos, scores, native_NK)
            if scores.requires_grad:  # the no-grad first forward under recompute registers nothing
                scores.register_hook(lambda g, pos=hook.pos: self.monitor.observe_grad(pos, g))
        if self.mode is None:  # a pass without routes (SFT, evaluation): megatron's own routing
            return native_probs, native_NK
        if self.phase == "forward":
            if self.keep_native:
                self._native_LNK[hook.idx] = native_NK.detach()
            if hook.old_NK is not None:  # update-induced flips: native now vs the old-log-prob pass
                old_NK, hook.old_NK = hook.old_NK, None
                self._old_differs[hook.idx] = self._agreement(
                    native_NK, old_NK, self._old_recorded_N, f"{self.old_prefix}flip_frac", hook.layer_id,
                    overlap=False)
        if not self._has_targets:  # recording or comparing without routes to replay
            return native_probs, native_NK
        target_NK = self._next_target(hook, scores.shape[0])
        if self.phase == "forward":
            self._observe(hook, native_NK, target_NK)
        if self.mode != "replay":
            return native_probs, native_NK
        idx_NK = torch.where(target_NK >= 0, target_NK.to(native_NK.device), native_NK)
        return scores.gather(1, idx_NK), idx_NK

    def _next_target(self, hook: _LayerHook, num_rows: int) -> torch.Tensor:
        if self.phase == "backward":
            if not hook.fifo:
                raise ReplayError(f"layer {hook.layer_id}: recompute asked for routes but none are queued")
            target_NK = hook.fifo.popleft()
            hook.served_backward += 1
        else:
            if hook.target_NK is None:
                raise ReplayError(f"layer {hook.layer_id}: forward without routes for this micro-batch "
                                  f"(stale or missing data)")
            target_NK, hook.target_NK = hook.target_NK, None
            hook.served_forward += 1
            if self.recompute and self.with_backward and self.mode == "replay":
                hook.fifo.append(target_NK)
        if target_NK.shape[0] != num_rows:
            raise ReplayError(f"layer {hook.layer_id}: {target_NK.shape[0]} routes for {num_rows} tokens")
        return target_NK

    def _observe(self, hook: _LayerHook, native_NK: torch.Tensor, target_NK: torch.Tensor) -> None:
        self._differs[hook.idx] = self._agreement(native_NK, target_NK, self._recorded_N,
                                                  f"{self.prefix}flip_router_frac", hook.layer_id)

    def _agreement(self, native_NK: torch.Tensor, target_NK: torch.Tensor, rec_N: torch.Tensor, name: str,
                   layer_id: int, overlap: bool = True) -> torch.Tensor:
        """Per-layer flip rate (and overlap@K) on recorded rows; returns bool [N] (rows that differ)."""
        rec_N = rec_N.to(native_NK.device)
        differs_N, overlap_N = topk_agreement(native_NK.detach()[rec_N], target_NK.to(native_NK.device)[rec_N])
        n = torch.tensor(float(differs_N.shape[0]))
        for suffix in ("", f"/layer{layer_id}"):
            self._add(f"{name}{suffix}", Mean(differs_N.float().sum(), n), sharded=True, stage=True)
            if overlap:
                self._add(f"{self.prefix}overlap_at_k{suffix}", Mean(overlap_N.sum(), n), sharded=True, stage=True)
        return torch.zeros_like(rec_N).masked_scatter(rec_N, differs_N)

    def _add(self, key: str, value: Mean, sharded: bool = False, stage: bool = False) -> None:
        """``sharded``: counted on this TP rank's sequence block; ``stage``: on this PP stage's layers."""
        old = self._metrics.get(key)
        self._metrics[key] = value if old is None else Mean(old.sum + value.sum, old.count + value.count)
        if sharded:
            self._sharded_keys.add(key)
        if stage:
            self._stage_keys.add(key)

    def _local_rows(self, t_N: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's sequence block (sequence-major rows: one contiguous block)."""
        if self.sp_size == 1:
            return t_N
        if t_N.shape[0] % self.sp_size:
            raise ReplayError(f"{t_N.shape[0]} rows do not split over {self.sp_size} sequence-parallel ranks")
        return t_N.chunk(self.sp_size)[self.sp_rank].contiguous()

    def _reduce_sequence_shards(self) -> None:
        """Sum the block-local agreement counts over the TP group: one all-reduce per pass."""
        if self.sp_size == 1:
            return
        keys = sorted(self._sharded_keys)  # the same keys on every TP rank (same layers, same micro-batches)
        if not keys:
            return
        device = comm_device(self.sp_group)
        vals = [torch.as_tensor(x).to(device=device, dtype=torch.float64).reshape(())
                for k in keys for x in (self._metrics[k].sum, self._metrics[k].count)]
        packed = all_reduce_sum(torch.stack(vals), self.sp_group)
        for i, k in enumerate(keys):
            self._metrics[k] = Mean(packed[2 * i], packed[2 * i + 1])

    def _check_consumed(self) -> None:
        if not self._has_targets:
            return
        n = self.num_micro_batches
        for h in self.hooks:
            if h.served_forward != n:
                raise ReplayError(f"layer {h.layer_id}: consumed {h.served_forward} of {n} micro-batches' routes")
            if h.target_NK is not None:
                raise ReplayError(f"layer {h.layer_id}: routes of the last micro-batch were never used")
            if h.fifo:
                raise ReplayError(f"layer {h.layer_id}: {len(h.fifo)} queued routes were not consumed by recompute")
