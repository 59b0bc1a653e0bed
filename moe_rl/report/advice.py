"""What a report's warnings mean and what to try: one verdict per run and the advice table.

Every finding a per-layer verdict flags (``data.layer_verdicts``, thresholds ``data.THRESHOLDS``),
a reward collapse (``outcome.collapse_step``) and each health alarm (events.jsonl) become a
``Problem``: its layer, the step it started at, a severity and, from ``ADVICE``, its meaning in one
sentence, the config keys to try and the docs sections that explain it (docs/report.md 5 prints
the table).

Severity: ``act`` (the run is learning from something it should not: change a knob), ``watch``
(a cost or a risk, not yet damage: look at the curves), ``info`` (expected at this scale or
dialled in by the config: nothing to do). The run's verdict is ``healthy`` when no problem is
``act`` or ``watch``; otherwise it names the first problem of the most severe level present, first
by the step it started at (ties: the whole run's before a layer's, the lower layer, then
``ADVICE``'s order). Why the most severe
level first: the verdict is what to do, and the earliest ``act`` problem is the likely cause of
what follows it; within a level, a later problem is often a consequence of an earlier one.

Start step of a flagged finding: the first logged step whose value crosses the threshold and from
which the mean over every later logged step (that step included) crosses it too, so a single early
spike followed by healthy steps does not date it. A finding flagged over the verdict window always
has one (the window's mean crosses, so does the mean from its first crossing step on). A blackout
of dead experts is dated the same way by ``never_selected_frac``: from when no token chose them.

Shape suffixes: T logged steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_rl.metrics import EVENTS_FILE
from moe_rl.report import data, outcome
from moe_rl.report.data import THRESHOLDS, Run
from moe_rl.report.run_files import health_events

SEVERITIES = ("act", "watch", "info")
# a gradient blackout is expected, not alarming, when the step's response tokens give each expert
# fewer than this many routed slots on average (tokens x K / E): an expert can then get none by chance
TINY_ROUTES_PER_EXPERT = 100.0


@dataclass(frozen=True)
class Knob:
    key: str  # a config key (tests/report/test_advice.py checks each is one)
    text: str  # what to set or change, naming the key


@dataclass(frozen=True)
class Advice:
    name: str  # what the verdict calls the problem
    severity: str  # the usual level; ``severity_of`` refines the gradient blackout's and the flips'
    meaning: str  # one sentence
    knobs: tuple[Knob, ...]
    docs: tuple[str, ...]  # docs/<page>.md <section>


_R3 = Knob("routing.replay", "routing.replay=r3")
_AUX = Knob("model.router_aux_loss_coeff", "model.router_aux_loss_coeff=0.001")
_BIAS = Knob(
    "model.expert_bias_update", "model.expert_bias_update=native (sigmoid routers with an expert bias)"
)
_LR = Knob("optim.lr", "a lower optim.lr")

# keyed by data.THRESHOLDS' keys, "collapse" for the run's reward and "health" for its health alarms
ADVICE: dict[str, Advice] = {
    "no_grad_expert_frac": Advice(
        "gradient blackout",
        "watch",
        "experts whose router logit got no gradient in a step (no loss-carrying token chose them) do "
        "not learn to attract or shed tokens that step; experts no token chose at all are dead.",
        (
            _AUX,
            _BIAS,
            Knob("rollout.prompts_per_step", "more rollout.prompts_per_step (more tokens routed a step)"),
        ),
        ("docs/math.md 7.1", "docs/report.md 5"),
    ),
    "zero_frac_gap": Advice(
        "gating differs from the config",
        "act",
        "the share of router logits without gradient is not what the configured gating implies, so "
        "the learner's router is not the one the config describes.",
        (
            Knob("model.moe_router_score_function", "model.moe_router_score_function"),
            Knob("model.norm_topk_prob", "model.norm_topk_prob"),
            Knob(
                "model.router_aux_loss_coeff", "model.router_aux_loss_coeff (check them against config.json)"
            ),
        ),
        ("docs/math.md 7.1",),
    ),
    "rollout_flip_frac": Advice(
        "rollout-vs-learner route flips",
        "act",
        "the rollout engine and the learner pick different experts for these routes, so the learner "
        "scores samples on routes they were not generated with.",
        (
            _R3,
            Knob("correction.is_level", "correction.is_level=token"),
            Knob("correction.trm.max", "correction.trm.max=0.05"),
        ),
        ("docs/correction.md 2, 3",),
    ),
    "update_flip_frac": Advice(
        "update-induced route flips",
        "watch",
        "routes that change within the step's own update are where the PPO ratio stops being a "
        "first-order approximation of the policy change.",
        (
            _LR,
            Knob("routing.replay", "routing.replay=r2"),
            Knob("algo.num_minibatches", "fewer algo.num_minibatches"),
        ),
        ("docs/math.md 7.2", "docs/correction.md 2"),
    ),
    "load_entropy": Advice(
        "concentrated expert load",
        "watch",
        "a few experts take most tokens, so the others learn little and the layer's capacity goes unused.",
        (_AUX, _BIAS),
        ("docs/math.md 7.2",),
    ),
    "near_boundary_bf16_frac": Advice(
        "routes within bf16 rounding of the Top-K boundary",
        "watch",
        "rounding alone can flip these tokens' experts between a bf16 rollout and the learner.",
        (_R3, Knob("rollout.dtype", "rollout.dtype=fp32")),
        ("docs/math.md 7.2",),
    ),
    "collapse": Advice(
        "reward collapse",
        "act",
        "the reward fell far below the warm start's and stayed there: the policy is unlearning.",
        (_R3, Knob("correction.trm.max", "correction.trm.max=0.05"), _LR),
        ("docs/report.md 2", "docs/correction.md 3"),
    ),
    "health": Advice(
        "health alarm",
        "act",
        "the run goes on but stopped learning: the policy is uniform or collapsed onto one token, or "
        "no minibatch had a gradient.",
        (
            _LR,
            Knob("task.reward", "task.reward / task.dataset (a reward no sample earns gives no gradient)"),
        ),
        ("docs/reliability.md 6",),
    ),
}


@dataclass(frozen=True)
class Problem:
    check: str  # an ADVICE key
    layer: int | None  # None: the whole run (collapse, health alarms)
    step: int  # the logged step it started at (module docstring)
    severity: str  # one of SEVERITIES
    finding: str  # the per-layer verdict's text, or the collapse's
    why: str = ""  # why the severity differs from ADVICE's usual one

    @property
    def advice(self) -> Advice:
        return ADVICE[self.check]

    @property
    def where(self) -> str:
        return (
            f"in layer {self.layer} from step {self.step}"
            if self.layer is not None
            else f"from step {self.step}"
        )

    @property
    def try_text(self) -> str:
        return ", ".join(k.text for k in self.advice.knobs)

    @property
    def docs_text(self) -> str:
        return ", ".join(self.advice.docs)


def _excess_T(run: Run, check: str, lid: int) -> np.ndarray:
    """float [T]: how far each logged step is past the threshold (> 0: crosses it; NaN: not logged)."""
    layer = f"/layer{lid}"
    if check == "zero_frac_gap":
        gap_T = np.abs(
            run.series("router_grad/zero_frac" + layer) - run.series("router_grad/zero_frac_expected")
        )
        return gap_T - THRESHOLDS[check]
    x_T = run.series(f"router_grad/{check}{layer}")
    return THRESHOLDS[check] - x_T if check == "load_entropy" else x_T - THRESHOLDS[check]


def start_step(steps_T: np.ndarray, excess_T: np.ndarray) -> int | None:
    """The first logged step whose excess is > 0 and whose mean excess over it and every later
    logged step is > 0 too (NaN steps skipped); None when no step qualifies."""
    finite_T = np.isfinite(excess_T)
    x_T = np.where(finite_T, excess_T, 0.0)
    suffix_sum_T = np.cumsum(x_T[::-1])[::-1]
    suffix_n_T = np.cumsum(finite_T[::-1])[::-1]
    ok_T = finite_T & (x_T > 0) & (suffix_sum_T > 0) & (suffix_n_T > 0)
    idx = np.nonzero(ok_T)[0]
    return int(steps_T[idx[0]]) if idx.size else None


def _routes_per_expert(run: Run) -> float:
    """Response tokens a step x K / E, the mean over the verdict window (NaN when not logged)."""
    K, E = run.cfg("model.moe_router_topk"), run.cfg("model.num_experts")
    tokens = data.nanmean(run.series("rollout/num_response_tokens")[-data.WINDOW :])
    return tokens * K / E if isinstance(K, int) and isinstance(E, int) and E > 0 else math.nan


def severity_of(run: Run, check: str, lid: int) -> tuple[str, str]:
    """(severity, why it differs from ADVICE's usual one, or "")."""
    if check == "no_grad_expert_frac":
        dead = data.nanmean(run.series(f"router_grad/never_selected_frac/layer{lid}")[-data.WINDOW :])
        if dead > THRESHOLDS[check]:
            return "act", f"{dead:.0%} of the layer's experts were chosen by no token: dead experts"
        routes = _routes_per_expert(run)
        if routes < TINY_ROUTES_PER_EXPERT:
            return "info", (
                f"at this scale ({routes:.0f} response-token routes per expert a step, under "
                f"{TINY_ROUTES_PER_EXPERT:.0f}) an expert can get none by chance: nothing to do"
            )
    if check == "rollout_flip_frac" and (noise := run.cfg("rollout.router_noise", 0.0)):
        return "info", f"dialled in by rollout.router_noise={noise}: nothing to do"
    return ADVICE[check].severity, ""


def problems(run: Run) -> list[Problem]:
    """Every flagged finding of the run's per-layer verdicts, a reward collapse and the health
    alarms, in verdict order: the most severe level first, then the start step, the whole run's
    before a layer's, the lower layer, ADVICE's order."""
    steps_T = run.steps_T
    out = []
    for v in data.layer_verdicts(run):
        for (text, bad), check in zip(v.findings, v.checks):
            if not bad or check not in ADVICE:
                continue
            severity, why = severity_of(run, check, v.layer)
            excess_T = _excess_T(run, check, v.layer)
            if (
                check == "no_grad_expert_frac" and severity == "act"
            ):  # dead experts: since no token chose them
                excess_T = run.series(f"router_grad/never_selected_frac/layer{v.layer}") - THRESHOLDS[check]
            step = start_step(steps_T, excess_T)
            first = int(steps_T[-min(data.WINDOW, len(steps_T))])  # not reached: see module docstring
            out.append(Problem(check, v.layer, first if step is None else step, severity, text, why))
    res = outcome.outcome(steps_T, run.series)
    if res.collapse_step is not None:
        text = (
            f"reward/mean below {outcome.COLLAPSE_FRAC:.0%} of the start reward "
            f"({res.start_reward:.3g}) over {outcome.COLLAPSE_WINDOW} steps; "
            f"final reward {res.final_reward:.3g}"
        )
        out.append(Problem("collapse", None, res.collapse_step, "act", text))
    patience = run.cfg("log.health.patience", 1)
    for ev in health_events(run.path / EVENTS_FILE):
        if isinstance(ev.get("step"), int):  # the alarm fires after its condition held `patience` steps
            step = ev["step"] - (patience - 1 if isinstance(patience, int) else 0)
            out.append(Problem("health", None, step, "act", f"{ev.get('alarm')}: {ev.get('cause')}"))
    order = list(ADVICE)
    return sorted(
        out,
        key=lambda p: (
            SEVERITIES.index(p.severity),
            p.step,
            -1 if p.layer is None else p.layer,
            order.index(p.check),
        ),
    )


def verdict_line(found: list[Problem]) -> str:
    """The run's one verdict: healthy, or the first problem (module docstring) with what to try."""
    serious = [p for p in found if p.severity != "info"]
    notes = len(found) - len(serious)
    if not serious:
        note = f"; {notes} informational note{'s' if notes != 1 else ''} below" if notes else ""
        return f"verdict: healthy (no warning to act on or watch{note})"
    p = serious[0]
    more = len(serious) - 1
    rest = f"; {more} more warning{'s' if more != 1 else ''} below" if more else ""
    return (
        f"verdict: {p.severity}: {p.advice.name} {p.where} ({p.finding.removesuffix(': ' + p.advice.name)}); "
        f"try {p.try_text} ({p.docs_text}){rest}"
    )


def run_verdicts(runs: list[Run]) -> list[tuple[str, list[Problem]]]:
    """(verdict line, problems) per run."""
    out = []
    for run in runs:
        found = problems(run)
        out.append((verdict_line(found), found))
    return out
