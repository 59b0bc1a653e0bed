"""The step's rollouts, scored, in generation rounds: DAPO's dynamic sampling
(``algo.dynamic_sampling``, docs/sampling.md).

A round generates and scores the next ``rollout.prompts_per_step`` prompts of the data cursor (a
data-parallel rank: its share). A group whose filter values are all equal carries no signal (its
GRPO, RLOO and OTB advantages are all 0); with dynamic sampling on it is dropped and rounds go on
until every data-parallel rank holds its share of groups with signal or ``max_rounds`` rounds were
generated (the ranks agree on each round: one tiny all-reduce, since an engine's generation may be
collective). The step then trains on exactly its configured groups: the first ones with signal, and
when the cap was reached, topped up with dropped ones (all-zero advantages; every rank's update
keeps one shape) and ``sampling/cap_reached`` = 1. Off, a step is one round trained whole, and the
same metrics say how many of its groups carried signal.

Each round takes the next index of the data cursor (the prompts and the generation seed of that
index): a plain run's index is its step; a dynamic run's checkpoint stores the cursor, so a resume
draws the prompts the uninterrupted run would have.

Shape suffixes: B sequences, S positions, P prompt groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_rl.config.dynamic_sampling import DynamicSamplingConfig
from moe_rl.dist import comm_device
from moe_rl.metrics import Max, Mean, Sum, merge_metrics
from moe_rl.tasks.task import StepScores
from moe_rl.types import RolloutBatch


def groups_with_signal(values_B: torch.Tensor, group_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    """bool [P]: group p's values are not all equal (exact comparison: max > min). A group with no
    samples has none."""
    v_B = values_B.to(torch.float64)
    g_B = group_B.to(v_B.device).long()
    top_P = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=v_B.device)
    low_P = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=v_B.device)
    top_P = top_P.scatter_reduce(0, g_B, v_B, "amax")
    low_P = low_P.scatter_reduce(0, g_B, v_B, "amin")
    return top_P > low_P


def pad_to(x: torch.Tensor, length: int, value) -> torch.Tensor:
    """``x`` ([B, S, ...]) right-padded along dim 1 to ``length`` with ``value``."""
    if x.shape[1] == length:
        return x
    pad = torch.full((x.shape[0], length - x.shape[1], *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch of ``batches``' sequences in order: [B, S, ...] fields right-padded to the longest
    S (tokens with ``pad_id``, every other field with 0 / False, as the engines leave positions
    outside the response), group ids renumbered so each batch's groups follow the last one's."""
    if len(batches) == 1:
        return batches[0]
    first, length = batches[0], max(b.tokens_BS.shape[1] for b in batches)
    fields: dict = {}
    for f in dataclasses.fields(first):
        value = getattr(first, f.name)
        if not isinstance(value, torch.Tensor):
            continue
        parts = [getattr(b, f.name) for b in batches]
        if value.dim() >= 2:
            parts = [pad_to(x, length, pad_id if f.name == "tokens_BS" else 0) for x in parts]
        fields[f.name] = torch.cat(parts)
    offsets, groups = 0, []
    for b in batches:
        groups.append(b.group_B + offsets)
        offsets += int(b.group_B.max()) + 1 if b.num_seqs else 0
    fields["group_B"] = torch.cat(groups)
    metrics: dict = {}
    for b in batches:
        metrics = merge_metrics(metrics, b.engine_metrics)
    routes = [r for b in batches for r in b.routes]
    # the route rows' provenance (per sample, beside its routes): all batches carry it or none
    provs = [b.route_prov for b in batches]
    prov = None if any(p is None for p in provs) else [p for ps in provs for p in ps]
    return dataclasses.replace(first, routes=routes, route_prov=prov, engine_metrics=metrics, **fields)


def take_groups(batch: RolloutBatch, scores: StepScores, prompts: list, groups: list[int]):
    """The sequences of ``groups`` (in that order), their scores and prompts; group ids 0.. in order."""
    n = batch.num_seqs // max(len(prompts), 1)
    idx_B = torch.tensor([g * n + j for g in groups for j in range(n)], dtype=torch.long, device="cpu")
    picked = batch.select(idx_B)
    picked = dataclasses.replace(
        picked, group_B=torch.arange(len(groups), device=picked.group_B.device).repeat_interleave(n)
    )
    return picked, scores.select(idx_B.to(scores.rewards_B.device)), [prompts[g] for g in groups]


class Collected(NamedTuple):
    """The step's batch to train (its prompts, scores) and its metrics: the reward metrics of every
    round merged, and the sampling ones."""

    prompts: list
    batch: RolloutBatch
    scores: StepScores
    metrics: dict
    rounds: int  # generation rounds: the data cursor advanced by this many


Round = Callable[[int], tuple[list, RolloutBatch]]  # data-cursor index -> prompts, rollout
Score = Callable[[list, RolloutBatch], StepScores]


def collect(
    ds: DynamicSamplingConfig, generate: Round, score: Score, cursor: int, pad_id: int, dp_group=None
) -> Collected:
    """Rounds from data-cursor index ``cursor`` on until the step has its groups (module doc)."""
    kept: list = []  # (batch, scores, prompts) of the groups with signal, in generation order
    dropped: list = []  # the same of the groups without
    target = generated = with_signal = tokens = 0
    metrics: dict = {}
    engine_metrics: dict = {}  # the engines' own (agent/*, a split run's waits): every round's, once
    rounds = 0
    while True:
        prompts, batch = generate(cursor + rounds)
        rounds += 1
        engine_metrics = merge_metrics(engine_metrics, batch.engine_metrics)
        scores = score(prompts, batch)
        metrics = merge_metrics(metrics, scores.metrics)  # reward/*: every sample generated
        target = target or len(prompts)
        signal_P = groups_with_signal(scores.values(ds.filter), batch.group_B, len(prompts)).cpu()
        # the groups the batch holds (rollout.mode=async drops a group with a stale sample whole)
        generated += int(torch.unique(batch.group_B).numel())
        with_signal += int(signal_P.sum())
        tokens += int(batch.response_lens_B.sum())
        if not ds.enabled:  # one round, trained whole
            kept.append((batch, scores, prompts))
            break
        groups = signal_P.nonzero().flatten().tolist()
        if groups:
            kept.append(take_groups(batch, scores, prompts, groups))
        empty = (~signal_P).nonzero().flatten().tolist()
        if empty:
            dropped.append(take_groups(batch, scores, prompts, empty))
        short = torch.tensor([float(with_signal < target)], device="cpu")
        if dist.is_initialized():  # every rank generates as long as one still lacks groups
            short = short.to(comm_device(dp_group))
            dist.all_reduce(short, op=dist.ReduceOp.MAX, group=dp_group)
        if not short.item() or rounds >= ds.max_rounds:
            break
    cap = ds.enabled and with_signal < target
    parts = kept if not ds.enabled else _fill(kept, dropped, target)
    # a round split into kept and dropped groups would count its engine metrics once per part
    batch = dataclasses.replace(concat_batches([p[0] for p in parts], pad_id), engine_metrics=engine_metrics)
    scores = _cat_scores([p[1] for p in parts], metrics)
    prompts = [q for p in parts for q in p[2]]
    trained = min(with_signal, target) if ds.enabled else with_signal
    metrics = {
        **metrics,
        "sampling/rounds": Max(float(rounds)),
        "sampling/groups_generated": Sum(float(generated)),  # with samples in the batch
        "sampling/groups_kept": Sum(float(trained)),  # trained groups with signal
        # all_equal: every sample of the group got one filter value (dropped when on)
        "sampling/groups_dropped_all_equal": Sum(float(generated - with_signal)),
        "sampling/useful_frac": Mean(float(with_signal), float(generated)),
        "sampling/cap_reached": Max(float(cap)),
        "sampling/response_tokens_generated": Sum(float(tokens)),
        "sampling/useful_token_frac": Mean(useful_tokens(batch, scores, ds.filter), float(tokens)),
    }
    return Collected(prompts, batch, scores, metrics, rounds)


def _fill(kept: list, dropped: list, target: int) -> list:
    """The first ``target`` groups with signal, topped up with dropped groups (the cap was reached)."""
    out, have = [], 0
    for part in [*kept, *dropped]:
        prompts = part[2]
        if have >= target:
            break
        need = target - have
        if len(prompts) > need:
            batch, scores, _ = part
            part = take_groups(batch, scores, prompts, list(range(need)))
        out.append(part)
        have += len(part[2])
    return out


def _cat_scores(parts: list[StepScores], metrics: dict) -> StepScores:
    exact = [s.exact_match_B for s in parts]
    return StepScores(
        torch.cat([s.rewards_B for s in parts]),
        torch.cat([s.accuracy_B for s in parts]),
        torch.cat(exact) if all(e is not None for e in exact) else None,
        metrics,
    )


def useful_tokens(batch: RolloutBatch, scores: StepScores, filter_key: str) -> torch.Tensor:
    """The response tokens of ``batch``'s groups with signal (group ids 0..P-1, n rows each): over
    the tokens generated, the useful token fraction (docs/sampling.md 5)."""
    num_groups = int(batch.group_B.max()) + 1 if batch.num_seqs else 0
    signal_P = groups_with_signal(scores.values(filter_key), batch.group_B, num_groups)
    signal_B = signal_P[batch.group_B.to(signal_P.device).long()]
    return (batch.response_lens_B.to(signal_B.device) * signal_B).sum().double()


# public names for over-sampling's rounds (moe_rl/step/oversample.py), which train what these build
fill_groups, cat_scores = _fill, _cat_scores
