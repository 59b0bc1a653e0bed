"""Routing replay in megatron-core: the learner routes tokens through given experts.

Built on megatron-core's own ``RouterReplay`` (``moe_enable_routing_replay``): every MoE router
owns one instance, and ``megatron_patches.router_replay_hook`` lets an instance delegate its
top-k choice to a per-layer hook installed here. ``RouteReplay`` drives the routers of one model
(policy or reference: each has its own) through one pass at a time, in the mode of a
``PassPlan`` (moe_rl/routing/replay_plan.py):

- ``observe``: route natively, compare with the given routes (routing agreement, replay off);
- ``record``:  route natively and keep the routes (R2: the old-policy pass records them);
- ``replay``:  force the given indices; gate values are recomputed from the live router logits
  (``scores.gather``), so the router keeps its gradient; rows without a route (the last token
  of each sequence, MISSING rows) route natively; padding rows get the spread pad routes.

Three jobs, three parts: the ``RouteServer`` (routing/server.py) serves targets per micro-batch
and checks they were all consumed; the ``AgreementCollector`` (routing/agreement.py) keeps the
native routes and computes agreement once per pass; the router-gradient monitor, given at
construction, observes the update passes' routing. The controller lays each micro-batch's routes
out like its tokens (routing/row_layout.py) and knows, by itself, whether a router call is the
micro-batch's forward or a recompute in its backward (``micro_batch``). A fused router (which
bypasses replay) is refused when the controller is built.

Shape suffixes: N rows (S * B tokens of a micro-batch), L MoE layers, K top-k.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moe_rl.routing.agreement import AgreementCollector, RoutingOutcome, SeqShard
from moe_rl.routing.gating import RouterSpec, group_violations, topk_margin
from moe_rl.routing.record import RouteBatch, RouteHeader
from moe_rl.routing.replay_plan import PassMode, PassPlan
from moe_rl.routing.row_layout import layout, token_rows
from moe_rl.routing.server import ReplayError, RouteServer

__all__ = ["ReplayError", "RouteReplay", "RoutingOutcome", "SeqShard"]


class _LayerHook:
    """What a RouterReplay instance calls instead of its own top-k (see router_replay_hook)."""

    def __init__(self, owner: RouteReplay, idx: int, pos: int) -> None:
        """``idx``: among this model's hooks; ``pos``: the layer's index in the full route record."""
        self.owner, self.idx, self.pos = owner, idx, pos

    def __call__(self, scores: torch.Tensor, topk: int, compute_native):
        return self.owner._route(self, scores, topk, compute_native)


@dataclass
class _Pass:
    plan: PassPlan | None  # None: megatron's own routing (the monitor may still observe)
    monitor: bool
    has_targets: bool = False  # routes were given: every one must be consumed
    outcome: RoutingOutcome | None = None


class RouteReplay:
    def __init__(
        self,
        gpt,
        header: RouteHeader,
        ep_size: int,
        recompute: bool,
        seq_shard: SeqShard = SeqShard(),
        stage_group=None,
        monitor=None,
    ) -> None:
        """``seq_shard``: sequence parallelism (TP > 1); ``stage_group``: the pipeline group when
        PP > 1 (this model is one stage); ``monitor``: a RouterGradMonitor fed by passes that ask."""
        from megatron_patches import router_replay_hook

        if not router_replay_hook.is_applied():
            raise ReplayError(
                "megatron_patches.router_replay_hook is not applied (megatron_patches.apply_all)"
            )
        self.header, self.ep_size, self.recompute, self.sp = header, ep_size, recompute, seq_shard
        self.monitor = monitor
        self.layer_ids: list[int] = []
        hooks = []
        for layer in gpt.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            layer_id = layer.layer_number - 1  # megatron numbers layers from 1, globally
            if getattr(router.config, "moe_router_fusion", False):
                raise ReplayError(f"layer {layer_id}: the fused router bypasses routing replay")
            if router.router_replay is None:
                raise ReplayError(f"layer {layer_id}: built without moe_enable_routing_replay")
            hook = _LayerHook(self, len(hooks), header.layer_ids.index(layer_id))
            router.router_replay.moe_rl_controller = hook
            hooks.append(hook)
            self.layer_ids.append(layer_id)
            shared = getattr(layer.mlp, "shared_experts", None)
            if monitor is not None and shared is not None:  # the shared expert's output share
                if getattr(layer.mlp, "shared_expert_overlap", False):
                    raise ReplayError(
                        f"layer {layer_id}: router monitor: moe_shared_expert_overlap is not supported"
                    )
                shared.register_forward_hook(functools.partial(self._keep_shared, hook))
                layer.mlp.register_forward_hook(functools.partial(self._observe_shared, hook))
        if not hooks:
            raise ReplayError("the model has no MoE router to replay")
        self.biased = getattr(router, "expert_bias", None) is not None  # sigmoid + expert bias
        tcfg = router.config  # group-limited routing: replayed ids are checked against the groups
        self.group_spec = RouterSpec(
            tcfg.moe_router_topk,
            tcfg.moe_router_score_function,
            num_groups=tcfg.moe_router_num_groups or 0,
            group_topk=tcfg.moe_router_group_topk or 0,
        )
        self.server = RouteServer(self.layer_ids)
        self.collector = AgreementCollector(header, self.layer_ids, seq_shard, stage_group)
        self._pass: _Pass | None = None
        self._in_forward = False
        self._targets = self._old = None  # this micro-batch's (targets_NLK, recorded_N) for comparison
        self._target_lag: torch.Tensor | None = None  # its rows' version lags (flips by lag)
        self._target_turn: torch.Tensor | None = None  # its rows' agent turns (flips by turn)
        self._native: list[torch.Tensor | None] = []
        self._margin: list[torch.Tensor | None] = []  # per layer, with targets and ``plan.margins``
        self._real_N: torch.Tensor | None = None  # this micro-batch's rows that are real tokens (monitor)
        self._shared_out: dict[int, torch.Tensor] = {}  # a layer's shared-expert output, until its MoE output

    # ---- one pass over micro-batches --------------------------------------------------------
    @contextmanager
    def run(self, plan: PassPlan | None, with_backward: bool, monitor: bool = False) -> Iterator[_Pass]:
        """One pass; ``monitor`` feeds the router-gradient monitor. On exit checks that every
        route was consumed exactly once and sets the pass's ``outcome``."""
        p = _Pass(plan, monitor and self.monitor is not None)
        if plan is not None:
            self.server.begin_pass(self.recompute and with_backward and plan.mode is PassMode.REPLAY)
            self.collector.begin_pass(
                plan.prefix,
                plan.records,
                num_lags=plan.num_lags,
                margins=plan.margins,
                num_turns=plan.num_turns,
            )
        self._pass = p
        try:
            yield p
            if plan is not None:
                if p.has_targets:
                    self.server.check_consumed()
                p.outcome = self.collector.finish()
        finally:
            self._pass, self._in_forward = None, False

    @contextmanager
    def micro_batch(self, mb, seq_len: int) -> Iterator[None]:
        """Around one micro-batch's forward (a ``TrainBatch``): its routes laid out like its
        tokens; router calls after it (activation recomputation) are served from the queue."""
        p = self._pass
        self._in_forward = True
        if p is not None and p.monitor:  # the monitor's statistics cover real tokens, not padding
            lens_B = mb.seq_lens_B
            real_N = (torch.arange(seq_len, device=lens_B.device)[:, None] < lens_B[None, :]).reshape(-1)
            self._real_N = self.sp.local_rows(real_N).to(self.device, non_blocking=True)
        if p is not None and p.plan is not None:
            self._begin_micro_batch(p.plan, mb.routes, mb.old_routes, mb.seq_lens_B, seq_len)
            if p.plan.num_lags and self._targets is not None:
                self._target_lag = self._row_lags(mb.route_lag_BS, seq_len)
            if p.plan.num_turns and self._targets is not None:
                self._target_turn = self._row_lags(mb.route_turn_BS, seq_len, "turn")
        try:
            yield
            if p is not None and p.plan is not None:
                self._end_forward(mb.seq_lens_B)
        finally:
            self._in_forward = False

    def _begin_micro_batch(
        self,
        plan: PassPlan,
        routes: RouteBatch | None,
        old_routes: RouteBatch | None,
        seq_lens_B: torch.Tensor,
        seq_len: int,
    ) -> None:
        B = int(seq_lens_B.shape[0])
        self._native = [None] * len(self.layer_ids)
        self._margin = [None] * len(self.layer_ids)
        self._targets = self._old = self._target_lag = self._target_turn = None
        lens_B = seq_lens_B.cpu()  # the layout is index arithmetic on the CPU, moved once below
        if old_routes is not None:
            if old_routes.num_samples != B:
                raise ReplayError(
                    f"micro-batch of {B} sequences has {old_routes.num_samples} old-pass routes"
                )
            old_NLK, old_rec_N, _ = layout(old_routes, lens_B, seq_len, self.ep_size)
            self._old = (self._local(old_NLK), self.sp.local_rows(old_rec_N))
        if routes is None and plan.mode is not PassMode.REPLAY:
            return  # record and/or compare with the old routes only
        if routes is None or routes.num_samples != B:
            raise ReplayError(
                f"{plan.mode.value}: micro-batch of {B} sequences has "
                f"{None if routes is None else routes.num_samples} route records"
            )
        targets_NLK, rec_N, counts = layout(routes, lens_B, seq_len, self.ep_size)
        targets_NLK = self._local(targets_NLK)
        self.server.load(targets_NLK)
        self._pass.has_targets = True
        self._targets = (targets_NLK, self.sp.local_rows(rec_N))
        self.collector.add_missing(counts)

    def _row_lags(self, route_lag_BS: torch.Tensor | None, seq_len: int, what: str = "lag") -> torch.Tensor:
        """This rank's rows' version lags (or turns), laid out like the targets (row s * B + b: token
        s of sequence b)."""
        if route_lag_BS is None or route_lag_BS.shape[1] != seq_len:
            raise ReplayError(f"flips by {what} were asked for but the micro-batch has no route_{what}_BS")
        return self.sp.local_rows(token_rows(route_lag_BS.cpu()))

    def _local(self, t_NLK: torch.Tensor) -> torch.Tensor:
        """This rank's rows and this stage's layers, on the router's device."""
        t_NLK = self.sp.local_rows(t_NLK)
        if len(self.layer_ids) != t_NLK.shape[1]:
            t_NLK = t_NLK[:, self.collector.pos]
        return t_NLK.to(self.device, non_blocking=True)

    def _end_forward(self, seq_lens_B: torch.Tensor) -> None:
        if self._targets is not None:
            self.server.check_forward()
        if self._targets is None and self._old is None and not self._pass.plan.records:
            return
        unrouted = [lid for lid, n in zip(self.layer_ids, self._native) if n is None]
        if unrouted:
            raise ReplayError(f"layers {unrouted}: never routed this micro-batch")
        margins = self._pass.plan.margins and self._targets is not None
        self.collector.add(
            torch.stack(self._native, 1),
            seq_lens_B.cpu(),
            self._targets,
            self._old,
            target_lag=self._target_lag,
            target_turn=self._target_turn,
            margin_NL=torch.stack(self._margin, 1) if margins else None,
        )
        self._native = [None] * len(self.layer_ids)
        self._margin = [None] * len(self.layer_ids)

    @property
    def device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    def _watch_grad(self, scores: torch.Tensor, pos: int) -> None:
        """Feed the monitor the gradient of the scores that gate. Without an expert bias these are
        the ``scores`` the top-k sees. With one, megatron's top-k sees ``sigmoid + bias`` and
        discards its values (the bias never weights): no gradient reaches that sum, so the hook
        goes on the autograd node of the unbiased sigmoid scores it was built from."""
        if not self.biased:
            scores.register_hook(lambda g: self.monitor.observe_grad(pos, g))
            return
        node = scores.grad_fn
        if type(node).__name__ != "AddBackward0" or node.next_functions[0][0] is None:
            raise ReplayError(
                f"router monitor: expected megatron-core's sigmoid scores + expert bias, got {node}"
            )
        node.next_functions[0][0].register_hook(lambda g_in, g_out: self.monitor.observe_grad(pos, g_out[0]))

    def _monitoring_forward(self) -> bool:
        return self._pass is not None and self._pass.monitor and self._in_forward

    def _keep_shared(self, hook: _LayerHook, module, args, out) -> None:
        """Forward hook of a layer's shared expert (its output includes Qwen2-MoE's gate)."""
        if self._monitoring_forward():  # not again on recompute
            self._shared_out[hook.idx] = out.detach()

    def _observe_shared(self, hook: _LayerHook, module, args, out) -> None:
        """Forward hook of the MoE layer: its output is routed + shared, so routed = out - shared."""
        if not self._monitoring_forward():
            return
        shared = self._shared_out.pop(hook.idx, None)
        if shared is None:
            raise ReplayError(
                f"layer {self.layer_ids[hook.idx]}: router monitor: the shared expert did not run"
            )
        total = (out[0] if isinstance(out, tuple) else out).detach()
        real_N = self._real_N
        shared_NH, routed_NH = (
            shared.reshape(-1, shared.shape[-1]),
            (total - shared).reshape(-1, shared.shape[-1]),
        )
        self.monitor.observe_shared(hook.pos, shared_NH[real_N], routed_NH[real_N])

    # ---- the per-layer decision ------------------------------------------------------------
    def _route(self, hook: _LayerHook, scores: torch.Tensor, topk: int, compute_native):
        native_probs, native_NK = compute_native(scores)
        p, forward = self._pass, self._in_forward
        if p is None:  # outside any pass (SFT, evaluation): megatron's own routing
            return native_probs, native_NK
        if p.monitor:
            if forward:  # not again on recompute
                self.monitor.observe_forward(hook.pos, scores[self._real_N], native_NK[self._real_N])
            if scores.requires_grad:  # the no-grad first forward under recompute registers nothing
                self._watch_grad(scores, hook.pos)
        if p.plan is None:
            return native_probs, native_NK
        if forward:
            self._native[hook.idx] = native_NK.detach()
        if self._targets is None:  # recording or comparing without routes to replay
            return native_probs, native_NK
        target_NK = self.server.serve(hook.idx, scores.shape[0], recompute=not forward)
        if forward and p.plan.margins:  # the learner's own margin: how close this flip was
            self._margin[hook.idx] = topk_margin(scores, self.group_spec)
        if p.plan.mode is not PassMode.REPLAY:
            return native_probs, native_NK
        idx_NK = torch.where(target_NK >= 0, target_NK, native_NK)
        if forward and self.group_spec.grouped:
            # ``scores`` are the selection scores (biased with an expert bias), before group masking
            replayed_N = self._targets[1].to(scores.device) & (target_NK >= 0).all(-1)
            outside_N = group_violations(scores.detach(), idx_NK, self.group_spec) & replayed_N
            self.collector.add_group_violations(outside_N.sum(), replayed_N.sum())
        # The values are megatron's gather from the same scores: with an expert bias megatron
        # discards them and gates by the unbiased scores at these ids (the bias never weights);
        # renormalisation over K and the routed scaling factor follow in megatron, as natively.
        return scores.gather(1, idx_NK), idx_NK
