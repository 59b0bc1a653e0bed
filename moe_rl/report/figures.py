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

from moe_rl.report.data import Run

DPI = 90
HEATMAP_COLUMNS = 4


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _layer_rows(ax, run: Run, xlabel: str) -> None:
    """One run's panel: a row per layer, a dense layer (no router) hatched and labelled so."""
    dense = set(run.dense_layers)
    for row, lid in enumerate(run.layers):
        if lid in dense:
            ax.axhspan(row - 0.5, row + 0.5, facecolor="0.9", hatch="//", edgecolor="0.6", lw=0)
    labels = [f"layer {lid} (dense)" if lid in dense else f"layer {lid}" for lid in run.layers]
    ax.set_yticks(range(len(run.layers)), labels, fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_title(run.name, fontsize=9)


def heatmap(runs: list[Run], name: str, title: str, vrange: tuple[float, float] | None) -> bytes | None:
    """router_grad/<name>/layer{N} over steps, one panel per run; None if no run logged it."""
    mats = [r.matrix(name) for r in runs]
    if not any(m.size and np.isfinite(m).any() for m in mats):
        return None
    finite = np.concatenate([m[np.isfinite(m)] for m in mats])
    vmin, vmax = vrange if vrange is not None else (float(finite.min()), float(finite.max()))
    if vmax <= vmin:
        vmax = vmin + 1e-12
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
    return _png(fig)


def expert_load(runs: list[Run]) -> bytes | None:
    """Per-expert load share x E (1 = uniform; expert_load.jsonl, mean over the report's window),
    layers by experts, one panel per run on one colour scale; None if no run wrote it."""
    mats = [r.expert_load_LE() for r in runs]
    if not any(m.size and np.isfinite(m).any() for m in mats):
        return None
    vmax = max(float(np.nanmax(m)) for m in mats if m.size and np.isfinite(m).any())
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
    fig.suptitle(EXPERT_LOAD_TITLE, fontsize=10, x=0.02, y=1 + 0.08 / nrows, ha="left")
    return _png(fig)


EXPERT_LOAD_TITLE = "Expert load per routed expert x E (1 = uniform; the shared expert takes every token)"
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
    """One metric over steps, every run on the same axes; None if no run logged it. Many runs: a
    colour per arm, and each run's raw values faint under its trailing mean, so a grid reads."""
    if not any(r.has(key) for r in runs):
        return None
    many = len(runs) > 4
    fig, ax = plt.subplots(figsize=(6.4, 2.6) if many else (4.6, 2.2))
    for run, style in zip(runs, _style(runs)):
        y_T = run.series(key)
        if not np.isfinite(y_T).any():
            continue
        if many:
            ax.plot(run.steps_T, y_T, lw=0.5, alpha=0.25, color=style["color"])
            ax.plot(run.steps_T, trailing_mean(y_T, SMOOTH_WINDOW), lw=1.3, label=run.name, **style)
        else:
            ax.plot(run.steps_T, y_T, lw=1.0, label=run.name)
    ax.set_title(f"{title} (lines: {SMOOTH_WINDOW}-step mean)" if many else title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if many:  # beside the axes, where it hides no curve
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + len(runs) // 16)
    elif len(runs) > 1:
        ax.legend(fontsize=7)
    return _png(fig)
