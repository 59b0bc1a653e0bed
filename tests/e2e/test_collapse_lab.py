"""e2e tier: `scripts/collapse_lab.py --ci` runs its two arms as real `moe-rl train` runs and
writes the grid's N-run report and per-arm table. Nothing about learning is asserted (3 steps):
only that the mismatch settings reach the runs and the outputs hold every arm's numbers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _lab():
    spec = importlib.util.spec_from_file_location("collapse_lab", ROOT / "scripts" / "collapse_lab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.unit
def test_lab_defaults_are_the_documented_setting_and_all_means_every_arm():
    lab = _lab()
    args = lab.parse([])
    assert (args.arm_list, args.seed_list, args.steps) == (["none", "r3", "onpolicy"], [0, 1, 2], 100)
    assert lab.arm_overrides("none", args) == ["rollout.router_noise=1.5", "rollout.dtype=bf16", "rollout.staleness=0",
                                               "optim.lr=0.0004", "algo.num_minibatches=8"]
    # the control drops every engine-side mismatch, after any --set
    ctl = lab.arm_overrides("onpolicy", lab.parse(["--set", "rollout.router_noise=0.7"]))
    assert ctl[-3:] == ["rollout.router_noise=0.0", "rollout.dtype=fp32", "rollout.staleness=0"]
    assert lab.parse(["--arms", "all"]).arm_list == list(lab.ARMS) and len(lab.ARMS) == 10
    with pytest.raises(SystemExit):
        lab.parse(["--arms", "none,bogus"])


@pytest.mark.e2e
def test_collapse_lab_ci_grid_runs_and_reports(tmp_path):
    out = tmp_path / "lab"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "collapse_lab.py"), "--ci", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = {arm: [json.loads(x) for x in (out / f"{arm}_s0" / "metrics.jsonl").read_text().splitlines()]
            for arm in ("none", "r3")}
    for arm, rs in recs.items():
        assert [r["step"] for r in rs] == [0, 1, 2]
        assert [r["rollout/policy_lag"] for r in rs] == [0.0, 1.0, 2.0]  # rollout.staleness=2 reached the run
        cfg = yaml.safe_load((out / f"{arm}_s0" / "config.yaml").read_text())
        assert (cfg["rollout"]["router_noise"], cfg["rollout"]["staleness"], cfg["seed"]) == (1.5, 2, 0)
        assert cfg["routing"]["replay"] == ("r3" if arm == "r3" else "off")
    # step 0: the same weights and rollouts in both arms; R3 replays the noisy engine's routes, so
    # the rollout-vs-learner mismatch it trains on is smaller
    assert recs["r3"][0]["reward/mean"] == recs["none"][0]["reward/mean"]
    assert 0 < recs["r3"][0]["corr/k3_kl"] < recs["none"][0]["corr/k3_kl"]
    table = (out / "table.md").read_text()
    rows = {c[0]: c[1:] for c in ([x.strip() for x in line.strip().strip("|").split("|")]
                                  for line in table.splitlines()) if c[0] in ("none", "r3")}
    for arm, rs in recs.items():
        peak = max(r["corr/k3_kl"] for r in rs)
        assert rows[arm][:2] == ["1", f"{rs[0]['reward/mean']:.3g}"]  # start: the warm start's step
        assert rows[arm][3] == "n/a" and rows[arm][5] == f"{peak:.3g}"  # 3 steps: collapse not judged
    html = (out / "report" / "report.html").read_text()
    assert "Router stability report: none_s0 vs r3_s0" in html and html.count('<table class="verdicts">') == 2
    assert '<table id="outcome">' in html
