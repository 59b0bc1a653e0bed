"""Routing agreement of one pass, and the routes it recorded: collected per micro-batch (the
native Top-K the router computes anyway, kept without any arithmetic), computed once when the
pass ends, over all its micro-batches and layers in a few vectorized ops.

On rows whose target came from a record: per layer, the fraction whose native expert set differs
from the given one (``flip_router_frac``) and overlap@K; per token, whether any layer differs and
how many (``flip_token_frac``, ``flip_layers_per_token``); with ``num_lags`` the (token, layer)
flip rate split by each row's version lag (``flip_frac_lag<k>``, docs/math.md 2.7); with
``margins`` split by the learner's Top-K margin (``flip_frac_margin_<bucket>``, and each bucket's
share of the pairs ``margin_frac_<bucket>``, docs/math.md 7.2). The same
comparison against the old pass's native routes is the router monitor's update-induced flip rate
(``router_grad/update_flip_*``).

Sequence parallelism (TP > 1): TP rank r routes rows [r N / TP, (r + 1) N / TP) of a micro-batch
(sequence-major rows, one contiguous block); counts are summed over the TP group at the end and
the recorded routes all-gathered back. Pipeline parallelism (PP > 1): each stage holds its own
layers; the per-token indicators and the recorded routes (other stages' layers zero) are summed
over the stages in one all-reduce, the per-layer sums likewise (zero where a stage does not own
the layer), so every stage returns the same keys and values. All collectives run after the
pipeline schedule (inside it they would interleave with its send/recv).

Shape suffixes: N rows, L layers (``Lf`` every MoE layer of the model), K top-k, B sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_rl.dist import all_gather_rows, all_reduce_sum, comm_device
from moe_rl.maths.versions import sum_by_lag
from moe_rl.metrics import Mean
from moe_rl.routing.record import RouteBatch, RouteHeader
from moe_rl.routing.row_layout import unlayout
from moe_rl.routing.server import ReplayError
from moe_rl.routing.topk_overlap import MARGIN_BUCKETS, flips_by_margin, topk_agreement


@dataclass(frozen=True)
class RoutingOutcome:
    """What a pass's routing produced: agreement metrics (``Mean`` values, local to this
    data-parallel rank) and, when asked to keep them, the native routes in batch order."""

    metrics: dict = field(default_factory=dict)
    recorded: RouteBatch | None = None


@dataclass(frozen=True)
class SeqShard:
    """Sequence parallelism: this TP rank, the TP size and group (rank 0 of 1 without)."""

    rank: int = 0
    size: int = 1
    group: object = None

    def local_rows(self, t_N: torch.Tensor) -> torch.Tensor:
        """The rows this rank routes (one contiguous block of sequence-major rows)."""
        if self.size == 1:
            return t_N
        if t_N.shape[0] % self.size:
            raise ReplayError(f"{t_N.shape[0]} rows do not split over {self.size} sequence-parallel ranks")
        return t_N.chunk(self.size)[self.rank].contiguous()


class AgreementCollector:
    def __init__(
        self, header: RouteHeader, layer_ids: list[int], seq_shard: SeqShard, stage_group=None
    ) -> None:
        """``layer_ids``: this model's (stage's) MoE layers, in hook order."""
        self.header, self.layer_ids, self.sp, self.stage_group = (
            header,
            list(layer_ids),
            seq_shard,
            stage_group,
        )
        self.pos = [header.layer_ids.index(lid) for lid in layer_ids]  # positions in the full record
        self.begin_pass("routing/", False)

    def begin_pass(
        self,
        prefix: str,
        keep_native: bool,
        old_prefix: str = "router_grad/update_",
        num_lags: int = 0,
        margins: bool = False,
        num_turns: int = 0,
    ) -> None:
        """``num_lags`` > 0: every micro-batch with targets comes with its rows' version lags
        (each < num_lags) and the flips against the targets are also split by lag; ``margins``:
        with its rows' Top-K margins, and the flips are also split by margin bucket."""
        self.prefix, self.old_prefix, self.keep_native = prefix, old_prefix, keep_native
        self.num_lags, self.margins, self.num_turns = num_lags, margins, num_turns
        self._target_lags: list[torch.Tensor] = []
        self._target_turns: list[torch.Tensor] = []
        self._target_margins: list[torch.Tensor] = []  # float [N, L] per micro-batch with targets
        self._native: list[tuple[torch.Tensor, torch.Tensor]] = []  # (native [N, L, K], seq_lens_B)
        self._vs_target: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # native, target, rec_N
        self._vs_old: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # the layout's counts (host tensors, like the layout itself)
        self._missing = [torch.zeros((), dtype=torch.float64, device="cpu")] * 2
        self._counted_missing = False
        self._group_violations: list[tuple[torch.Tensor, torch.Tensor]] = []  # (violating, replayed)

    def add(
        self,
        native_NLK: torch.Tensor,
        seq_lens_B: torch.Tensor,
        target=None,
        old=None,
        target_lag=None,
        margin_NL=None,
        target_turn=None,
    ) -> None:
        """One micro-batch: this rank's native routes, and (target_NLK, recorded_N) pairs to
        compare them with (both already this rank's rows); ``target_lag``: int [N] the rows'
        version lags (with ``num_lags``); ``margin_NL``: the rows' Top-K margins (with ``margins``)."""
        if self.keep_native:
            self._native.append((native_NLK, seq_lens_B))
        if target is not None:
            self._vs_target.append((native_NLK, *target))
            if self.num_lags:
                if target_lag is None:
                    raise ReplayError("flips by version lag: a micro-batch came without its rows' lags")
                self._target_lags.append(target_lag)
            if self.num_turns:
                if target_turn is None:
                    raise ReplayError("flips by turn: a micro-batch came without its rows' turns")
                self._target_turns.append(target_turn)
            if self.margins:
                if margin_NL is None:
                    raise ReplayError("flips by margin: a micro-batch came without its rows' margins")
                self._target_margins.append(margin_NL)
        if old is not None:
            self._vs_old.append((native_NLK, *old))

    def add_group_violations(self, violating: torch.Tensor, replayed: torch.Tensor) -> None:
        """One layer of one micro-batch under group-limited routing: replayed rows whose ids leave
        the token's own selected groups (accepted: the engine chose them), and replayed rows."""
        self._group_violations.append((violating, replayed))

    def add_missing(self, counts: dict[str, torch.Tensor]) -> None:
        """The layout's counts of rows expected and rows without a recorded route."""
        self._missing[0] = self._missing[0] + counts["rows_missing"]
        self._missing[1] = self._missing[1] + counts["rows_expected"]
        self._counted_missing = True

    # ---- once per pass -------------------------------------------------------------------------
    def finish(self) -> RoutingOutcome:
        metrics: dict = {}
        if self._counted_missing:  # the same layout on every TP rank: not sharded
            metrics[f"{self.prefix}missing_frac"] = Mean(*self._missing)
        per_layer, tokens = {}, []
        if self._vs_target:
            differs_NL = self._compare(
                self._vs_target, f"{self.prefix}flip_router_frac", per_layer, f"{self.prefix}overlap_at_k"
            )
            tokens.append((self.prefix, differs_NL))
            if self.margins:  # this stage's layers: summed over the stages with the per-layer sums
                per_layer.update(self._flips_by_margin(differs_NL))
        if self._vs_old:
            tokens.append(
                (self.old_prefix, self._compare(self._vs_old, f"{self.old_prefix}flip_frac", per_layer))
            )
        natives = [n for n, _ in self._native]
        if self.stage_group is not None:
            natives, tokens, per_layer = self._join_stages(natives, tokens, per_layer)
        else:
            natives = [self._full_layers(n, dim=1) for n in natives]
            tokens = [(p, self._full_layers(d, dim=1)) for p, d in tokens]
        sharded = dict(per_layer)
        if self._group_violations:  # per (replayed token, MoE layer) pair
            v, n = (torch.stack(x).sum().double() for x in zip(*self._group_violations))
            sharded[f"{self.prefix}group_violation_frac"] = Mean(v, n)
        for prefix, differs_NL in tokens:
            n = torch.tensor(float(differs_NL.shape[0]), device=differs_NL.device)
            sharded[f"{prefix}flip_token_frac"] = Mean(differs_NL.any(1).float().sum(), n)
            sharded[f"{prefix}flip_layers_per_token"] = Mean(differs_NL.float().sum(), n)
        if self.num_lags and self._vs_target:  # tokens[0]: the targets', joined over the stages
            sharded.update(self._flips_by(tokens[0][1], self._target_lags, self.num_lags, "flip_frac_lag"))
        if self.num_turns and self._vs_target:  # turn 0 holds no row: its count is dropped
            by_turn = self._flips_by(tokens[0][1], self._target_turns, self.num_turns + 1, "")
            sharded.update(
                {
                    f"agent/flip_frac/turn{k}": by_turn[f"{self.prefix}{k}"]
                    for k in range(1, self.num_turns + 1)
                }
            )
        metrics.update(self._sum_sequence_shards(sharded))
        return RoutingOutcome(metrics, self._recorded(natives) if self.keep_native else None)

    def _flips_by(self, differs_NL: torch.Tensor, keys: list[torch.Tensor], num: int, name: str) -> dict:
        """(token, layer) pairs that differ from the targets, over the recorded rows of each value
        k < ``num`` of ``keys`` (their lags, or turns), as ``{prefix}{name}<k>`` (every MoE layer
        of the model: ``differs_NL`` is joined over the stages)."""
        rec_N = torch.cat([r for _, _, r in self._vs_target]).cpu()
        key_N = torch.cat(keys).cpu()[rec_N]
        flips_K = sum_by_lag(differs_NL.sum(1), key_N, num)
        pairs_K = sum_by_lag(torch.full_like(key_N, differs_NL.shape[1]), key_N, num).to(flips_K.device)
        return {f"{self.prefix}{name}{k}": Mean(flips_K[k], pairs_K[k]) for k in range(num)}

    def _flips_by_margin(self, differs_NL: torch.Tensor) -> dict:
        """Flip rate per margin bucket ((token, layer) pairs of recorded rows), and the bucket's share
        of all pairs."""
        device = differs_NL.device
        rec_N = torch.cat([r for _, _, r in self._vs_target]).to(device)
        margin_NL = torch.cat(self._target_margins).to(device)[rec_N]
        flips_M, pairs_M = flips_by_margin(differs_NL, margin_NL)
        total = pairs_M.sum()
        out = {}
        for m, name in enumerate(MARGIN_BUCKETS):
            out[f"{self.prefix}flip_frac_margin_{name}"] = Mean(flips_M[m], pairs_M[m])
            out[f"{self.prefix}margin_frac_{name}"] = Mean(pairs_M[m], total)
        return out

    def _compare(self, parts, name: str, out: dict, overlap_name: str | None = None) -> torch.Tensor:
        """Per-layer flip rates (and overlap@K) on recorded rows of every micro-batch; returns
        the rows that differ, bool [N_recorded, L]."""
        device = parts[0][0].device
        rec_N = torch.cat([r for _, _, r in parts]).to(device)
        native_NLK = torch.cat([n for n, _, _ in parts])[rec_N]
        target_NLK = torch.cat([t for _, t, _ in parts]).to(device)[rec_N]
        differs_NL, overlap_NL = topk_agreement(native_NLK, target_NLK)
        n = torch.tensor(float(differs_NL.shape[0]), device=device)
        flips_L, overlaps_L = differs_NL.float().sum(0), overlap_NL.sum(0)
        for i, lid in enumerate(self.layer_ids):
            out[f"{name}/layer{lid}"] = Mean(flips_L[i], n)
            if overlap_name:
                out[f"{overlap_name}/layer{lid}"] = Mean(overlaps_L[i], n)
        layers = len(self.layer_ids)
        out[name] = Mean(flips_L.sum(), n * layers)
        if overlap_name:
            out[overlap_name] = Mean(overlaps_L.sum(), n * layers)
        return differs_NL

    def _full_layers(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This stage's layers at their positions in the full record; other stages' are zero."""
        if len(self.pos) == len(self.header.layer_ids):
            return t
        shape = list(t.shape)
        shape[dim] = len(self.header.layer_ids)
        return t.new_zeros(shape).index_copy_(dim, torch.tensor(self.pos, device=t.device), t)

    def _join_stages(self, natives, tokens, per_layer):
        """PP: every layer on every stage. One all-reduce for routes and token indicators (each
        layer is non-zero on its own stage only), one for the per-layer metric sums."""
        group, device = self.stage_group, comm_device(self.stage_group)
        parts = [self._full_layers(n, 1) for n in natives] + [self._full_layers(d, 1) for _, d in tokens]
        if parts:
            flat = all_reduce_sum(torch.cat([p.reshape(-1).to(device, torch.int64) for p in parts]), group)
            joined = list(torch.split(flat, [p.numel() for p in parts]))
            natives = [j.view(p.shape).to(n.dtype) for j, p, n in zip(joined, parts, natives)]
            tokens = [
                (k, j.view(p.shape) > 0)
                for j, p, (k, _) in zip(joined[len(natives) :], parts[len(natives) :], tokens)
            ]
        key_sets: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(key_sets, sorted(per_layer), group=group)
        keys = sorted(set().union(*key_sets))
        if keys:
            zero = Mean(0.0, 0.0)
            vals = [
                torch.as_tensor(x).to(device=device, dtype=torch.float64).reshape(())
                for k in keys
                for x in (per_layer.get(k, zero).sum, per_layer.get(k, zero).count)
            ]
            packed = all_reduce_sum(torch.stack(vals), group)
            per_layer = {k: Mean(packed[2 * i], packed[2 * i + 1]) for i, k in enumerate(keys)}
        return natives, tokens, per_layer

    def _sum_sequence_shards(self, metrics: dict) -> dict:
        """TP: counts made on this rank's block of rows, summed over the TP group (one all-reduce)."""
        if self.sp.size == 1 or not metrics:
            return metrics
        keys = sorted(metrics)  # the same keys on every TP rank (same layers, same micro-batches)
        device = comm_device(self.sp.group)
        vals = [
            torch.as_tensor(x).to(device=device, dtype=torch.float64).reshape(())
            for k in keys
            for x in (metrics[k].sum, metrics[k].count)
        ]
        packed = all_reduce_sum(torch.stack(vals), self.sp.group)
        return {k: Mean(packed[2 * i], packed[2 * i + 1]) for i, k in enumerate(keys)}

    def _recorded(self, natives: list[torch.Tensor]) -> RouteBatch:
        """The native routes as records of the pass's sequences, in batch order."""
        if not natives:
            raise ReplayError("nothing was recorded")
        if self.sp.size > 1:  # every TP rank routed its own block of rows: join them (one all-gather)
            sizes = [n.shape[0] for n in natives]
            gathered = all_gather_rows(torch.cat(natives).contiguous(), self.sp.group).chunk(self.sp.size)
            blocks = [torch.split(g, sizes) for g in gathered]
            natives = [torch.cat([b[m] for b in blocks]) for m in range(len(natives))]
        parts = [
            unlayout(n.cpu(), lens_B, torch.zeros_like(lens_B), self.header)
            for n, (_, lens_B) in zip(natives, self._native)
        ]
        return RouteBatch(
            torch.cat([p.ids_NLK for p in parts]),
            torch.cat([p.rows_B for p in parts]),
            torch.cat([p.start_B for p in parts]),
            torch.cat([p.prompt_len_B for p in parts]),
            self.header,
        )
