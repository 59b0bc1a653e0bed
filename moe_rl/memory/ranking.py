"""Layouts ranked for a node count (``choose_layout``) and the verdict's formatting."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_rl.config import ModelConfig, RunConfig
from moe_rl.memory.device import MARGIN_GIB
from moe_rl.memory.estimate import estimate, fits, phase_peak_gib
from moe_rl.memory.learner_layout import Layout
from moe_rl.memory.phases import PEAK_PHASES


def _splits(num_layers: int, pp: int):
    """(first, last) stage sizes to try: the even split (0, 0) when PP divides the layers, and
    every uneven one whose first and last stages are no larger than a middle stage (they also
    carry the embedding / the output layer and the logits)."""
    if pp == 1 or num_layers % pp == 0:
        yield 0, 0
    if pp == 1:
        return
    if pp == 2:
        yield from ((f, num_layers - f) for f in range(1, num_layers) if 2 * f != num_layers)
        return
    for mid in range(math.ceil(num_layers / pp), (num_layers - 2) // (pp - 2) + 1):
        rest = num_layers - mid * (pp - 2)
        yield from (
            (f, rest - f)
            for f in range(max(1, rest - mid), min(mid, rest - 1) + 1)
            if not f == rest - f == mid
        )


def candidate_layouts(m: ModelConfig, nodes: int, gpus_per_node: int) -> list[Layout]:
    """Every layout ``problems`` accepts on nodes x gpus_per_node GPUs: TP in {1, 2, 4, 8} within
    a node, PP any divisor of world / TP up to the layers (with every ``_splits`` split), EP any
    divisor of the experts, ETP 1 or TP."""
    world, out = nodes * gpus_per_node, []
    for tp in (t for t in (1, 2, 4, 8) if t <= gpus_per_node and world % t == 0):
        for pp in (p for p in range(1, min(world // tp, m.num_layers) + 1) if (world // tp) % p == 0):
            for ep in (e for e in range(1, m.num_experts + 1) if m.num_experts % e == 0):
                for etp in sorted({1, tp}):
                    for first, last in _splits(m.num_layers, pp):
                        lay = Layout(world, tp, pp, ep, etp, first, last)
                        if not lay.problems(m):
                            out.append(lay)
    return out


@dataclass(frozen=True)
class Ranked:
    layout: Layout
    est: dict[str, float]
    fits: bool


def rank_layouts(
    cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_gib: float = 80.0, margin_gib: float = MARGIN_GIB
) -> list[Ranked]:
    """``candidate_layouts`` estimated, one per (TP, EP, ETP, PP): the first/last split whose
    larger peak (training or rollout, the heaviest stage decides) is smallest. Ordered: the ones
    that fit (``fits``) first, by the rule: fewest pipeline stages (less bubble, fewer in-flight
    micro-batches), then smallest TP (its all-gathers / reduce-scatters run on every layer), ETP 1
    before ETP = TP (expert TP all-gathers the routed tokens), smallest EP (fewest ranks in each
    all-to-all), then the most headroom; the rest after them, smallest peak first."""
    best: dict[tuple[int, int, int, int], Ranked] = {}
    for lay in candidate_layouts(cfg.model, nodes, gpus_per_node):
        est = estimate(cfg, gpu_gib, lay)
        key = (lay.tp, lay.ep, lay.expert_tp, lay.pp)
        if key not in best or _peak(est) < _peak(best[key].est):
            best[key] = Ranked(lay, est, fits(cfg, est, margin_gib))

    def order(r: Ranked):
        rule = (r.layout.pp, r.layout.tp, r.layout.expert_tp, r.layout.ep) if r.fits else ()
        return (not r.fits, *rule, _peak(r.est))

    return sorted(best.values(), key=order)


def choose_layout(
    cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_gib: float = 80.0, margin_gib: float = MARGIN_GIB
) -> list[Ranked]:
    """The layouts that fit, best first (``rank_layouts``' rule); empty when none does."""
    return [r for r in rank_layouts(cfg, nodes, gpus_per_node, gpu_gib, margin_gib) if r.fits]


def _peak(est: dict[str, float]) -> float:
    return max(phase_peak_gib(est, p) for p in PEAK_PHASES)


def format_estimate(est: dict[str, float]) -> str:
    return "\n".join(f"{k:<26} {v:,.1f}" for k, v in est.items())


def layout_table(cfg: RunConfig, ranked: list[Ranked]) -> str:
    """A markdown table of ranked layouts (as in docs/gpu.md 7)."""
    rows = [
        "| layout (TP x EP x ETP x PP) | learner static | train peak | rollout peak | "
        "vLLM KV tokens | fits? |",
        "|---|---|---|---|---|---|",
    ]
    for r in ranked:
        e = r.est
        rows.append(
            f"| {r.layout.describe(cfg.model.num_layers)} | {e['learner_static_max_gib']:.1f} | "
            f"{e['train_peak_gib']:.1f} | {e['rollout_peak_gib']:.1f} | {e['vllm_kv_tokens']:,.0f} | "
            f"{'yes' if r.fits else 'no'} |"
        )
    return "\n".join(rows)
