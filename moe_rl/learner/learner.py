"""The megatron-core learner: log-prob passes and policy updates over micro-batches.

Inputs are ``TrainBatch``es (moe_rl/types.py), moved to the model's device once per pass and
split with ``TrainBatch.micro_batches``; a ``PassPlan`` (moe_rl/routing/replay_plan.py) says how the
pass routes. Outputs are ``LogprobOutput`` / ``UpdateOutput`` with the pass's ``RoutingOutcome``.
Ranks, sizes and groups come from the ``ParallelDims`` given at construction.

Forward and backward run through megatron-core's own pipeline schedule
(``get_forward_backward_func``), gradients are reduced by megatron's ``finalize_model_grads`` and
applied by its (distributed) optimizer. The loss is a callable passed in (``LossFn``); its
normaliser (the global token count) is computed here, once per minibatch, and passed down.

Tensor parallelism (TP > 1, with sequence parallelism): the output layer is vocab-parallel, so
each TP rank gets a [B, S, V / TP] slice of the logits and the per-token statistics (DVP and the
exact KL included) are all-reduced over the TP group (``logprobs``' vocab-parallel functions);
micro-batch lengths are
padded to a multiple of TP (megatron splits the sequence over TP ranks); weights and gradients
are exported in canonical names by gathering the TP pieces. TP ranks of one data-parallel rank
hold the same data, so every output here is identical on them.

Pipeline parallelism (PP > 1): this rank builds one stage (the embedding on the first, the output
layer and the loss on the last); megatron's 1F1B schedule sends hidden states between stages
(shapes exchanged per micro-batch: lengths vary). The stages of one data-parallel rank hold the
same data, and everything returned here is identical on them: the last stage's per-token
statistics and per-micro-batch loss metrics are broadcast over the pipeline group, routing-replay
records and metrics are joined over it (moe_rl/routing/replay.py), the router monitor's
statistics summed over it, and canonical weights/gradients gathered from the owning stages.

Shape suffixes: B sequences, S positions, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from moe_rl.config import (
    ModelConfig,
    OptimConfig,
    ParallelConfig,
)
from moe_rl.config.layout import pipeline_stage_layers
from moe_rl.dist import ParallelDims, comm_device
from moe_rl.learner import build
from moe_rl.learner.stage_broadcast import broadcast_metrics, broadcast_stats
from moe_rl.learner.te_spec import FP8_TOKEN_MULTIPLE, rename_to_local, te_name_map
from moe_rl.learner.token_stats import VocabShard, token_stats
from moe_rl.monitor.router_grad import RouterGradMonitor, expert_load_LE
from moe_rl.routing.gating import RouterSpec
from moe_rl.routing.record import RouteHeader
from moe_rl.routing.replay import RouteReplay, RoutingOutcome, SeqShard
from moe_rl.routing.replay_plan import PassPlan
from moe_rl.timing import MemoryTimeline
from moe_rl.types import TokenStats, TrainBatch
from moe_rl.weights.megatron_shards import Shard, canonical_to_megatron
from moe_rl.weights.slice_stream import ShardOf, stream_engine_slices
from moe_rl.weights.stored import StoredWeights
from moe_rl.weights.stream import stream_canonical

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogprobOutput:
    """A log-prob pass: per-token statistics, and what its routing produced."""

    stats: TokenStats
    routing: RoutingOutcome


@dataclass(frozen=True)
class UpdateOutput:
    """One optimizer step: the global gradient norm, per-micro-batch loss metrics, routing;
    ``skipped`` when no rank had a nonzero gradient and the optimizer was not stepped."""

    grad_norm: float
    loss_metrics: list
    routing: RoutingOutcome
    skipped: bool = False


# loss_fn(micro_batch, token_stats, normalizer) -> (loss, metrics)
LossFn = Callable[[TrainBatch, TokenStats, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


class Learner:
    """A megatron GPTModel (MoE, EP over the default group) with DDP and its optimizer."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        par: ParallelConfig,
        optim: OptimConfig,
        dims: ParallelDims,
        init_weights: Mapping[str, torch.Tensor] | StoredWeights | None = None,
        with_reference: bool = False,
        monitor: bool = True,
        monitor_margin_eps: float = 0.1,
        max_tokens_per_micro_batch: int = 0,
        memory: MemoryTimeline | None = None,
    ):
        span = memory.span if memory is not None else (lambda name: nullcontext())
        self.model_cfg, self.par, self.dims = model_cfg, par, dims
        self.skip_zero_grad = optim.skip_zero_grad
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch  # > 0: token-budget micro-batches
        self.shard = Shard.for_stage(
            pipeline_stage_layers(model_cfg.num_layers, par),
            dims.pp_rank,
            dims.tp_rank,
            dims.tp_size,
            dims.etp_rank,
            dims.etp_size,
        )
        self.vocab_shard = (
            VocabShard(dims.tp_rank * model_cfg.vocab_size // dims.tp_size, dims.tp_group)
            if dims.tp_size > 1
            else None
        )
        sp = dims.tp_size > 1  # megatron refuses MoE + TP training without sequence parallelism
        with span("learner model"):
            self.gpt, self.tcfg = build.build_model(model_cfg, par, sequence_parallel=sp)
        self.token_multiple = FP8_TOKEN_MULTIPLE if model_cfg.precision == "fp8" else 1
        if init_weights is not None:
            with span("init load"):
                self.load_canonical(init_weights)
        self.last_expert_load: dict[int, list[float]] = {}  # set by router_monitor_metrics
        # per-layer router-gradient monitor of the update passes (moe_rl/monitor/router_grad.py)
        # (its structural blackout expectation follows the gating megatron actually built)
        self.monitor = (
            RouterGradMonitor(
                model_cfg.moe_layers,
                model_cfg.num_experts,
                model_cfg.moe_router_topk,
                monitor_margin_eps,
                pre_softmax=self.tcfg.moe_router_pre_softmax,
                aux_loss=self.tcfg.moe_router_load_balancing_type != "none",
                device=self.device,
                spec=RouterSpec.from_model(model_cfg),
                shared_expert=model_cfg.moe_shared_expert_ffn_hidden_size > 0,
            )
            if monitor
            else None
        )
        # Every model gets its own replay controller (megatron's RouterReplay instances are
        # per router; the controller keeps the policy's and the reference's state apart).
        self.route_header = RouteHeader.for_model(model_cfg)
        seq_shard = SeqShard(
            dims.tp_rank, dims.tp_size, dims.tp_group
        )  # SP: each TP rank routes S / TP positions
        self.replay = RouteReplay(
            self.gpt,
            self.route_header,
            dims.ep_size,
            model_cfg.recompute,
            seq_shard,
            dims.pp_group,
            monitor=self.monitor,
        )
        # The reference policy is a frozen copy of the initial weights (for the KL term).
        self.ref, self.ref_replay = None, None
        if with_reference:
            self.ref, _ = build.build_model(model_cfg, par, sequence_parallel=sp)
            self.ref.load_state_dict(self.gpt.state_dict())
            self.ref.requires_grad_(False).eval()
            self.ref_replay = RouteReplay(
                self.ref, self.route_header, dims.ep_size, model_cfg.recompute, seq_shard, dims.pp_group
            )
        with span("learner optimizer"):  # grad buffers, the optimizer's main params and state
            self.ddp = build.wrap_ddp(self.gpt, self.tcfg, par)
            self.optimizer = build.build_optimizer(self.ddp, optim, par)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live: batches move here once per pass."""
        return next(self.gpt.parameters()).device

    # ---- weights -------------------------------------------------------------------------
    def load_canonical(self, full: Mapping[str, torch.Tensor] | StoredWeights) -> None:
        """Copy canonical weights into this rank's shard; errors name the tensor. From
        ``StoredWeights`` only this rank's tensors and TP slices are read, one parameter at a
        time, in the stored dtype (converted by the copy): the rank never holds more than its
        shard and one parameter's piece (docs/design.md 2.2)."""
        params = self._named_weights()
        local = te_name_map(list(params))  # TE fuses norms into linears: its names -> the local spec's
        m, ep_rank, ep_size = self.model_cfg, self.dims.ep_rank, self.dims.ep_size
        opened = full if isinstance(full, StoredWeights) else nullcontext()
        with torch.no_grad(), opened:
            for name, p in params.items():
                t = canonical_to_megatron(full, [local[name]], m, ep_rank, ep_size, self.shard)[local[name]]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"weight for {name} has shape {tuple(t.shape)}, the model expects {tuple(p.shape)}"
                    )
                p.copy_(t)

    def iter_canonical_layers(
        self, bound_bytes: int | None = None, engines: ShardOf | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The canonical weights (every expert) one piece at a time, identical on every rank: the
        embedding, each decoder layer (its experts in pieces of at most ``bound_bytes``, default
        ``parallel.sync_bucket_mib``), then the final norm and lm_head (``weights/stream.py``).
        The weight sync source; a rank never holds more than one gathered piece. Collective: every
        rank must consume the whole iterator, in step. ``engines`` (world rank -> the engine
        shard it hosts, colocated): each rank gets only its engine shard's part of each piece,
        from the ranks that hold it (``weights/slice_stream.py``)."""
        bound = self.par.sync_bucket_mib << 20 if bound_bytes is None else bound_bytes
        tensors = {n: p.detach() for n, p in self._named_weights().items()}
        if engines is None:
            return self._stream(tensors, bound)
        local = rename_to_local(tensors)
        return stream_engine_slices(local, self.model_cfg, self.dims, self.shard, engines, bound)

    def _named_weights(self) -> dict[str, torch.Tensor]:
        """Parameters plus the routers' expert-bias buffers (canonical weights without a gradient:
        ``e_score_correction_bias``, frozen or moved by megatron, moe_rl/learner/build.py)."""
        out = dict(self.gpt.named_parameters())
        out.update({n: b for n, b in self.gpt.named_buffers() if n.endswith("mlp.router.expert_bias")})
        return out

    def export_canonical(self) -> dict[str, torch.Tensor]:
        """Full canonical weights on every rank (checkpoint exports); tensors nothing had to
        gather are views of the live weights."""
        return {k: v for chunk in self.iter_canonical_layers() for k, v in chunk.items()}

    def _gather_canonical(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's megatron tensors (by parameter name) -> full canonical dict on every rank."""
        return {k: v for chunk in self._stream(tensors) for k, v in chunk.items()}

    def _stream(
        self, tensors: dict[str, torch.Tensor], bound_bytes: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The canonical stream of this rank's tensors (by parameter name); TE names are renamed
        to the local spec's first (same tensors), the names the stream's mapping knows."""
        bound = self.par.sync_bucket_mib << 20 if bound_bytes is None else bound_bytes
        return stream_canonical(rename_to_local(tensors), self.model_cfg, self.dims, self.shard, bound)

    # ---- passes --------------------------------------------------------------------------
    def _check_replicated(self, tokens_BS: torch.Tensor) -> None:
        """TP and PP ranks must be given the same sequences (megatron computes one model over them);
        a different batch would give silently wrong log-probs. One tiny MAX all-reduce."""
        if self.dims.mp_group is None:
            return
        weights_S = torch.arange(1, tokens_BS.shape[1] + 1, dtype=torch.float64, device=tokens_BS.device)
        sig = torch.stack(
            [
                tokens_BS.new_tensor(float(tokens_BS.numel()), dtype=torch.float64),
                (tokens_BS.double() * weights_S).sum(),
            ]
        )
        both = torch.cat([sig, -sig]).to(comm_device(self.dims.mp_group))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.dims.mp_group)
        if not torch.equal(both[:2], -both[2:]):
            raise RuntimeError(
                "model-parallel (tensor/pipeline) ranks were given different token batches; "
                "TP/PP ranks of one data-parallel rank must see the same data "
                "(shard prompts by DP rank)"
            )

    def _schedule(
        self,
        model,
        replay: RouteReplay,
        micro_batches: list[TrainBatch],
        loss_fn,
        forward_only: bool,
        plan: PassPlan | None,
        monitor: bool = False,
    ) -> tuple[list, RoutingOutcome]:
        """megatron's schedule over micro-batches, inside one replay pass: (its outputs, routing)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            tokens_BS = mb.tokens_BS
            pos_BS = torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)
            with replay.micro_batch(mb, tokens_BS.shape[1]):
                out = model(tokens_BS, pos_BS, None)  # logits on the last stage, hidden states before it
            return out, partial(loss_fn, mb)  # megatron calls the loss on the last stage only

        with replay.run(plan, with_backward=not forward_only, monitor=monitor) as p:
            outs = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=int(micro_batches[0].tokens_BS.shape[1]),
                micro_batch_size=int(micro_batches[0].tokens_BS.shape[0]),
                forward_only=forward_only,
            )
        return outs, p.outcome or RoutingOutcome()

    def _micro_batches(
        self, batch: TrainBatch, micro_batch_size: int
    ) -> tuple[list[TrainBatch], torch.Tensor | None]:
        """The pass's micro-batches: ``micro_batch_size`` sequences each, or by token budget
        (``max_tokens_per_micro_batch``, sorted by length), then with the order to undo it."""
        if self.max_tokens_per_micro_batch > 0:
            return batch.micro_batches_by_tokens(
                self.max_tokens_per_micro_batch, self.token_multiple, self.dims.tp_size
            )
        return batch.micro_batches(micro_batch_size, self.token_multiple, self.dims.tp_size), None

    @torch.no_grad()
    def forward_logprobs(
        self,
        batch: TrainBatch,
        temperature: float,
        micro_batch_size: int,
        plan: PassPlan | None = None,
        reference: bool = False,
    ) -> LogprobOutput:
        """Log-probs, entropies and sum_v pi(v)^2 (OTB's energy term, from the same softmax) of
        the batch's sequences (policy, or the frozen reference), each [B, S], and the pass's
        routing outcome. ``plan`` runs the pass under routing replay (its routes are
        ``batch.routes``); the batch moves to the model's device once, here."""
        model, replay = (self.ref, self.ref_replay) if reference else (self.ddp, self.replay)
        if model is None:
            raise RuntimeError("reference log-probs requested but the learner has no reference model")
        model.eval()

        def collect(mb, logits_BSV):
            st = token_stats(mb, logits_BSV, temperature, self.vocab_shard)
            return logits_BSV.new_zeros(()), logits_BSV.new_zeros((), dtype=torch.int64), st.fields()

        batch = batch.to(self.device)
        self._check_replicated(batch.tokens_BS)
        mbs, order_B = self._micro_batches(batch, micro_batch_size)
        outs, routing = self._schedule(model, replay, mbs, collect, True, plan)
        S = batch.tokens_BS.shape[1]

        cols = [int(mb.seq_lens_B.max()) for mb in mbs]  # real columns: padding for TP/FP8 is cut off

        def gather(key: str) -> torch.Tensor:  # micro-batches were trimmed (and padded): back to S
            return torch.cat([torch.nn.functional.pad(o[key][:, :c], (0, S - c)) for o, c in zip(outs, cols)])

        stats = {k: gather(k) for k in outs[0]} if self.dims.is_last_stage else None
        if (
            order_B is not None
        ):  # token-budget micro-batches: statistics and recorded routes back in batch order
            undo_B = torch.argsort(order_B)
            stats = {k: v[undo_B.to(v.device)] for k, v in stats.items()} if stats is not None else None
            if routing.recorded is not None:
                routing = dataclasses.replace(routing, recorded=routing.recorded.select(undo_B))
        if self.dims.pp_size > 1:
            stats = broadcast_stats(stats, self.dims)
        return LogprobOutput(TokenStats(**stats), routing)

    def forward_backward(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        temperature: float,
        micro_batch_size: int,
        plan: PassPlan | None = None,
    ) -> tuple[list, RoutingOutcome]:
        """Gradients of the minibatch loss, reduced over data-parallel ranks; per-micro-batch loss
        metrics and the pass's routing outcome (metrics under ``routing/update_``). The router
        monitor, if any, observes this pass.

        ``batch`` must hold ``loss_mask_BS``; the normaliser passed to the loss is the number of
        loss tokens summed over all data-parallel ranks."""
        from megatron.core.distributed import finalize_model_grads

        self.ddp.train()
        batch = batch.to(self.device)
        self._check_replicated(batch.tokens_BS)
        normalizer = batch.loss_mask_BS.sum().to(torch.float64)
        if dist.is_initialized():
            dist.all_reduce(normalizer, group=self.dims.dp_group)
        normalizer = normalizer.clamp(min=1.0).float()

        def compute(mb, logits_BSV):
            st = token_stats(mb, logits_BSV, temperature, self.vocab_shard)
            loss, metrics = loss_fn(mb, st, normalizer)
            if not torch.isfinite(loss):  # never backpropagate NaN/Inf into the weights
                raise FloatingPointError(
                    f"non-finite loss {float(loss)} in a micro-batch of "
                    f"{int(mb.loss_mask_BS.sum())} loss tokens; no update was applied"
                )
            return loss, mb.loss_mask_BS.sum().int(), metrics

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        mbs, _ = self._micro_batches(batch, micro_batch_size)  # the loss is a sum: any order
        if plan is not None:
            plan = dataclasses.replace(plan, prefix="routing/update_")
        loss_metrics, routing = self._schedule(self.ddp, self.replay, mbs, compute, False, plan, monitor=True)
        if (
            self.monitor is not None
        ):  # local sums: with the distributed optimizer only a shard survives finalize
            self.monitor.add_router_grads(self._router_grads_LEH())
        finalize_model_grads([self.ddp])  # sum over DP (scaling 1.0: the loss is already global)
        return (
            broadcast_metrics(loss_metrics, self.dims) if self.dims.pp_size > 1 else loss_metrics
        ), routing

    def _router_grads_LEH(self) -> torch.Tensor:
        """Router-weight gradients of every MoE layer; zero for layers of other pipeline stages."""
        layers = self._router_layers()
        first = layers[0].mlp.router.weight.main_grad
        grads_LEH = first.new_zeros((len(self.monitor.layer_ids), *first.shape))
        for lay in layers:
            grads_LEH[self.monitor.layer_ids.index(lay.layer_number - 1)] = lay.mlp.router.weight.main_grad
        return grads_LEH

    def _router_layers(self) -> list:
        return [layer for layer in self.gpt.decoder.layers if getattr(layer.mlp, "router", None) is not None]

    def router_monitor_metrics(self) -> dict[str, float]:
        """The step's router-monitor metrics: the accumulated statistics and router-weight
        gradients summed over data-parallel ranks in one all-reduce (and the per-layer maxima in
        one tiny max-reduce), then per-layer values; resets. With TP the sum also runs over the
        TP ranks: under sequence parallelism each routes (and backpropagates) only its own block
        of positions, so their statistics and router-weight gradients are disjoint parts."""
        if self.monitor is None or self.monitor.router_grad_LEH is None:
            return {}
        stats, max_L, grads_LEH = self.monitor.stats_LXW, self.monitor.max_L, self.monitor.router_grad_LEH
        packed = torch.cat([stats.flatten().to(grads_LEH.device), grads_LEH.flatten()])
        max_L = max_L.clone()
        if dist.is_initialized():
            for group in (
                self.dims.tp_dp_group,
                self.dims.pp_group,
            ):  # PP: each stage holds its own layers' rows
                if group is not None:
                    dist.all_reduce(packed, group=group)
                    dist.all_reduce(max_L, op=dist.ReduceOp.MAX, group=group)
        n = stats.numel()
        reduced = packed[:n].view_as(stats).cpu()
        out = self.monitor.finalize(reduced, max_L.cpu(), packed[n:].view_as(grads_LEH).cpu())
        load_LE = expert_load_LE(reduced, self.monitor.E)
        self.last_expert_load = {lid: load_LE[i].tolist() for i, lid in enumerate(self.monitor.layer_ids)}
        self.monitor.reset()
        return out

    def expert_load(self) -> dict[int, list[float]]:
        """The last step's per-expert load per MoE layer (``expert_load_LE``), for
        ``run_dir/expert_load.jsonl``; empty without the monitor."""
        return self.last_expert_load

    def update(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        temperature: float,
        micro_batch_size: int,
        lr: float,
        plan: PassPlan | None = None,
    ) -> UpdateOutput:
        """One optimizer step over a minibatch; with ``optim.skip_zero_grad`` skipped when its
        gradient is exactly zero on every rank (every token rejected or of zero advantage): Adam
        would still move the weights by its momentum (and decay them) on a zero gradient."""
        loss_metrics, routing = self.forward_backward(batch, loss_fn, temperature, micro_batch_size, plan)
        if self.skip_zero_grad and not self._any_gradient():
            return UpdateOutput(0.0, loss_metrics, routing, skipped=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = self.optimizer.step()
        if not ok or grad_norm is None or not math.isfinite(float(grad_norm)):
            raise FloatingPointError(f"optimizer step refused: gradient norm {grad_norm} (NaN/Inf)")
        return UpdateOutput(float(grad_norm), loss_metrics, routing)

    def _any_gradient(self) -> bool:
        """Whether any rank holds a nonzero gradient entry: the local max |g| (foreach kernels, not
        one per tensor; the local, pre-reduction gradients where the distributed optimizer keeps
        only a shard of the reduced ones: a zero reduced gradient with nonzero local ones would
        need exact cancellation), then one MAX all-reduce of a flag over every rank (DP, TP, PP and
        EP hold different parts)."""
        grads = [p.main_grad for p in self.gpt.parameters() if getattr(p, "main_grad", None) is not None]
        local_max = torch.nn.utils.get_total_norm(grads, norm_type=math.inf) if grads else torch.zeros(())
        # NaN != 0: a NaN gradient goes on to the optimizer, which refuses it (never skipped silently)
        flag = (local_max != 0).to(torch.float32).reshape(1).to(comm_device(None))
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def canonical_grads(self) -> dict[str, torch.Tensor]:
        """Reduced gradients in canonical names, every expert gathered (needs the plain DDP
        optimizer: the distributed optimizer keeps only a shard of each reduced gradient)."""
        if self.par.distributed_optimizer:
            raise RuntimeError("canonical_grads needs parallel.distributed_optimizer=false")
        return self._gather_canonical(
            {n: p.main_grad.detach().clone() for n, p in self.gpt.named_parameters()}
        )
