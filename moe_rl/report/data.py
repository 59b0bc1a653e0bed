"""Runs read back from their directories, the per-layer series, headline numbers and verdicts
(the side files beside ``metrics.jsonl`` are read by ``run_files.py``).

Pure reading and numpy over ``metrics.jsonl`` (see moe_rl/metrics.py for the keys): a finished
run, a run still writing, and a run killed mid-write (truncated last line, reported as a
warning) all read the same way.

Dense layers (``model.first_k_dense`` in the run's config.yaml: DeepSeek-V3, GLM-4.5) have no
router: they are rows labelled dense in the per-layer figures and verdicts, never MoE layers whose
metrics are missing or zero.

Shape suffixes: T logged steps, L layers (the MoE layers logged and the config's dense layers).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_rl.metrics import EVENTS_FILE, EXPERT_LOAD_FILE, METRICS_FILE, read_metrics
from moe_rl.report import outcome
from moe_rl.report.run_files import ReportError, health_warnings, read_expert_load, read_run_config

_LAYER_KEY = re.compile(r"^router_grad/zero_frac/layer(\d+)$")

# per-layer heatmaps: router_grad/<name>/layer{N} -> title, fixed colour range (None: the data's)
# No zero_frac panel: with the configured gating it is (E - K) / E in every layer and step by
# construction (docs/math.md 7.1), one flat colour; the summary and the verdicts compare it with
# the structural value as numbers. The blackout that varies is per expert: no_grad_expert_frac.
PANELS = (
    (
        "no_grad_expert_frac",
        "Gradient blackout: experts whose router logit got no gradient in the step (fraction of E)",
        (0.0, 1.0),
    ),
    ("rollout_flip_frac", "Rollout vs learner: (token, layer) routes that differ", None),
    ("update_flip_frac", "Update-induced flips: old-log-prob pass vs update forward", None),
    ("load_entropy", "Expert-load entropy (1 = uniform)", (0.0, 1.0)),
    ("margin_p50", "Top-K margin h(K) - h(K+1), median", None),
    ("near_boundary_frac", "Tokens near the Top-K boundary (margin < log.router_margin_eps)", (0.0, 1.0)),
    (
        "shared_expert_share",
        "Shared expert's share of the MoE output norm, ||s|| / (||s|| + ||r||)",
        (0.0, 1.0),
    ),
)
# step curves next to the heatmaps: reward, correction and mismatch metrics (when logged)
CURVES = (
    ("reward/mean", "Reward"),
    # docs/sampling.md: on every run; with algo.dynamic_sampling the rounds raise what is trained
    ("sampling/useful_frac", "Useful fraction: prompt groups with signal / groups generated"),
    # docs/sampling.md 5-6: response tokens trained in groups with signal / tokens generated
    ("sampling/useful_token_frac", "Useful token fraction: tokens in trained groups with signal / generated"),
    ("val/reward/mean", "Validation reward, greedy (log.val_every)"),
    ("val/reward_sampled/mean", "Validation reward, sampled"),
    ("rollout/truncated_frac", "Responses that hit rollout.max_new_tokens"),
    ("agent/tool_success_rate", "Tool calls without an error reply (agent.env)"),
    ("agent/turns_mean", "Assistant turns per trajectory (agent.env)"),
    ("reward/overlong_penalty_mean", "DAPO overlong penalty (mean)"),
    ("routing/flip_token_frac", "Tokens with a rollout-vs-learner flip in any layer"),
    ("router_grad/update_flip_token_frac", "Tokens with an update-induced flip in any layer"),
    ("corr/k3_kl", "k3 KL, rollout to learner"),
    ("corr/logprob_abs_diff", "Abs log-prob diff, rollout vs learner (mean)"),
    ("corr/chi2_token", "Token chi^2 (IS weight variance)"),
    ("corr/is_ratio_fraction_high", "IS weights clipped high"),
    ("corr/trm_accept_rate", "TRM accepted sequences"),
    ("corr/dvp_pruned_mass", "DVP pruned mass"),
    ("train/pg_clipfrac", "PPO clip fraction"),
    ("train/entropy", "Policy entropy"),
    ("routing/flip_router_frac", "Rollout-vs-learner router flips (learner-native vs rollout)"),
    ("train/grad_norm", "Gradient norm"),
    ("router_grad/norm", "Router-weight gradient norm"),
    ("rollout/policy_lag", "Policy lag of the rollout (rollout.staleness)"),
)
# verdict thresholds (docs/math.md 7.2 defines the metrics, not alarms: these are ours, stated in the report)
THRESHOLDS = {
    "no_grad_expert_frac": 0.10,  # experts left without router gradient, mean per step
    "zero_frac_gap": 0.05,  # |measured - structural| zero-gradient fraction
    "rollout_flip_frac": 0.05,  # (token, layer) routes differing between rollout and learner
    "update_flip_frac": 0.01,  # routes moved by the step's own update
    "load_entropy": 0.80,  # below: load concentrates on few experts
    "near_boundary_bf16_frac": 0.01,  # margins below bf16 resolution: rounding alone flips them
}
WINDOW = 100  # verdicts look at the last WINDOW logged steps


@dataclass
class Run:
    path: Path
    records: list[dict]
    warnings: list[str]
    config: dict
    config_text: str
    load_records: list[dict] = field(default_factory=list)  # expert_load.jsonl, by step
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.path.resolve().name

    @property
    def steps_T(self) -> np.ndarray:
        return np.array([r["step"] for r in self.records], dtype=np.int64)

    def series(self, key: str) -> np.ndarray:
        """float [T]: the metric per logged step, NaN where absent."""
        return np.array([_num(r.get(key)) for r in self.records], dtype=np.float64)

    def has(self, key: str) -> bool:
        return any(key in r for r in self.records)

    @property
    def moe_layers(self) -> list[int]:
        """The MoE layers the monitor logged (its per-layer keys in the last record)."""
        ids = {int(m.group(1)) for r in self.records[-1:] for k in r if (m := _LAYER_KEY.match(k))}
        return sorted(ids)

    @property
    def dense_layers(self) -> list[int]:
        """The config's dense layers (``model.first_k_dense``): no router, so no routing metric."""
        n = self.cfg("model.first_k_dense", 0)
        return list(range(n)) if isinstance(n, int) and not isinstance(n, bool) else []

    @property
    def layers(self) -> list[int]:
        """The per-layer rows: the MoE layers logged and, when any is, the dense layers too."""
        moe = self.moe_layers
        return sorted(set(moe) | set(self.dense_layers)) if moe else []

    def expert_load_LE(self, window: int = WINDOW) -> np.ndarray:
        """float [L, E] over ``layers``: each routed expert's load share (expert_load.jsonl) times E
        (1 = uniform), the mean over the last ``window`` logged steps; NaN rows for dense layers;
        shape (0, 0) when the run wrote no load."""
        recs = self.load_records[-window:]
        if not recs or not self.layers:
            return np.zeros((0, 0))
        E = len(next(iter(recs[-1]["layers"].values())))  # read_expert_load kept one length only
        out_LE = np.full((len(self.layers), E), np.nan)
        for row, lid in enumerate(self.layers):
            rows = [r["layers"][str(lid)] for r in recs if str(lid) in r["layers"]]
            if rows:
                out_LE[row] = np.mean(np.asarray(rows, dtype=np.float64), axis=0) * E
        return out_LE

    def shared_expert_flop_share(self) -> float:
        """S / (S + K F) from the config: the shared expert's share of a MoE layer's expert FLOPs
        per token (S its hidden size, K routed experts of hidden size F); NaN without one."""
        S = self.cfg("model.moe_shared_expert_ffn_hidden_size", 0)
        K, F = self.cfg("model.moe_router_topk", 0), self.cfg("model.moe_ffn_hidden_size", 0)
        if not all(isinstance(v, int) for v in (S, K, F)) or S <= 0 or K * F <= 0:
            return math.nan
        return S / (S + K * F)

    def matrix(self, name: str) -> np.ndarray:
        """float [L, T] of router_grad/<name>/layer{N} over ``layers``; NaN where absent (dense rows)."""
        if not self.layers:
            return np.zeros((0, len(self.records)))
        return np.stack([self.series(f"router_grad/{name}/layer{lid}") for lid in self.layers])

    def cfg(self, dotted: str, default=None):
        node = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def has_shared_expert(self) -> bool:
        S = self.cfg("model.moe_shared_expert_ffn_hidden_size", 0)
        return isinstance(S, int) and not isinstance(S, bool) and S > 0

    @property
    def status(self) -> str:
        total = self.cfg("steps")
        done = int(self.records[-1]["step"]) + 1 if self.records else 0
        if total is not None and done >= int(total):
            return f"finished: {done} of {total} steps logged"
        return f"in progress or stopped: {done} of {total if total is not None else '?'} steps logged"


def unique_names(runs: list[Run]) -> list[Run]:
    """Runs label figures and columns by directory name; where two share one, they are labelled
    parent/name instead."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.name] = counts.get(r.name, 0) + 1
    for r in runs:
        if counts[r.name] > 1:
            r.name = f"{r.path.resolve().parent.name}/{r.name}"
    return runs


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def load_run(path: str | Path) -> Run:
    run_dir = Path(path)
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise ReportError(
            f"{metrics} does not exist: {run_dir} is not a moe-rl run directory "
            f"(or its first step has not been logged yet)"
        )
    records, warnings = read_metrics(metrics)
    warnings = [f"{metrics}: {w}" for w in warnings]
    if not records:
        warnings.append(f"{metrics}: no complete step logged yet")
    cfg_path = run_dir / "config.yaml"
    config_text, config = read_run_config(cfg_path)
    if not config_text:
        warnings.append(f"{cfg_path} is missing: the report cannot show the run's config")
    warnings += health_warnings(run_dir / EVENTS_FILE)
    load_records: list[dict] = []
    if (load_path := run_dir / EXPERT_LOAD_FILE).is_file():
        E = _cfg_int(config, "model", "num_experts")
        load_records, load_warnings = read_expert_load(load_path, E)
        warnings += load_warnings
    return Run(run_dir, records, warnings, config, config_text, load_records)


def _cfg_int(config: dict, *keys: str) -> int | None:
    node = config
    for k in keys:
        node = node.get(k) if isinstance(node, dict) else None
    return node if isinstance(node, int) and not isinstance(node, bool) and node > 0 else None


def _window(x_T: np.ndarray, window: int = WINDOW) -> np.ndarray:
    return x_T[..., -window:]


def nanmean(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(np.nanmean(x)) if np.isfinite(x).any() else math.nan


START_LABEL = f"start reward: {outcome.START_DEFINITION}"
FINAL_LABEL = f"final reward: {outcome.FINAL_DEFINITION}"


def headline(run: Run) -> list[tuple[str, float | str]]:
    """(label, value) rows of the summary table; NaN where the run did not log the metric."""
    start, final = outcome.start_and_final_reward(run.series("reward/mean"))
    rows: list[tuple[str, float | str]] = [
        ("status", run.status),
        ("routing replay", str(run.cfg("routing.replay", "?"))),
        (START_LABEL, start),  # the outcome table's numbers, by the same function
        (FINAL_LABEL, final),
    ]
    for label, key in (
        ("validation reward, greedy", "val/reward/mean"),
        ("validation reward, sampled", "val/reward_sampled/mean"),
        ("tool-call success rate", "agent/tool_success_rate"),  # multi-turn runs only
        ("assistant turns per trajectory", "agent/turns_mean"),
    ):
        val_T = run.series(key)
        logged = val_T[np.isfinite(val_T)]
        if logged.size:
            rows += [(f"{label}, first", float(logged[0])), (f"{label}, last", float(logged[-1]))]
    rows.append(("truncated responses (mean)", nanmean(run.series("rollout/truncated_frac"))))
    shared = run.has_shared_expert or run.has("router_grad/shared_expert_share")
    for label, key in (
        ("rollout-vs-learner router flips", "routing/flip_router_frac"),
        ("tokens with any rollout-vs-learner flip", "routing/flip_token_frac"),
        ("update-induced router flips", "router_grad/update_flip_frac"),
        ("router-logit zero-gradient fraction", "router_grad/zero_frac"),
        ("structural (E-K)/E of the gating", "router_grad/zero_frac_expected"),
        ("shared-expert share of the MoE output norm", "router_grad/shared_expert_share" if shared else None),
        ("k3 KL, rollout to learner", "corr/k3_kl"),
        ("abs log-prob diff, rollout vs learner", "corr/logprob_abs_diff"),
    ):
        if key is not None:  # no shared-expert row for a model without one
            rows.append((f"{label} (mean)", nanmean(run.series(key))))
    flop_share = run.shared_expert_flop_share()
    if math.isfinite(flop_share):
        rows.append(("shared-expert share of the expert FLOPs, S/(S+K F)", flop_share))
    if run.dense_layers:
        rows.append(("dense layers (no router)", ", ".join(str(i) for i in run.dense_layers)))
    step_T = run.series("time/step_s")
    rows.append(
        ("median step time (s)", float(np.nanmedian(step_T)) if np.isfinite(step_T).any() else math.nan)
    )
    return rows


@dataclass
class Verdict:
    layer: int
    level: str  # "ok" | "warn" | "dense" (a dense layer: no router, nothing to judge)
    findings: list[tuple[str, bool]]  # (finding, whether it crosses its threshold)
    checks: list[str] = field(default_factory=list)  # each finding's THRESHOLDS key ("" for none)

    @property
    def texts(self) -> list[str]:
        return [text for text, _ in self.findings]


def _layer_means(m_LT: np.ndarray) -> np.ndarray:
    """float [L]: each layer's mean over the logged steps; NaN for a layer never logged."""
    finite_LT = np.isfinite(m_LT)
    count_L = finite_LT.sum(1)
    return np.where(count_L > 0, np.where(finite_LT, m_LT, 0.0).sum(1) / np.maximum(count_L, 1), math.nan)


def layer_verdicts(run: Run, window: int = WINDOW) -> list[Verdict]:
    """One short verdict per MoE layer over the last ``window`` logged steps; a dense layer gets
    a "dense" line (none at all when the run logged no per-layer router metric)."""
    n = min(window, len(run.records))
    span = f"the last {n} steps"
    expected = nanmean(_window(run.series("router_grad/zero_frac_expected"), window))
    mean = {
        name: _layer_means(_window(run.matrix(name), window))
        for name in (
            "zero_frac",
            "no_grad_expert_frac",
            "rollout_flip_frac",
            "update_flip_frac",
            "load_entropy",
            "load_max_frac",
            "margin_p50",
            "near_boundary_bf16_frac",
            "shared_expert_share",
        )
    }
    r3 = run.cfg("routing.replay") == "r3"
    dense, flop_share = set(run.dense_layers), run.shared_expert_flop_share()
    out = []
    for i, lid in enumerate(run.layers):
        if lid in dense:
            text = f"an MLP without router (model.first_k_dense = {len(dense)}): no routing metrics"
            out.append(Verdict(lid, "dense", [(text, False)], [""]))
            continue
        m = {k: float(v[i]) for k, v in mean.items()}
        found, checks = _findings(m, expected, span, r3, flop_share)
        warn = any(bad for _, bad in found)
        out.append(Verdict(lid, "warn" if warn else "ok", found, checks))
    return out


def _findings(
    m: dict[str, float], expected: float, span: str, r3: bool, flop_share: float
) -> tuple[list[tuple[str, bool]], list[str]]:
    """One MoE layer's findings from its window means ``m``: (finding, whether it crosses its
    threshold) and, alongside, each one's THRESHOLDS key ("" for none) for moe_rl/report/advice.py."""
    found: list[tuple[str, bool]] = []  # (finding, whether it crosses a threshold)
    checks: list[str] = []  # the THRESHOLDS key of each finding, for moe_rl/report/advice.py
    if math.isfinite(m["no_grad_expert_frac"]):
        blackout = m["no_grad_expert_frac"] > THRESHOLDS["no_grad_expert_frac"]
        checks.append("no_grad_expert_frac")
        found.append(
            (
                (
                    f"{m['no_grad_expert_frac']:.0%} of experts got no router gradient per step "
                    f"(mean over {span})" + (": gradient blackout" if blackout else "")
                ),
                blackout,
            )
        )
    if math.isfinite(m["zero_frac"]) and math.isfinite(expected):
        gap = abs(m["zero_frac"] - expected) > THRESHOLDS["zero_frac_gap"]
        checks.append("zero_frac_gap")
        found.append(
            (
                f"zero-gradient fraction {m['zero_frac']:.3f} vs structural {expected:.3f}"
                + (
                    ": the live gating is not the configured one (aux loss? pre-softmax?)"
                    if gap
                    else " (as the gating implies)"
                ),
                gap,
            )
        )
    if math.isfinite(m["rollout_flip_frac"]):
        checks.append("rollout_flip_frac")
        found.append(
            (
                f"{m['rollout_flip_frac']:.1%} of routes differ between rollout and learner"
                + (" (R3 trains on the rollout's routes)" if r3 else ""),
                m["rollout_flip_frac"] > THRESHOLDS["rollout_flip_frac"] and not r3,
            )
        )
    if math.isfinite(m["update_flip_frac"]):
        checks.append("update_flip_frac")
        found.append(
            (
                f"{m['update_flip_frac']:.1%} of routes flip within a step's update",
                m["update_flip_frac"] > THRESHOLDS["update_flip_frac"],
            )
        )
    if math.isfinite(m["load_entropy"]):
        checks.append("load_entropy")
        found.append(
            (
                f"load entropy {m['load_entropy']:.2f} (busiest expert {m['load_max_frac']:.0%} of routes)",
                m["load_entropy"] < THRESHOLDS["load_entropy"],
            )
        )
    if math.isfinite(m["margin_p50"]):
        checks.append("near_boundary_bf16_frac")
        found.append(
            (
                (
                    f"median Top-K margin {m['margin_p50']:.3g}; {m['near_boundary_bf16_frac']:.1%} of "
                    f"tokens within bf16 resolution of the boundary"
                ),
                m["near_boundary_bf16_frac"] > THRESHOLDS["near_boundary_bf16_frac"],
            )
        )
    if math.isfinite(m["shared_expert_share"]):
        checks.append("")
        found.append(
            (
                f"shared expert {m['shared_expert_share']:.1%} of the MoE output norm"
                + (f" ({flop_share:.1%} of its expert FLOPs)" if math.isfinite(flop_share) else ""),
                False,  # a property of the model, not an alarm
            )
        )
    return found, checks


def flat_config(cfg: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(runs: list[Run]) -> list[tuple[str, list[object]]]:
    """Keys whose values differ between the runs (run_dir excluded: it always does)."""
    flats = [flat_config(r.config) for r in runs]
    keys = sorted(set().union(*flats) - {"run_dir"})
    return [
        (k, [f.get(k, "-") for f in flats]) for k in keys if len({repr(f.get(k, "-")) for f in flats}) > 1
    ]
