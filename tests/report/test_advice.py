"""unit tier: the report's one verdict per run and its advice table (moe_rl/report/advice.py) on
run directories written like the trainer writes them (tests/report/test_report.py's records with
crafted per-layer values): the exact verdict line of a healthy run, of a blackout at a known step
and layer, of two problems (the first by its start step), through `moe-rl report` (stdout, the HTML
top, report.md); and every knob the advice names is a config key, every docs section it cites exists."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moe_rl.cli import main
from moe_rl.config import RoutingConfig, RunConfig, to_dict, to_yaml
from moe_rl.report import advice
from moe_rl.report.data import flat_config, load_run
from tests.report.records import LAYERS, record

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
BLACKOUT_TRY = (
    "try model.router_aux_loss_coeff=0.001, model.expert_bias_update=native (sigmoid routers with an "
    "expert bias), more rollout.prompts_per_step (more tokens routed a step) "
    "(docs/math.md 7.1, docs/report.md 5)"
)
FLIPS_TRY = (
    "try routing.replay=r3, correction.is_level=token, correction.trm.max=0.05 (docs/correction.md 2, 3)"
)


def _healthy(step: int) -> dict:
    """test_report's record with every per-layer value inside its threshold."""
    rec = record(step, "off")
    for lid in LAYERS:
        rec[f"router_grad/no_grad_expert_frac/layer{lid}"] = 0.0
        rec[f"router_grad/never_selected_frac/layer{lid}"] = 0.0
        rec[f"router_grad/rollout_flip_frac/layer{lid}"] = 0.01
        rec[f"router_grad/load_entropy/layer{lid}"] = 0.95
    return rec


def _run(path: Path, *changes, steps: int = STEPS) -> Path:
    """A run dir of ``steps`` healthy records; each change (key, first step, value) sets ``key`` from
    that step on."""
    path.mkdir(parents=True)
    cfg = dataclasses.replace(
        RunConfig(), run_dir=str(path), steps=steps, routing=RoutingConfig(replay="off")
    )
    (path / "config.yaml").write_text(to_yaml(cfg))
    lines = []
    for s in range(steps):
        rec = _healthy(s)
        rec.update({key: value for key, first, value in changes if s >= first})
        lines.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def _verdict(run_dir: Path) -> str:
    return advice.verdict_line(advice.problems(load_run(run_dir)))


def _cli_verdict(run_dir: Path) -> str:
    """`moe-rl report RUN_DIR`: the verdict is its first stdout line, the HTML's first paragraph
    after the title and report.md's first line after the title; returns it."""
    result = CliRunner().invoke(main, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    line = result.stdout.splitlines()[0]
    html = (run_dir / "report" / "report.html").read_text()
    top = html[html.index("<h1>") : html.index("<h2>")]  # above the first section
    assert (
        re.search(r'<div id="verdict"><p class="verdict (ok|warn)"><strong>(.*?)</strong></p></div>', top)[2]
        == line
    )
    md = (run_dir / "report" / "report.md").read_text().splitlines()
    assert md[2] == f"**{line}**"
    return line


def test_a_healthy_run(tmp_path):
    run = _run(tmp_path / "healthy")
    assert _cli_verdict(run) == "verdict: healthy (no warning to act on or watch)"
    html = (run / "report" / "report.html").read_text()
    assert 'id="what-to-do"' not in html  # nothing to list


def test_a_blackout_at_step_25_in_layer_2(tmp_path):
    key = "router_grad/no_grad_expert_frac/layer2"
    tokens = ("rollout/num_response_tokens", 0, 2000.0)  # 2000 x K=2 / E=8 = 500 routes an expert
    run = _run(tmp_path / "blackout", (key, 25, 0.5), tokens)
    assert _cli_verdict(run) == (
        "verdict: watch: gradient blackout in layer 2 from step 25 (19% of experts got no router gradient "
        f"per step (mean over the last 40 steps)); {BLACKOUT_TRY}"
    )
    # the same with half the experts chosen by no token from step 30: dead experts, act, dated by
    # when no token chose them
    dead = _run(
        tmp_path / "dead", (key, 25, 0.5), tokens, ("router_grad/never_selected_frac/layer2", 30, 0.5)
    )
    (p,) = advice.problems(load_run(dead))
    assert (p.severity, p.step) == ("act", 30)
    assert p.why == "12% of the layer's experts were chosen by no token: dead experts"  # 10 x 0.5 / 40
    assert _verdict(dead).startswith("verdict: act: gradient blackout in layer 2 from step 30 (")


def test_a_blackout_at_the_quickstarts_scale_is_informational(tmp_path):
    """The issue's quickstart: a 20% blackout in one layer with 155 response tokens a step (the tiny
    default's) is chance at that scale, and the verdict says the run is healthy."""
    run = _run(
        tmp_path / "tiny",
        ("router_grad/no_grad_expert_frac/layer2", 0, 0.2),
        ("rollout/num_response_tokens", 0, 155.0),
        steps=STEPS,
    )
    assert _cli_verdict(run) == "verdict: healthy (no warning to act on or watch; 1 informational note below)"
    (p,) = advice.problems(load_run(run))
    assert (p.severity, p.layer, p.step) == ("info", 2, 0)
    assert p.why == (
        "at this scale (39 response-token routes per expert a step, under 100) an expert can get none "
        "by chance: nothing to do"
    )
    md = (run / "report" / "report.md").read_text()
    assert "| info | gradient blackout in layer 2 from step 0 |" in md


@pytest.mark.parametrize("flips_from, dead_from", [(12, 30), (30, 10)])
def test_two_problems_the_verdict_names_the_first_by_its_start_step(tmp_path, flips_from, dead_from):
    """Rollout flips in layer 0 and dead experts in layer 2, both act: the earlier one is named."""
    run = _run(
        tmp_path / "two",
        ("router_grad/rollout_flip_frac/layer0", flips_from, 0.3),
        ("router_grad/no_grad_expert_frac/layer2", dead_from, 0.5),
        ("router_grad/never_selected_frac/layer2", dead_from, 0.5),
    )
    found = advice.problems(load_run(run))
    assert [(p.check, p.layer, p.step, p.severity) for p in found] == sorted(
        [("rollout_flip_frac", 0, flips_from, "act"), ("no_grad_expert_frac", 2, dead_from, "act")],
        key=lambda t: t[2],
    )
    flips = f"{(0.01 * flips_from + 0.3 * (STEPS - flips_from)) / STEPS:.1%}"  # 0.01 before
    blackout = f"{0.5 * (STEPS - dead_from) / STEPS:.0%}"
    expected = {
        12: (
            f"verdict: act: rollout-vs-learner route flips in layer 0 from step 12 ({flips} of routes "
            f"differ between rollout and learner); {FLIPS_TRY}; 1 more warning below"
        ),
        30: (
            f"verdict: act: gradient blackout in layer 2 from step 10 ({blackout} of experts got no router "
            f"gradient per step (mean over the last 40 steps)); {BLACKOUT_TRY}; 1 more warning below"
        ),
    }[flips_from]
    assert _cli_verdict(run) == expected


def test_act_comes_before_an_earlier_watch(tmp_path):
    run = _run(
        tmp_path / "levels",
        ("router_grad/load_entropy/layer1", 0, 0.7),  # watch, from step 0
        ("router_grad/rollout_flip_frac/layer2", 20, 0.3),  # act, from step 20
    )
    assert _verdict(run).startswith("verdict: act: rollout-vs-learner route flips in layer 2 from step 20 (")
    assert [p.check for p in advice.problems(load_run(run))] == ["rollout_flip_frac", "load_entropy"]


def test_rollout_flips_dialled_in_by_router_noise_are_informational(tmp_path):
    run = _run(tmp_path / "noise", ("router_grad/rollout_flip_frac/layer0", 0, 0.2))
    cfg = (run / "config.yaml").read_text().replace("router_noise: 0.0", "router_noise: 0.05")
    (run / "config.yaml").write_text(cfg)
    (p,) = advice.problems(load_run(run))
    assert (p.severity, p.why) == ("info", "dialled in by rollout.router_noise=0.05: nothing to do")


def test_a_collapse_and_a_health_alarm_are_run_level_problems(tmp_path):
    run = _run(tmp_path / "collapse", ("reward/mean", 15, 0.0))
    events = {"step": 7, "event": "health", "alarm": "grad_norm_zero", "severity": "warning", "cause": "x"}
    (run / "events.jsonl").write_text(json.dumps(events) + "\n")
    found = advice.problems(load_run(run))
    # log.health.patience 3: the alarm at step 7 held from step 5; the first 10 steps whose mean
    # reward is below 25% of the start's 0.5 open at step 14 (0.64 and nine zeros)
    assert [(p.check, p.layer, p.step) for p in found] == [("health", None, 5), ("collapse", None, 14)]
    assert _verdict(run) == (
        "verdict: act: health alarm from step 5 (grad_norm_zero: x); try a lower optim.lr, task.reward / "
        "task.dataset (a reward no sample earns gives no gradient) (docs/reliability.md 6); "
        "1 more warning below"
    )


def test_start_step_skips_an_early_spike():
    steps_T = np.arange(10)
    excess_T = np.array([0.5, -0.3, -0.3, -0.3, -0.3, -0.3, 0.2, 0.2, np.nan, 0.2])
    assert advice.start_step(steps_T, excess_T) == 6  # step 0 crosses, but the mean from it does not
    assert advice.start_step(steps_T, -np.abs(excess_T)) is None


def test_every_knob_is_a_config_key_and_every_docs_section_exists():
    keys = set(flat_config(to_dict(RunConfig())))
    cited = []
    for name, a in advice.ADVICE.items():
        assert a.severity in advice.SEVERITIES, name
        assert a.knobs and a.docs and a.meaning.endswith("."), name
        for knob in a.knobs:
            assert knob.key in keys, f"{name}: {knob.key} is not a config key"
            assert knob.key in knob.text, f"{name}: {knob.text!r} does not name {knob.key}"
        cited += [(name, ref) for ref in a.docs]
    for name, ref in cited:
        m = re.fullmatch(r"docs/(\w+)\.md (\d+(?:\.\d+)*(?:, \d+(?:\.\d+)*)*)", ref)
        assert m, f"{name}: {ref!r} is not 'docs/<page>.md <section>[, <section>]'"
        text = (ROOT / "docs" / f"{m[1]}.md").read_text(encoding="utf-8")
        for num in m[2].split(", "):
            assert re.search(rf"^#{{2,3}} {re.escape(num)}\.? ", text, re.MULTILINE), (
                f"{name}: {ref}: no {num}"
            )
    # the advice table of docs/report.md 5 lists every entry with its severity and its knobs
    doc = (ROOT / "docs" / "report.md").read_text(encoding="utf-8")
    for a in advice.ADVICE.values():
        row = next((line for line in doc.splitlines() if line.startswith(f"| {a.name} |")), None)
        assert row is not None, f"docs/report.md 5 has no row for {a.name}"
        assert f"| {a.severity}" in row and all(f"`{k.key}`" in row for k in a.knobs), row
