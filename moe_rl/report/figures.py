"""The report's figures as PNG bytes (matplotlib, Agg backend: no display, no network).

Heatmaps put layers on the y axis (dense ones hatched and labelled "dense": no router) and logged
steps on the x axis; with two runs they sit
side by side on one shared colour scale, so "replay off vs r3" reads at a glance (more than four
runs wrap into rows). Curves put every run on the same axes; a grid of runs gets a colour per
arm and trailing means.
"""

from __future__ import annotations

import io
import re

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from moe_rl.report.data import Run

DPI = 90
HEATMAP_COLUMNS = 4


def _png(fig: Figure | None) -> bytes | None:
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def colour_limits(finite: np.ndarray, vrange: tuple[float, float] | None) -> tuple[float, float]:
    """The colour scale: ``vrange`` when fixed, else the data's range; constant data gets the span
    from 0 to its value (0 to 1 when all zero), not a zero-width scale whose ticks read 1e-12."""
    if vrange is not None:
        return vrange
    lo, hi = float(finite.min()), float(finite.max())
    if hi > lo:
        return lo, hi
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    return (lo, hi) if hi > lo else (0.0, 1.0)


def _layer_rows(ax, run: Run, xlabel: str) -> None:
    """One run's panel: a row per layer, a dense layer (no router) hatched and labelled so."""
    dense = set(run.dense_layers)
    for row, lid in enumerate(run.layers):
        if lid in dense:
            ax.axhspan(row - 0.5, row + 0.5, facecolor="0.9", hatch="//", edgecolor="0.6", lw=0)
    labels = [f"layer {lid} (dense)" if lid in dense else f"layer {lid}" for lid in run.layers]
    ax.set_yticks(range(len(run.layers)), labels, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and experts are whole numbers
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_title(run.name, fontsize=9)


def heatmap(runs: list[Run], name: str, title: str, vrange: tuple[float, float] | None) -> bytes | None:
    return _png(heatmap_figure(runs, name, title, vrange))


def heatmap_figure(
    runs: list[Run], name: str, title: str, vrange: tuple[float, float] | None
) -> Figure | None:
    """router_grad/<name>/layer{N} over steps, one panel per run; None if no run logged it."""
    mats = [r.matrix(name) for r in runs]
    if not any(m.size and np.isfinite(m).any() for m in mats):
        return None
    vmin, vmax = colour_limits(np.concatenate([m[np.isfinite(m)] for m in mats]), vrange)
    ncols = min(len(runs), HEATMAP_COLUMNS)  # many runs wrap into rows on the one colour scale
    nrows = -(-len(runs) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(5.2 * ncols + 1.2, 2.4 * nrows), squeeze=False, sharey=True
    )
    for ax in axes.flat[len(runs) :]:
        ax.set_visible(False)
    for ax, run, m_LT in zip(axes.flat, runs, mats):
        steps_T = run.steps_T
        if m_LT.size == 0 or len(steps_T) == 0:
            ax.set_title(f"{run.name}: not logged", fontsize=9)
            continue
        extent = (steps_T[0] - 0.5, steps_T[-1] + 0.5, len(run.layers) - 0.5, -0.5)
        im = ax.imshow(
            np.ma.masked_invalid(m_LT),
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            vmin=vmin,
            vmax=vmax,
            extent=extent,
        )
        _layer_rows(ax, run, "step")
    fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.025, pad=0.01)
    fig.suptitle(title, fontsize=10, x=0.02, y=1 + 0.08 / nrows, ha="left")  # above the run-name titles
    return fig


def expert_load_title(runs: list[Run]) -> str:
    """The shared expert is named only where a run has one (model.moe_shared_expert_ffn_hidden_size)."""
    shared = any(r.has_shared_expert for r in runs)
    return "Expert load per routed expert x E (1 = uniform" + (
        "; the shared expert, not drawn, takes every token)" if shared else ")"
    )


def expert_load(runs: list[Run]) -> bytes | None:
    return _png(expert_load_figure(runs))


def expert_load_figure(runs: list[Run]) -> Figure | None:
    """Per-expert load share x E (1 = uniform; expert_load.jsonl, mean over the report's window),
    layers by experts, one panel per run on one colour scale from 0; None if no run wrote it."""
    mats = [r.expert_load_LE() for r in runs]
    if not any(m.size and np.isfinite(m).any() for m in mats):
        return None
    _, vmax = colour_limits(np.concatenate([[0.0]] + [m[np.isfinite(m)] for m in mats]), None)
    ncols = min(len(runs), HEATMAP_COLUMNS)
    nrows = -(-len(runs) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols + 1.2, 2.4 * nrows), squeeze=False)
    for ax in axes.flat[len(runs) :]:
        ax.set_visible(False)
    im = None
    for ax, run, m_LE in zip(axes.flat, runs, mats):
        if m_LE.size == 0:
            ax.set_title(f"{run.name}: no expert_load.jsonl", fontsize=9)
            continue
        im = ax.imshow(
            np.ma.masked_invalid(m_LE),
            aspect="auto",
            interpolation="nearest",
            cmap="magma",
            vmin=0,
            vmax=vmax,
        )
        _layer_rows(ax, run, "routed expert")
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.025, pad=0.01)
    fig.suptitle(expert_load_title(runs), fontsize=10, x=0.02, y=1 + 0.08 / nrows, ha="left")
    return fig


SPARSE = 20  # a run with fewer logged points than this gets markers on its curve
SMOOTH_WINDOW = 10  # with many runs, each curve's trailing mean over this many logged steps
LINESTYLES = ("-", "--", ":", "-.")


def _style(runs: list[Run]) -> list[dict]:
    """One colour per arm, one line style per seed: runs named ``<arm>_s<seed>`` (the collapse
    lab's grid) share their arm's colour; any other name is its own arm."""
    arms = [re.sub(r"_s\d+$", "", run.name) for run in runs]
    colours = {arm: plt.get_cmap("tab10")(i % 10) for i, arm in enumerate(dict.fromkeys(arms))}
    nth = [arms[:i].count(arm) for i, arm in enumerate(arms)]
    return [
        {"color": colours[arm], "linestyle": LINESTYLES[k % len(LINESTYLES)]} for arm, k in zip(arms, nth)
    ]


def trailing_mean(y_T: np.ndarray, window: int) -> np.ndarray:
    """Mean of the finite values among the last ``window`` entries up to each step (NaN where none)."""
    finite_T = np.isfinite(y_T)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite_T, y_T, 0.0))])
    ccount = np.concatenate([[0], np.cumsum(finite_T)])
    lo_T = np.maximum(np.arange(1, len(y_T) + 1) - window, 0)
    count_T = ccount[1:] - ccount[lo_T]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count_T > 0, (csum[1:] - csum[lo_T]) / count_T, np.nan)


def curve(runs: list[Run], key: str, title: str) -> bytes | None:
    return _png(curve_figure(runs, key, title))


def curve_figure(runs: list[Run], key: str, title: str) -> Figure | None:
    """One metric over steps, every run on the same axes; None if no run logged it. Many runs: a
    colour per arm, and each run's raw values faint under its trailing mean, so a grid reads.
    Only the logged points are joined (a metric logged every n steps, like validation, is a line
    through them, not NaN-broken pieces); a run with fewer than SPARSE points also gets markers, so
    a single point shows. The x axis spans the runs' logged steps."""
    if not any(r.has(key) for r in runs):
        return None
    many = len(runs) > 4
    fig, ax = plt.subplots(figsize=(6.4, 2.6) if many else (4.6, 2.2))
    for run, style in zip(runs, _style(runs)):
        y_T, steps_T = run.series(key), run.steps_T
        ok_T = np.isfinite(y_T)
        if not ok_T.any():
            continue
        dots = {"marker": "o", "markersize": 3} if ok_T.sum() < SPARSE else {}
        if many:
            smooth_T = trailing_mean(y_T, SMOOTH_WINDOW)
            ax.plot(steps_T[ok_T], y_T[ok_T], lw=0.5, alpha=0.25, color=style["color"])
            ax.plot(steps_T[ok_T], smooth_T[ok_T], lw=1.3, label=run.name, **style, **dots)
        else:
            ax.plot(steps_T[ok_T], y_T[ok_T], lw=1.0, label=run.name, **dots)
    lo = min(int(r.steps_T.min()) for r in runs if len(r.records))
    hi = max(int(r.steps_T.max()) for r in runs if len(r.records))
    pad = max(0.5, 0.02 * (hi - lo))
    ax.set_xlim(lo - pad, hi + pad)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{title} (lines: {SMOOTH_WINDOW}-step mean)" if many else title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if many:  # beside the axes, where it hides no curve
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + len(runs) // 16)
    elif len(runs) > 1:
        ax.legend(fontsize=7)
    return fig


SPLIT_TITLE = (
    "Mismatch split: k3 with the learner's native routes vs the engine's replayed; "
    "the gap is the flipped routes' part (log.mismatch_split_every)"
)


def mismatch_split(runs: list[Run]) -> bytes | None:
    return _png(mismatch_split_figure(runs))


def mismatch_split_figure(runs: list[Run]) -> Figure | None:
    """Per run, over the steps the split was logged: ``mismatch/k3_native`` and
    ``mismatch/k3_replayed``, the band between them shaded (``mismatch/k3_flip_part``: what routing
    replay removes; the replayed line is what it cannot). One panel per run on a shared y axis;
    None if no run logged the split."""
    logged = [r for r in runs if r.has("mismatch/k3_native")]
    if not logged:
        return None
    ncols = min(len(logged), HEATMAP_COLUMNS)
    nrows = -(-len(logged) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(4.2 * ncols + 0.6, 2.4 * nrows), squeeze=False, sharey=True
    )
    for ax in axes.flat[len(logged) :]:
        ax.set_visible(False)
    for ax, run in zip(axes.flat, logged):
        native_T, replayed_T = run.series("mismatch/k3_native"), run.series("mismatch/k3_replayed")
        ok_T = np.isfinite(native_T) & np.isfinite(replayed_T)
        steps_T = run.steps_T[ok_T]
        dots = {"marker": "o", "markersize": 3} if ok_T.sum() < SPARSE else {}
        ax.fill_between(steps_T, replayed_T[ok_T], native_T[ok_T], color="tab:red", alpha=0.2, lw=0)
        ax.plot(steps_T, native_T[ok_T], color="tab:red", lw=1.0, label="native routes", **dots)
        ax.plot(steps_T, replayed_T[ok_T], color="tab:blue", lw=1.0, label="engine's routes replayed", **dots)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.set_title(run.name, fontsize=9)
    axes.flat[0].set_ylabel("k3 KL, rollout to learner", fontsize=8)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(SPLIT_TITLE, fontsize=10, x=0.02, y=1 + 0.08 / nrows, ha="left")
    return fig
