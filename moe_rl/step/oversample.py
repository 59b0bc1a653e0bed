"""Over-sampling with early abort and partial rollouts (``algo.over_sampling``, docs/sampling.md 6).

A round starts ``ceil(factor * need)`` prompt groups (``need``: the groups the step trains, this data-
parallel rank's share), the partial rollouts pending from the last step among them, in one generate call
(flat: one row per sample, n = 1) whose ``EarlyAbort`` checks every ``check_every`` decode steps whether
enough groups are complete (every sample stopped or used ``rollout.max_new_tokens``; under
``algo.dynamic_sampling``: complete with signal, scored on a peek) and then aborts the rest. The step
trains on the first ``need`` complete groups in order (pending ones first: they are the oldest). The
other groups are dropped (``on_abort=drop``: counted, with the length bias) or kept pending
(``partial``): at the next round their unfinished samples are resumed under the engine's weights then,
each re-prefilled from prompt + response so far (``resume_rows``): every earlier token keeps the log-prob
and version it was sampled with, every earlier route row its ids and provenance, and the last earlier
token's row (the input of the first resumed token's forward) is the re-prefill's, ``REPREFILL``. A
pending group with a token more than ``rollout.max_staleness`` versions behind the round's weights is
dropped whole. The pending groups are resume state (``Pending.state_dict``, checkpointed per dp rank).
Shape suffixes: B sequences, S positions, R resumed rows, G groups.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_rl.config.dynamic_sampling import DynamicSamplingConfig
from moe_rl.config.over_sampling import OverSamplingConfig
from moe_rl.dist import comm_device
from moe_rl.maths.versions import lag_BS
from moe_rl.metrics import Max, Mean, Sum, merge_metrics
from moe_rl.rollout.base import EarlyAbort
from moe_rl.routing.provenance import REPREFILL, Provenance
from moe_rl.step.sampling import (
    Collected,
    Score,
    cat_scores,
    concat_batches,
    fill_groups,
    groups_with_signal,
    pad_to,
    take_groups,
    useful_tokens,
)
from moe_rl.types import Prompt, RolloutBatch

# (prompt token lists, data-cursor index, EarlyAbort) -> the flat batch (n = 1), versions stamped
Generate = Callable[[list[list[int]], int, EarlyAbort], RolloutBatch]
Draw = Callable[[int, int], list]  # (data-cursor index, count) -> that many prompts


def resume_rows(old: RolloutBatch, cont: RolloutBatch, pad_id: int) -> RolloutBatch:
    """R partial rows (``old``) joined with their continuations (``cont``: the engine's rows whose
    prompt is old's prompt + response so far): positions before old's end keep old's tokens,
    log-probs, versions and masks, the rest are cont's; route rows before old's last token are old's
    (the re-prefill's are discarded), from it on cont's, that row marked ``REPREFILL``. cont's
    route records may start at any row up to old's last token (an engine that omits the rows the
    caller holds, ``EarlyAbort.route_starts``: vLLM) or at row 0 (the built-in engine)."""
    R = old.num_seqs
    end_R = (old.prompt_lens_B + old.response_lens_B).cpu()
    length = max(old.tokens_BS.shape[1], cont.tokens_BS.shape[1])
    before_RS = torch.arange(length, device="cpu")[None, :] < end_R[:, None]
    fields: dict = {}
    for f in dataclasses.fields(cont):
        c = getattr(cont, f.name)
        if not isinstance(c, torch.Tensor) or c.dim() < 2:
            continue
        o = getattr(old, f.name)
        if o is None:
            raise ValueError(f"resume_rows: the continuation has {f.name} and the partial rows do not")
        fill = pad_id if f.name == "tokens_BS" else 0
        o, c = pad_to(o, length, fill), pad_to(c, length, fill)
        keep = before_RS.to(c.device).view(R, length, *[1] * (c.dim() - 2))
        fields[f.name] = torch.where(keep, o.to(c.device), c)
    ends = end_R.tolist()  # one row's route record at a time: the records are jagged
    # cont's first route row (T - 1 rows when whole), then the first one kept: old's last token's
    first = ((cont.prompt_lens_B + cont.response_lens_B).cpu() - 1).tolist()
    at = [e - 1 - (t - len(c)) for c, e, t in zip(cont.routes, ends, first)]
    bad = [r for r, (a, c) in enumerate(zip(at, cont.routes)) if not 0 <= a < len(c)]
    if bad:
        raise ValueError(
            f"resume_rows: row {bad[0]}'s continuation has no route row for position "
            f"{ends[bad[0]] - 1} (old's last token), whose row must be the re-prefill's"
        )
    routes = [torch.cat([o[: e - 1], c[a:]]) for o, c, e, a in zip(old.routes, cont.routes, ends, at)]
    prov = None
    if old.route_prov is not None and cont.route_prov is not None:
        prov = []
        for o, c, e, a in zip(old.route_prov, cont.route_prov, ends, at):
            tail = c.slice(a, c.num_rows)
            tail.source_N = tail.source_N.clone()
            tail.source_N[0] = REPREFILL
            prov.append(Provenance.cat([o.slice(0, e - 1), tail]))
    return dataclasses.replace(
        cont,
        prompt_lens_B=old.prompt_lens_B.to(cont.prompt_lens_B.device),
        response_lens_B=(old.response_lens_B.to(cont.response_lens_B.device) + cont.response_lens_B),
        group_B=old.group_B.to(cont.group_B.device),
        routes=routes,
        route_prov=prov,
        **fields,
    )


@dataclass
class Pending:
    """A data-parallel rank's groups carried from one round to the next (``on_abort=partial``): their
    prompts, their rows so far (n per group, group-major; ``group_B`` 0..G-1), and which rows are
    complete (stopped, or ``max_new_tokens`` long)."""

    prompts: list
    batch: RolloutBatch | None = None
    done_B: torch.Tensor | None = None

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def state_dict(self) -> dict:
        """Tensors, lists and numbers only (``torch.load(weights_only=True)`` reads it back); the
        batch's route provenance as plain tensors, its engine metrics left out (logged already)."""
        if self.batch is None:
            return {"prompts": []}
        b = self.batch.to("cpu")
        fields = {f.name: getattr(b, f.name) for f in dataclasses.fields(b) if f.name != "engine_metrics"}
        fields["route_prov"] = None if b.route_prov is None else [p.tensors() for p in b.route_prov]
        return {
            "prompts": [dataclasses.asdict(p) for p in self.prompts],
            "batch": fields,
            "done_B": self.done_B.cpu(),
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> Pending:
        if not state["prompts"]:
            return cls([])
        fields = dict(state["batch"])
        if fields.get("route_prov") is not None:
            fields["route_prov"] = [Provenance.from_tensors(t) for t in fields["route_prov"]]
        return cls([Prompt(**p) for p in state["prompts"]], RolloutBatch(**fields), state["done_B"])


def _rows(n: int, groups: list[int]) -> torch.Tensor:
    return (
        torch.tensor(groups, dtype=torch.long, device="cpu")[:, None] * n
        + torch.arange(n, device="cpu")[None, :]
    ).flatten()


def _take(batch: RolloutBatch, prompts: list, n: int, groups: list[int]) -> tuple[RolloutBatch, list]:
    """Groups ``groups`` (in order) of a group-major batch, ids renumbered 0.."""
    picked = batch.select(_rows(n, groups))
    group_B = torch.arange(len(groups), device=picked.group_B.device).repeat_interleave(n)
    return dataclasses.replace(picked, group_B=group_B), [prompts[g] for g in groups]


class _Round:
    """One generate call's requests: the pending groups' unfinished rows (resumed) and the new
    prompts' n rows each, and how the flat output becomes group-major batches again."""

    def __init__(self, pending: Pending, new: list, n: int, max_new: int, pad_id: int) -> None:
        self.pending, self.new, self.n, self.max_new, self.pad_id = pending, new, n, max_new, pad_id
        b = pending.batch
        self.resume_R = (
            (~pending.done_B).nonzero().flatten()
            if b is not None
            else torch.zeros(0, dtype=torch.long, device="cpu")
        )
        ids: list[list[int]] = []
        ends: list[int] = []
        if b is not None and self.resume_R.numel():
            ends = (b.prompt_lens_B + b.response_lens_B).cpu()[self.resume_R].tolist()
            toks = b.tokens_BS.cpu()[self.resume_R]
            ids = [row[:e].tolist() for row, e in zip(toks, ends)]  # prompt + response so far
        self.ids = ids + [p.prompt_ids for p in new for _ in range(n)]
        # the rows a resumed partial holds: all but its last token's (the re-prefill's, REPREFILL)
        self.route_starts = [e - 1 for e in ends] + [0] * (len(new) * n)
        used_R = (
            b.response_lens_B.cpu()[self.resume_R]
            if b is not None
            else torch.zeros(0, dtype=torch.long, device="cpu")
        )
        self.budget_B = torch.cat(
            [max_new - used_R, torch.full((len(new) * n,), max_new, device="cpu")]
        ).long()
        # the flat rows' groups: pending groups first, then the new prompts'
        pg_R = (
            b.group_B.cpu()[self.resume_R].long()
            if b is not None
            else torch.zeros(0, dtype=torch.long, device="cpu")
        )
        self.group_B = torch.cat(
            [pg_R, pending.num_groups + torch.arange(len(new), device="cpu").repeat_interleave(n)]
        )
        self.num_groups = pending.num_groups + len(new)
        self.need_G = torch.zeros(self.num_groups, dtype=torch.long, device="cpu").index_add_(
            0, self.group_B, torch.ones_like(self.group_B)
        )

    def complete_G(self, done_B: torch.Tensor) -> torch.Tensor:
        """bool [G]: every row of the group still generating in this call is done."""
        got_G = torch.zeros(self.num_groups, dtype=torch.long, device="cpu").index_add_(
            0, self.group_B, done_B.cpu().long()
        )
        return got_G >= self.need_G

    def groups(self, out: RolloutBatch | None) -> tuple[RolloutBatch, list, torch.Tensor]:
        """All the round's groups, group-major: (batch, prompts, done_B)."""
        p, n, R = self.pending, self.n, int(self.resume_R.numel())
        parts, done, order = [], [], []
        if p.batch is not None:
            kept_B = p.done_B.clone()
            kept = p.batch.select(kept_B)
            peek = out is not None and out.version_BS is None  # vLLM's peek: stamped after the call
            parts.append(dataclasses.replace(kept, version_BS=None) if peek else kept)
            done.append(torch.ones(int(kept_B.sum()), dtype=torch.bool, device="cpu"))
            order.append(kept_B.nonzero().flatten())
            if R:
                merged = resume_rows(
                    p.batch.select(self.resume_R), out.select(torch.arange(R, device="cpu")), self.pad_id
                )
                parts.append(merged)
                done.append(self._done(merged))
                order.append(self.resume_R)
        if self.new:
            fresh = out.select(torch.arange(R, out.num_seqs, device="cpu"))
            parts.append(fresh)
            done.append(self._done(fresh))
            order.append(p.num_groups * n + torch.arange(len(self.new) * n, device="cpu"))
        cat = concat_batches([x for x in parts if x.num_seqs], self.pad_id)
        perm_B = torch.argsort(torch.cat(order))
        batch = cat.select(perm_B)
        group_B = torch.arange(self.num_groups, device=batch.group_B.device).repeat_interleave(n)
        return dataclasses.replace(batch, group_B=group_B), [*p.prompts, *self.new], torch.cat(done)[perm_B]

    def _done(self, b: RolloutBatch) -> torch.Tensor:
        return _done(b, self.max_new)


def _done(b: RolloutBatch, max_new: int) -> torch.Tensor:
    """bool [B]: the row stopped, or used rollout.max_new_tokens (a resumed one: with its earlier tokens)."""
    return (b.finished_B | (b.response_lens_B >= max_new)).cpu()


@dataclass(frozen=True)
class OverSamplingPlan:
    """What a step's rounds need besides the callables (from the config, once per run)."""

    cfg: OverSamplingConfig  # algo.over_sampling
    ds: DynamicSamplingConfig  # algo.dynamic_sampling: with signal, in rounds
    need: int  # groups the step trains on this dp rank (rollout.prompts_per_step / dp)
    n: int  # rollout.samples_per_prompt
    max_new: int  # rollout.max_new_tokens: a resumed response's budget counts its earlier tokens
    max_staleness: int  # rollout.max_staleness: the oldest version lag a pending group may carry
    pad_id: int

    @classmethod
    def from_config(cls, cfg, dp_size: int, pad_id: int) -> OverSamplingPlan:
        """A data-parallel rank's plan (``cfg``: the ``RunConfig``), on a learner or a rollout rank."""
        r = cfg.rollout
        need = r.prompts_per_step // dp_size
        return cls(
            cfg.algo.over_sampling, cfg.algo.dynamic_sampling, need, r.samples_per_prompt, r.max_new_tokens,
            r.max_staleness, pad_id,
        )  # fmt: skip


class _Tally:
    """The step's counts, summed over rounds (the metrics at the end)."""

    def __init__(self) -> None:
        self.c = dict.fromkeys(
            ("generated", "with_signal", "kept", "surplus", "tokens", "aborted", "resumed", "stale")
            + ("dropped", "dropped_len"),
            0.0,
        )

    def add(self, **kw: float) -> None:
        for k, v in kw.items():
            self.c[k] += float(v)


def drop_stale(plan: OverSamplingPlan, pending: Pending, version: int) -> tuple[Pending, int]:
    """The pending groups without a token more than ``max_staleness`` versions behind ``version``
    (the round's weights, which the learner trains them against), and the samples dropped."""
    b = pending.batch
    if b is None or not plan.cfg.partial:
        return pending, 0
    lag_B = lag_BS(b.version_BS, b.response_mask_BS, version).amax(1).cpu()
    keep_G = ~(lag_B > plan.max_staleness).view(-1, plan.n).any(1)  # a group with a stale sample: whole
    if bool(keep_G.all()):
        return pending, 0
    groups = keep_G.nonzero().flatten().tolist()
    return _pending(plan, b, pending.prompts, pending.done_B, groups), int((~keep_G).sum()) * plan.n


def _pending(
    plan: OverSamplingPlan, batch: RolloutBatch, prompts: list, done_B: torch.Tensor, groups: list[int]
):
    if not groups:
        return Pending([])
    b, p = _take(batch, prompts, plan.n, groups)
    return Pending(p, b, done_B[_rows(plan.n, groups)])


def _signal(plan: OverSamplingPlan, score: Score, batch: RolloutBatch, prompts: list, groups: list[int]):
    """The complete ``groups``' batch, scores, prompts and bool [P] with signal (all true when
    dynamic sampling is off: any complete group will do)."""
    b, p = _take(batch, prompts, plan.n, groups)
    s = score(p, b)
    signal_P = groups_with_signal(s.values(plan.ds.filter), b.group_B, len(groups)).cpu()
    return b, s, p, signal_P


class RoundOut(NamedTuple):
    """One round's groups as the engine left them, group-major (the pending ones first): what the
    step decides on (``collect_over``), wherever the round was generated."""

    batch: RolloutBatch
    prompts: list
    done_B: torch.Tensor  # bool [B]: the row stopped or used rollout.max_new_tokens
    tokens: float  # response tokens sampled in this round
    resumed: int  # pending responses continued in this round


RunRound = Callable[[int, int, Pending], RoundOut]  # (data index, groups wanted, pending) -> round


def round_count(plan: OverSamplingPlan, want: int, pending: Pending) -> int:
    """New prompt groups a round starts: ``ceil(factor * need)`` with the pending ones, at least the
    ``want`` groups the step still lacks; none when the pending complete groups fill the step."""
    count = max(math.ceil(plan.cfg.factor * plan.need) - pending.num_groups, want - pending.num_groups, 0)
    if pending.batch is not None and int(pending.done_B.view(-1, plan.n).all(1).sum()) >= want:
        return 0  # the pending complete groups fill the step: no prompt is started for nothing
    return count


def generate_round(
    plan: OverSamplingPlan,
    generate: Generate,
    draw: Draw,
    score: Score,
    index: int,
    want: int,
    pending: Pending,
) -> RoundOut:
    """Round ``index``: the pending groups and ``round_count`` new ones in one generate call whose
    ``EarlyAbort`` stops it once ``want`` groups are complete (with signal under dynamic sampling).
    Where the engine runs: the rank itself (colocated) or its rollout rank (split)."""
    n, ds = plan.n, plan.ds
    count = round_count(plan, want, pending)
    rnd = _Round(pending, draw(index, count) if count else [], n, plan.max_new, plan.pad_id)

    def enough(done_B: torch.Tensor, peek) -> bool:
        complete_G = rnd.complete_G(done_B)
        if int(complete_G.sum()) < want:
            return False
        if not ds.enabled:
            return True
        b, p, d = rnd.groups(peek())
        groups = d.view(-1, n).all(1).nonzero().flatten().tolist()
        return int(_signal(plan, score, b, p, groups)[3].sum()) >= want

    out, tokens = None, 0.0
    if rnd.ids:
        out = generate(
            rnd.ids, index, EarlyAbort(plan.cfg.check_every, enough, rnd.budget_B, rnd.route_starts)
        )
        tokens = float(out.response_lens_B.sum())
    batch, prompts, done_B = rnd.groups(out)
    return RoundOut(batch, prompts, done_B, tokens, int(rnd.resume_R.numel()))


def remote_round(plan: OverSamplingPlan, batch: RolloutBatch, prompts: list, pending: Pending) -> RoundOut:
    """The learner's view of a round a rollout rank generated with ``generate_round`` from
    ``pending`` (sent with the request): ``batch`` and ``prompts`` group-major, the pending groups
    first. Its tokens are those beyond the pending rows' (the resumed rows' continuations and the new
    rows), its resumed rows the pending unfinished ones: the counts ``generate_round`` returns there."""
    b = pending.batch
    held = 0.0 if b is None else float(b.response_lens_B.sum())
    resumed = 0 if b is None else int((~pending.done_B).sum())
    tokens = float(batch.response_lens_B.sum()) - held
    return RoundOut(batch, prompts, _done(batch, plan.max_new), tokens, resumed)


def collect_over(
    plan: OverSamplingPlan,
    generate: Generate | None,
    draw: Draw | None,
    score: Score,
    cursor: int,
    pending: Pending,
    version: int,
    dp_group=None,
    run_round: RunRound | None = None,
) -> tuple[Collected, Pending]:
    """The step's rounds from data-cursor index ``cursor`` on (module doc), with the partial
    rollouts ``pending`` from the last step; ``version``: the weights this step generates with.
    Each round is ``generate_round`` over ``generate`` and ``draw``, or ``run_round`` (split: the
    rollout rank ran it). Returns what the step trains on, and the groups pending for the next step."""
    os_, ds, n = plan.cfg, plan.ds, plan.n
    if run_round is None:

        def run_round(index: int, want: int, pending: Pending) -> RoundOut:
            return generate_round(plan, generate, draw, score, index, want, pending)

    t = _Tally()
    pending, stale = drop_stale(plan, pending, version)
    t.add(stale=stale)
    kept: list = []  # (batch, scores, prompts) of trained groups, in order
    dropped_eq: list = []  # complete groups without signal (dynamic sampling)
    metrics: dict = {}
    engine_metrics: dict = {}  # the engine's own (a split run's waits): every round's, once
    have = rounds = 0
    while True:
        index, want = cursor + rounds, plan.need - have
        rounds += 1
        got = run_round(index, want, pending)
        engine_metrics = merge_metrics(engine_metrics, got.batch.engine_metrics)
        t.add(tokens=got.tokens, resumed=got.resumed)
        batch, prompts, done_B = got.batch, got.prompts, got.done_B
        complete_G = done_B.view(-1, n).all(1)
        t.add(aborted=(~done_B).sum())
        cand = complete_G.nonzero().flatten().tolist()
        take, decided_eq, rest = list(range(len(cand))), [], []
        if cand:
            cb, cs, cp, signal_P = _signal(plan, score, batch, prompts, cand)
            metrics = merge_metrics(metrics, cs.metrics)  # reward/*: every group scored
            if ds.enabled:
                take = signal_P.nonzero().flatten().tolist()
                decided_eq = (~signal_P).nonzero().flatten().tolist()
            take, surplus = take[:want], take[want:]
            rest = [cand[i] for i in surplus]
            if take:
                kept.append(take_groups(cb, cs, cp, take))
            if decided_eq:
                dropped_eq.append(take_groups(cb, cs, cp, decided_eq))
            # decided this round: trained, and dropped as all-equal (the surplus apart: drop counts it
            # in sampling/dropped_surplus, partial when a later step decides it), as colocated rounds
            decided = take + decided_eq
            t.add(generated=len(decided), with_signal=int(signal_P[decided].sum()))
            t.add(kept=int(signal_P[take].sum()), surplus=0 if os_.partial else len(surplus))
            have += len(take)
        rest += (~complete_G).nonzero().flatten().tolist()
        rest.sort()
        if os_.partial:
            pending = _pending(plan, batch, prompts, done_B, rest)
        else:
            pending = Pending([])
            if rest:
                rows = _rows(n, rest)
                t.add(dropped=rows.numel(), dropped_len=batch.response_lens_B.cpu()[rows].sum())
        short = torch.tensor([float(ds.enabled and have < plan.need)], device="cpu")
        if ds.enabled and dist.is_initialized():  # every rank generates as long as one still lacks groups
            short = short.to(comm_device(dp_group))
            dist.all_reduce(short, op=dist.ReduceOp.MAX, group=dp_group)
        if not short.item() or rounds >= ds.max_rounds:
            break
    parts = fill_groups(kept, dropped_eq, plan.need) if ds.enabled else kept
    # a round split into kept and dropped groups would count its engine metrics once per part
    batch = dataclasses.replace(
        concat_batches([p[0] for p in parts], plan.pad_id), engine_metrics=engine_metrics
    )
    scores = cat_scores([p[1] for p in parts], metrics)
    metrics = {**metrics, **_metrics(plan, t, batch, scores, version, rounds, have, pending)}
    return Collected([q for p in parts for q in p[2]], batch, scores, metrics, rounds), pending


def _metrics(
    plan, t: _Tally, batch: RolloutBatch, scores, version: int, rounds: int, have: int, pending
) -> dict:
    c, f64 = t.c, torch.float64
    lens_B = batch.response_lens_B.cpu().double()
    useful = useful_tokens(batch, scores, plan.ds.filter).cpu()
    mask_BS = batch.response_mask_BS.cpu()
    older_BS = mask_BS & (batch.version_BS.cpu() < version)  # tokens sampled at an earlier step
    lag = torch.where(older_BS, version - batch.version_BS.cpu().long(), 0).sum().double()
    return {
        "sampling/rounds": Max(float(rounds)),
        "sampling/groups_generated": Sum(c["generated"]),
        "sampling/groups_kept": Sum(c["kept"]),  # trained groups with signal
        "sampling/dropped_surplus": Sum(c["surplus"]),
        "sampling/groups_dropped_all_equal": Sum(c["generated"] - c["with_signal"]),
        "sampling/useful_frac": Mean(c["with_signal"], c["generated"]),
        "sampling/cap_reached": Max(float(plan.ds.enabled and have < plan.need)),
        "sampling/response_tokens_generated": Sum(c["tokens"]),
        "sampling/useful_token_frac": Mean(useful, torch.tensor(c["tokens"], dtype=f64, device="cpu")),
        "sampling/aborted": Sum(c["aborted"]),
        "sampling/dropped_aborted": Sum(c["dropped"]),
        "sampling/dropped_len_mean": Mean(c["dropped_len"], c["dropped"]),
        "sampling/kept_len_mean": Mean(lens_B.sum(), float(lens_B.numel())),
        "sampling/resumed": Sum(c["resumed"]),
        "sampling/resumed_tokens": Sum(older_BS.sum().double()),
        "sampling/resumed_token_lag_mean": Mean(lag, older_BS.sum().double()),
        "sampling/partial_dropped_stale": Sum(c["stale"]),
        "sampling/pending": Sum(float(0 if pending.batch is None else pending.batch.num_seqs)),
    }
