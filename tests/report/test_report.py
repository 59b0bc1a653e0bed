"""unit tier: `moe-rl report` on run directories written like the trainer writes them (real
config.yaml from the config tree, metrics.jsonl lines with the monitor's keys): verdict numbers,
truncated files, A/B comparison, valid HTML with every figure, and rendering in headless Chromium."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import html5lib
import numpy as np
import pytest
from click.testing import CliRunner

from moe_rl.cli import main
from moe_rl.config import RoutingConfig, RunConfig, to_yaml
from moe_rl.report import data
from moe_rl.report.data import load_run
from moe_rl.report.render import write_report
from moe_rl.report.run_files import ReportError
from tests.report.records import LAYERS
from tests.report.records import record as _record

# the start / final reward definitions, as the report prints them
START_DEF = "reward/mean of the first logged step (the warm start, before any update)"
FINAL_DEF = "mean reward/mean over the last 10 logged steps"


def _run_dir(
    path: Path, steps_logged: int, steps: int = 40, replay: str = "off", truncate: bool = False
) -> Path:
    path.mkdir(parents=True)
    cfg = dataclasses.replace(
        RunConfig(), run_dir=str(path), steps=steps, routing=RoutingConfig(replay=replay)
    )
    (path / "config.yaml").write_text(to_yaml(cfg))
    lines = [json.dumps(_record(s, replay)) for s in range(steps_logged)]
    text = "\n".join(lines) + "\n"
    if truncate:
        text += json.dumps(_record(steps_logged, replay))[:57]  # killed mid-write
    (path / "metrics.jsonl").write_text(text)
    return path


@pytest.mark.unit
def test_verdicts_state_the_measured_numbers(tmp_path):
    run = load_run(_run_dir(tmp_path / "a", 30))
    verdicts = {v.layer: v for v in data.layer_verdicts(run)}
    assert list(verdicts) == list(LAYERS)
    v1 = verdicts[1]
    assert v1.level == "warn"
    # the one problem of layer 1 is named; 40% is above the 10% threshold
    assert (
        "40% of experts got no router gradient per step (mean over the last 30 steps): gradient blackout"
        in v1.texts
    )
    assert "12.0% of routes differ between rollout and learner" in v1.texts  # > 5%, replay off
    assert "zero-gradient fraction 0.750 vs structural 0.750 (as the gating implies)" in v1.texts
    # layers 0 and 2 give every expert router gradient: a 0% finding, no problem named
    for lid in (0, 2):
        assert verdicts[lid].findings[0] == (
            "0% of experts got no router gradient per step (mean over the last 30 steps)",
            False,
        )
        assert not [t for t in verdicts[lid].texts if "blackout" in t]
    assert "0.4% of routes flip within a step's update" in v1.texts
    assert "load entropy 0.85 (busiest expert 20% of routes)" in v1.texts
    assert verdicts[2].findings[-2] == ("load entropy 0.75 (busiest expert 20% of routes)", True)
    assert verdicts[2].level == "warn"  # load entropy under 0.8 (and rollout flips)
    heads = dict(data.headline(run))
    # the outcome table's definitions: the first logged step's reward, the mean of the last 10
    assert heads[f"start reward: {START_DEF}"] == 0.5
    assert heads[f"final reward: {FINAL_DEF}"] == pytest.approx(
        np.mean([0.5 + s / 100 for s in range(20, 30)])
    )
    assert heads["status"] == "in progress or stopped: 30 of 40 steps logged"


@pytest.mark.unit
def test_r3_flips_are_explained_not_alarmed(tmp_path):
    run = load_run(_run_dir(tmp_path / "b", 10, replay="r3"))
    v0 = data.layer_verdicts(run)[0]
    assert (
        "12.0% of routes differ between rollout and learner (R3 trains on the rollout's routes)" in v0.texts
    )
    assert v0.level == "ok"
    assert not [t for v in data.layer_verdicts(run) if v.level == "ok" for t in v.texts if "blackout" in t]


def _check_html(html_path: Path, expected_figures: int) -> str:
    text = html_path.read_text()
    html5lib.HTMLParser(strict=True).parse(text)  # raises on any parse error
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text  # self-contained
    imgs = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(imgs) == expected_figures
    assert 'id="summary"' in text and '<table class="verdicts">' in text and "config.yaml</summary>" in text
    return text


@pytest.mark.unit
def test_report_of_a_run_killed_mid_write(tmp_path):
    run_dir = _run_dir(tmp_path / "killed", 25, truncate=True)
    html = write_report([run_dir])
    assert html == run_dir / "report" / "report.html"
    # 6 heatmaps + the curves these records carry: reward, flips (2), k3, router norm
    text = _check_html(html, 6 + 5)
    assert "line 26: truncated last line dropped" in text
    md = (html.parent / "report.md").read_text()
    assert "in progress or stopped: 25 of 40 steps logged" in md
    # the finding that crosses its threshold is in bold
    assert (
        "- layer 1 **warn**: **40% of experts got no router gradient per step (mean over the last 25 steps): "
        "gradient blackout**" in md
    )
    figures = sorted(p.name for p in (html.parent / "figures").iterdir())
    assert len(figures) == 11 and all(f"figures/{f}" in md for f in figures)
    # the per-layer blackout that varies is drawn; the zero fraction, (E - K) / E by construction, is not
    assert "heatmap_no_grad_expert_frac.png" in figures and "heatmap_zero_frac.png" not in figures


@pytest.mark.unit
def test_compare_two_runs_side_by_side(tmp_path):
    a, b = _run_dir(tmp_path / "off", 40, replay="off"), _run_dir(tmp_path / "r3", 40, replay="r3")
    result = CliRunner().invoke(main, ["report", str(a), str(b), "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    text = _check_html(tmp_path / "cmp" / "report.html", 11)
    assert "Router stability report: off vs r3" in text
    row = re.search(r"<tr><td>routing.replay</td><td>(\w+)</td><td>(\w+)</td></tr>", text)
    assert row and row.groups() == ("off", "r3")
    assert text.count('<table class="verdicts">') == 2
    assert "finished: 40 of 40 steps logged" in text
    # two runs: verdicts first, the curves once, after the heatmaps
    assert text.count("<h2>Reward, correction and mismatch</h2>") == 1
    assert text.index("<h2>Verdicts per layer") < text.index("<h2>Reward, correction and mismatch</h2>")


@pytest.mark.unit
def test_bad_run_dirs_fail_naming_the_path(tmp_path):
    with pytest.raises(ReportError, match=r"empty/metrics.jsonl does not exist"):
        load_run(tmp_path / "empty")
    result = CliRunner().invoke(main, ["report", str(tmp_path / "nope")])
    assert result.exit_code != 0 and "nope/metrics.jsonl does not exist" in result.output


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _browse(tmp_path: Path, html: Path, height: int) -> tuple[str, np.ndarray]:
    """The page as headless Chromium leaves it after its scripts (the DOM) and as it draws it
    (RGB pixels of a 1200 x ``height`` window)."""
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium (see .ci/run)")
        pytest.skip("chromium is not installed (CI installs it)")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'prof'}"]
    run = dict(capture_output=True, text=True, timeout=120, check=True)
    dom = subprocess.run([*flags, "--virtual-time-budget=5000", "--dump-dom", html.as_uri()], **run).stdout
    shot = tmp_path / "shot.png"
    subprocess.run(
        [*flags, "--hide-scrollbars", f"--window-size=1200,{height}", f"--screenshot={shot}", html.as_uri()],
        **run,
    )
    from PIL import Image

    return dom, np.asarray(Image.open(shot).convert("RGB"), dtype=np.int64)


@pytest.mark.unit
def test_html_renders_in_headless_chromium(tmp_path):
    a, b = _run_dir(tmp_path / "off", 40), _run_dir(tmp_path / "r3", 40, replay="r3")
    html = write_report([a, b], tmp_path / "cmp")
    dom, rgb = _browse(tmp_path, html, 4000)
    m = re.search(r'data-images-decoded="(\d+)" data-images-total="(\d+)"', dom)
    assert m and m.groups() == ("11", "11"), dom[:500]  # the page's script ran and every figure decoded
    # each figure: its PNG's own size (natural) and the size the page drew it at, both nonzero
    seen = re.findall(r'data-seen="(\d+)x(\d+) (\d+)x(\d+)"', dom)
    assert len(seen) == 11 and all(min(map(int, s)) > 0 for s in seen), seen
    # what a person reads: the reward rows of the summary (one definition, the outcome table's
    # numbers: 0.5 at step 0, the mean of 0.5 + s/100 over steps 30..39), the verdicts, no shared
    # expert outside the config dumps (these models have none)
    final = f"{np.mean([0.5 + s / 100 for s in range(30, 40)]):.4g}"
    cell = '</td><td class="num">'
    assert f"<td>start reward: {START_DEF}{cell}0.5{cell}0.5</td>" in dom
    assert f"<td>final reward: {FINAL_DEF}{cell}{final}{cell}{final}</td>" in dom
    assert f"<td>off{cell}0.5{cell}{final}</td>" in dom and f"<td>r3{cell}0.5{cell}{final}</td>" in dom
    assert "gradient blackout" in dom and "10% of steps" not in dom
    visible = re.sub(r"<details>.*?</details>", "", dom, flags=re.S)
    assert "shared" not in visible.lower()
    assert rgb.shape == (4000, 1200, 3)
    # the figures are the only saturated colour on the page (tables and text are grey, the warn /
    # ok rows pale): drawn heatmaps put thousands of such pixels on screen
    chroma = rgb.max(axis=2) - rgb.min(axis=2)
    assert (chroma > 80).mean() > 0.02, (chroma > 80).mean()


@pytest.mark.unit
def test_collapse_step_and_gradient_spikes_by_their_definitions():
    from moe_rl.report.outcome import collapse_step, grad_spikes

    steps_T = np.arange(60)
    reward_T = np.where(steps_T < 30, 0.5, 0.0)
    # the 10 steps from t hold 30 - t steps at 0.5: mean below 25% of 0.5 once fewer than 2.5
    assert collapse_step(steps_T, reward_T) == 28
    assert collapse_step(steps_T, np.full(60, 0.5)) is None  # flat: never
    assert collapse_step(steps_T[:10], np.zeros(10)) is None  # under start + window steps: not judged
    assert collapse_step(steps_T[:11], np.r_[0.5, np.zeros(10)]) == 1  # 11: judged
    assert collapse_step(steps_T + 100, reward_T) == 128  # logged step numbers, not indices
    # the reference is the warm start's own step (0.5), not a mean that holds the run's first updates:
    # a fall at step 1 to 0.1 would be hidden by a 5-step reference (0.18: 25% is 0.045) and is not here.
    # The 10 steps from step 1 are all 0.1 < 0.125
    fast_T = np.where(steps_T < 1, 0.5, 0.1)
    assert collapse_step(steps_T, fast_T) == 1
    assert collapse_step(steps_T, fast_T, start=5) is None
    # 30% of the start for good is a fall, not a collapse
    assert collapse_step(steps_T, np.where(steps_T < 1, 0.2, 0.06)) is None
    # exactly 25% of the start is not below it (binary-exact values: sums compared, not rounded means)
    assert collapse_step(steps_T, np.where(steps_T < 5, 0.5, 0.125)) is None
    grad_T = np.ones(40)
    grad_T[[3, 10, 20, 30]] = [99.0, 6.0, 4.0, 50.0]  # step 3: too little history; 20: only 4x
    assert grad_spikes(grad_T) == 2


def _collapsing_run(path: Path, steps: int, trm: bool) -> Path:
    """A run whose reward holds at 0.5 for 30 steps, then drops to 0; one grad-norm spike; from
    step 50 every one of its 2 minibatches has no gradient (skipped)."""
    _run_dir(path, 0, steps=steps)
    recs = []
    for s in range(steps):
        rec = _record(s, "off")
        rec.update(
            {
                "reward/mean": 0.5 if s < 30 else 0.0,
                "corr/k3_kl": 0.01 * (s + 1),
                "train/grad_norm": 100.0 if s == 35 else 1.0,
                "routing/flip_router_frac": 0.2,
                "train/skipped_minibatches": 2 if s >= 50 else 0,
            }
        )
        if trm:
            rec["corr/trm_accept_rate"] = 0.8
        recs.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("\n".join(recs) + "\n")
    return path


@pytest.mark.unit
def test_report_compares_n_runs_with_an_outcome_table(tmp_path):
    a = _run_dir(tmp_path / "x" / "off", 60, steps=60)
    b = _run_dir(tmp_path / "y" / "off", 60, steps=60, replay="r3")  # the same name: told apart by parent
    c = _collapsing_run(tmp_path / "collapse", 60, trm=True)
    d = _run_dir(tmp_path / "short", 10, steps=10)
    e = _run_dir(tmp_path / "e", 60, steps=60)
    result = CliRunner().invoke(main, ["report", str(a), str(b), str(c), str(d), str(e)])
    assert result.exit_code == 0, result.output
    out = a / "compare_5_runs"
    # 6 heatmaps (5 runs wrapped into 2 rows on one scale) + the curves: reward, flips (3), k3,
    # grad norm, TRM acceptance, router norm
    text = _check_html(out / "report.html", 6 + 8)
    assert "Router stability report: 5 runs" in text
    assert text.count('<table class="verdicts">') == 5
    # a grid of runs: the shared-axes curves right after the outcome table, before the verdicts
    assert text.count("<h2>Reward, correction and mismatch</h2>") == 1
    assert (
        text.index('<table id="outcome">')
        < text.index("<h2>Reward, correction and mismatch</h2>")
        < text.index("<h2>Verdicts per layer")
    )
    md = (out / "report.md").read_text()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines()]
    rows = {
        c[0]: c[1:] for c in cells if len(c) == 10 and c[0] in ("x/off", "y/off", "collapse", "short", "e")
    }
    assert sorted(rows) == ["collapse", "e", "short", "x/off", "y/off"]
    # collapse: 0.5 then 0 from step 30; final reward 0; peak k3 0.01 x 60; one spike at step 35
    # 2 skipped minibatches in each of steps 50-59
    assert rows["collapse"] == ["0.5", "0", "28", "0.6", "0.305", "1", "0.2", "0.8", "20"]
    # a steadily learning run (0.5 + step/100) never collapses; 10 steps are too few to tell
    assert rows["x/off"][1:3] == [f"{np.mean([0.5 + s / 100 for s in range(50, 60)]):.4g}", "none"]
    assert rows["short"][2] == "n/a" and rows["e"][7].startswith("not logged")  # no TRM in e
    assert rows["e"][8] == "not logged"  # a run from before train/skipped_minibatches
    assert "mean reward/mean of 10 consecutive steps is below 25% of the start reward" in md
    # the config keys that differ, over all five runs
    assert re.search(r"\| routing.replay \| off \| r3 \| off \| off \| off \|", md)


@pytest.mark.unit
def test_grid_curves_colour_by_arm_and_smooth_over_finite_steps():
    from types import SimpleNamespace

    from moe_rl.report.figures import _style, trailing_mean

    y_T = np.array([1.0, 2.0, np.nan, 4.0, 5.0, np.nan, np.nan])
    # window 2: the finite values among the last two entries; none finite -> NaN
    np.testing.assert_array_equal(trailing_mean(y_T, 2), [1.0, 1.5, 2.0, 4.0, 4.5, 5.0, np.nan])
    np.testing.assert_allclose(trailing_mean(np.arange(5.0), 10), [0.0, 0.5, 1.0, 1.5, 2.0])
    names = ["none_s0", "none_s1", "r3_s0", "r3_s1", "onpolicy_s0", "other"]
    styles = _style([SimpleNamespace(name=n) for n in names])
    colours = [s["color"] for s in styles]
    assert colours[0] == colours[1] and colours[2] == colours[3]  # seeds of an arm share a colour
    assert len({colours[i] for i in (0, 2, 4, 5)}) == 4  # arms differ
    assert [s["linestyle"] for s in styles] == ["-", "--", "-", "--", "-", "-"]  # seeds differ by style


@pytest.mark.unit
def test_dense_layers_are_labelled_dense_and_the_shared_expert_share_is_stated(tmp_path):
    """A DeepSeek-style run (layer 0 dense, a shared expert): layer 0 is a dense row, never an empty
    MoE layer; each MoE layer's verdict states its measured share and the config's FLOP share."""
    from moe_rl.config import ModelConfig

    path = tmp_path / "ds"
    path.mkdir()
    model = ModelConfig(
        num_layers=3,
        first_k_dense=1,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_shared_expert_ffn_hidden_size=128,
    )
    cfg = dataclasses.replace(RunConfig(), run_dir=str(path), steps=4, model=model)
    (path / "config.yaml").write_text(to_yaml(cfg))
    recs = []
    for step in range(4):
        rec = {"step": step, "router_grad/zero_frac_expected": 0.75}
        for lid, share in ((1, 0.2 + 0.1 * step), (2, 0.5)):  # layer 1: 0.2 0.3 0.4 0.5, mean 0.35
            rec[f"router_grad/zero_frac/layer{lid}"] = 0.75
            rec[f"router_grad/shared_expert_share/layer{lid}"] = share
        rec["router_grad/shared_expert_share"] = (rec["router_grad/shared_expert_share/layer1"] + 0.5) / 2
        recs.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("\n".join(recs) + "\n")
    loads = [  # layer 1 drifts from uniform onto expert 0; layer 2 stays uniform
        {"step": s, "layers": {"1": [0.125 + 0.125 * s] + [(0.875 - 0.125 * s) / 7] * 7, "2": [0.125] * 8}}
        for s in range(4)
    ]
    (path / "expert_load.jsonl").write_text("".join(json.dumps(x) + "\n" for x in loads))
    run = load_run(path)
    assert (run.moe_layers, run.dense_layers, run.layers) == ([1, 2], [0], [0, 1, 2])
    load_LE = run.expert_load_LE()  # x E, mean over the steps: layer 1 expert 0 (0.125..0.5 -> 0.3125) x 8
    assert load_LE.shape == (3, 8) and np.isnan(load_LE[0]).all()
    assert load_LE[1, 0] == pytest.approx(2.5) and load_LE[1, 1:] == pytest.approx([(8 - 2.5) / 7] * 7)
    assert load_LE[2] == pytest.approx([1.0] * 8)
    assert run.expert_load_LE(window=1)[1, 0] == pytest.approx(4.0)  # the last step alone: 0.5 x 8
    assert run.shared_expert_flop_share() == 128 / (128 + 2 * 64)
    m_LT = run.matrix("shared_expert_share")
    assert np.isnan(m_LT[0]).all() and m_LT[1].tolist() == pytest.approx([0.2, 0.3, 0.4, 0.5])
    verdicts = {v.layer: v for v in data.layer_verdicts(run)}
    assert verdicts[0].level == "dense" and verdicts[0].texts == [
        "an MLP without router (model.first_k_dense = 1): no routing metrics"
    ]
    assert "shared expert 35.0% of the MoE output norm (50.0% of its expert FLOPs)" in verdicts[1].texts
    assert "shared expert 50.0% of the MoE output norm (50.0% of its expert FLOPs)" in verdicts[2].texts
    head = dict(data.headline(run))
    assert head["shared-expert share of the MoE output norm (mean)"] == pytest.approx(0.425)
    assert head["dense layers (no router)"] == "0"
    html = _check_html(write_report([path]), expected_figures=2)  # shared share, expert load
    assert "<figcaption>expert_load.jsonl</figcaption>" in html
    assert '<tr class="dense"><td>layer 0 (dense)</td><td>dense: an MLP without router' in html
    # a run without dense layers or a shared expert says neither
    plain = load_run(_run_dir(tmp_path / "plain", 3))
    assert plain.dense_layers == [] and "dense layers (no router)" not in dict(data.headline(plain))
    assert not [t for v in data.layer_verdicts(plain) for t in v.texts if "shared expert" in t]


def _small_run(path: Path, shared: int = 0) -> Path:
    """3 logged steps of a 4-expert, 2-layer model: one validation point (step 2), update flips 0
    everywhere, a median margin of 0.3 everywhere, and a per-expert load line per step."""
    from moe_rl.config import ModelConfig

    path.mkdir(parents=True)
    model = ModelConfig(num_layers=2, num_experts=4, moe_shared_expert_ffn_hidden_size=shared)
    (path / "config.yaml").write_text(to_yaml(dataclasses.replace(RunConfig(), steps=3, model=model)))
    recs = []
    for step in range(3):
        rec = {"step": step, "reward/mean": 0.25 * step}
        for lid in (0, 1):
            rec[f"router_grad/zero_frac/layer{lid}"] = 0.5  # (E - K) / E: names the MoE layers
            rec[f"router_grad/update_flip_frac/layer{lid}"] = 0.0
            rec[f"router_grad/margin_p50/layer{lid}"] = 0.3
        if step == 2:
            rec["val/reward/mean"] = 0.75
        recs.append(json.dumps(rec) + "\n")
    (path / "metrics.jsonl").write_text("".join(recs))
    loads = [{"step": s, "layers": {"0": [0.25] * 4, "1": [0.7, 0.1, 0.1, 0.1]}} for s in range(3)]
    (path / "expert_load.jsonl").write_text("".join(json.dumps(x) + "\n" for x in loads))
    return path


def _visible_ticks(ax, axis: str = "x") -> list[float]:
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    return [float(t) for t in (ax.get_xticks() if axis == "x" else ax.get_yticks()) if lo <= t <= hi]


@pytest.mark.unit
def test_figures_by_their_numbers(tmp_path):
    """Read back from matplotlib: integer step and expert ticks, colour limits of constant data,
    a single validation point drawn as a marker on a 1-step-wide axis, shared-expert wording only
    for a model with one."""
    import matplotlib.pyplot as plt

    from moe_rl.report import figures

    run = load_run(_small_run(tmp_path / "small"))
    # a single point: a marker, on an x axis that spans the logged steps 0..2
    fig = figures.curve_figure([run], "val/reward/mean", "val")
    (line,) = fig.axes[0].lines
    assert (line.get_marker(), list(line.get_xdata()), list(line.get_ydata())) == ("o", [2], [0.75])
    lo, hi = fig.axes[0].get_xlim()
    assert lo <= 0 and hi >= 2 and hi - lo >= 2
    assert _visible_ticks(fig.axes[0]) == [0.0, 1.0, 2.0]
    plt.close(fig)
    # the useful-fraction panel (docs/sampling.md): groups with signal / groups generated, per step
    for rec, frac in zip(run.records, (0.5, 0.625, 0.75)):
        rec["sampling/useful_frac"] = frac
    title = dict(data.CURVES)["sampling/useful_frac"]
    fig = figures.curve_figure([run], "sampling/useful_frac", title)
    (line,) = fig.axes[0].lines
    assert (list(line.get_xdata()), list(line.get_ydata())) == ([0, 1, 2], [0.5, 0.625, 0.75])
    assert fig.axes[0].get_title() == title
    plt.close(fig)
    # all-zero data on a free scale: 0..1, not a 1e-12 span; constant 0.3: 0..0.3
    for name, clim in (("update_flip_frac", (0.0, 1.0)), ("margin_p50", (0.0, 0.3))):
        fig = figures.heatmap_figure([run], name, name, None)
        assert fig.axes[0].images[0].get_clim() == clim, name
        assert _visible_ticks(fig.axes[0]) == [0.0, 1.0, 2.0]  # steps
        assert _visible_ticks(fig.axes[0], "y") == [0.0, 1.0]  # layers
        plt.close(fig)
    # 4 experts: ticks on the experts 0..3; load x E, colour scale from 0 to the busiest (0.7 x 4)
    fig = figures.expert_load_figure([run])
    im = fig.axes[0].images[0]
    assert _visible_ticks(fig.axes[0]) == [0.0, 1.0, 2.0, 3.0]
    assert im.get_array().shape == (2, 4) and im.get_clim() == (0.0, pytest.approx(2.8))
    assert "shared" not in fig._suptitle.get_text()
    plt.close(fig)
    shared = load_run(_small_run(tmp_path / "shared", shared=32))
    fig = figures.expert_load_figure([shared])
    assert "the shared expert, not drawn, takes every token" in fig._suptitle.get_text()
    plt.close(fig)


def _load_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.mark.unit
def test_bad_expert_load_lines_are_skipped_naming_file_and_line(tmp_path):
    run_dir = _small_run(tmp_path / "bad")
    good = {"0": [0.25] * 4, "1": [0.7, 0.1, 0.1, 0.1]}
    load = _load_lines(
        run_dir / "expert_load.jsonl",
        [
            {"step": 0, "layers": good},
            {"step": 1, "layers": {"0": [0.25] * 4, "1": [0.5, 0.5, 0.0]}},  # 3 shares of 4
            {"step": 2, "layers": [[0.25] * 4, [0.25] * 4]},  # layers as a list
            {"step": 3, "layers": {"0": [0.25] * 4, "1": [0.1, 0.1, 0.1, 0.7]}},
        ],
    )
    run = load_run(run_dir)
    assert run.warnings == [
        f"{load}: line 2: layer 1 has 3 load shares, expected 4 (model.num_experts); skipped",
        f"{load}: line 3: 'layers' is a list, expected an object {{layer: [shares]}}; skipped",
    ]
    # the rest is drawn: steps 0 and 3, layer 1's mean share x 4
    assert [r["step"] for r in run.load_records] == [0, 3]
    np.testing.assert_allclose(run.expert_load_LE()[1], [1.6, 0.4, 0.4, 1.6])
    result = CliRunner().invoke(main, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    html = (run_dir / "report" / "report.html").read_text()
    assert f"<li>{load}: line 2: layer 1 has 3 load shares" in html
    assert (run_dir / "report" / "figures" / "heatmap_expert_load.png").is_file()
    # a wrong length on every line: nothing drawn, and said
    _load_lines(load, [{"step": s, "layers": {"0": [0.2] * 5, "1": [0.2] * 5}} for s in range(7)])
    run = load_run(run_dir)
    assert run.warnings == [
        f"{load}: lines 1, 2, 3, 4, 5 and 2 more (7 of 7): layer 0 has 5 load shares, expected 4 "
        "(model.num_experts); skipped",
        f"{load}: no line could be read: the per-expert load is not drawn",
    ]
    assert run.expert_load_LE().shape == (0, 0)


@pytest.mark.unit
def test_a_full_disk_leaves_no_partial_report(tmp_path, monkeypatch):
    """ENOSPC at the last file (report.html, after the 5 PNGs and report.md): exit 2 naming it,
    and the disk as before: no report directory on a first report, the earlier report untouched
    on a second."""
    import errno

    from tests.cli_helpers import snapshot

    run_dir = _small_run(tmp_path / "run")
    real_fdopen, calls = os.fdopen, []

    def fdopen_full_at_7(fd, *args, **kwargs):
        calls.append(fd)
        if len(calls) == 7:
            os.close(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fdopen(fd, *args, **kwargs)

    def report_on_a_full_disk() -> None:
        calls.clear()
        before = snapshot(tmp_path)
        monkeypatch.setattr("os.fdopen", fdopen_full_at_7)
        result = CliRunner().invoke(main, ["report", str(run_dir)])
        monkeypatch.setattr("os.fdopen", real_fdopen)
        assert len(calls) == 7
        assert (result.exit_code, result.stderr) == (
            2,
            f"error: no space left on device: {run_dir / 'report' / 'report.html'}\n",
        )
        assert snapshot(tmp_path) == before

    report_on_a_full_disk()
    assert not (run_dir / "report").exists()
    write_report([run_dir])
    assert len(list((run_dir / "report" / "figures").iterdir())) == 5
    report_on_a_full_disk()


@pytest.mark.unit
def test_the_mismatch_split_figure_draws_both_sides_on_the_steps_it_was_logged(tmp_path):
    """The split logged on steps 0 and 2 (log.mismatch_split_every=2): one panel per run that logged
    it, native and replayed lines through those steps only, the band between them filled; a run
    without it gets no panel, and no run with it: no figure (listed as not logged)."""
    import matplotlib.pyplot as plt

    from moe_rl.report import figures

    split_dir, plain_dir = _small_run(tmp_path / "split"), _small_run(tmp_path / "plain")
    recs = [json.loads(x) for x in (split_dir / "metrics.jsonl").read_text().splitlines()]
    for rec in recs:
        if rec["step"] % 2 == 0:
            rec.update({"mismatch/k3_native": 0.004 + rec["step"] * 1e-3, "mismatch/k3_replayed": 0.001})
    _load_lines(split_dir / "metrics.jsonl", recs)
    split, plain = load_run(split_dir), load_run(plain_dir)
    assert figures.mismatch_split_figure([plain]) is None
    fig = figures.mismatch_split_figure([plain, split])
    (ax,) = [a for a in fig.axes if a.get_visible()]
    assert ax.get_title() == "split"
    native, replayed = ax.lines
    assert (list(native.get_xdata()), list(native.get_ydata())) == ([0, 2], [0.004, 0.006])
    assert (list(replayed.get_xdata()), list(replayed.get_ydata())) == ([0, 2], [0.001, 0.001])
    (band,) = ax.collections  # between replayed (below) and native (above)
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(0.001) and ys.max() == pytest.approx(0.006)
    plt.close(fig)
    html = write_report([split_dir], tmp_path / "out")
    assert (html.parent / "figures" / "mismatch_split.png").is_file()
    assert figures.SPLIT_TITLE not in html.read_text().split("Not logged by these runs")[-1]
