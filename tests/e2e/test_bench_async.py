"""e2e tier: scripts/bench_async.py --quick runs every arm the config loader accepts (colocated
sync, split sync, one-step-off; async once accepted) as real pinned `moe-rl train` runs, prints
each arm's figures, and computes its ratios from the figures it printed. One property of the times
is asserted: every split run's share of its own ideal step (the busier role's busy fraction, each
role over the learner steps that contain its work, async's rollout rank over its own time) is at
most 1 (the margin the script states is 0), and the busy fractions it prints are the ones its
figures give. --quick runs 3 steps of 16
new tokens (2 of 48 before): 2 measured steps, the least the bound needs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_module import script_module

ROOT = Path(__file__).resolve().parents[2]
NUM = r"([0-9.]+)"


def _figures(text: str) -> dict[str, dict[str, float]]:
    """Each arm's printed figures: 'rep 0 NAME: steps/s X tokens/s Y | s: phase v phase v ...'."""
    out = {}
    for name, steps, tokens, phases in re.findall(
        rf"^rep 0 (\w+): steps/s {NUM} tokens/s {NUM} \| s: (.*)$", text, re.M
    ):
        words = phases.split()
        out[name] = {"steps_per_s": float(steps), "tokens_per_s": float(tokens)}
        out[name].update({k: float(v) for k, v in zip(words[::2], words[1::2])})
    return out


def _ratio(text: str, label: str) -> float:
    return float(re.search(rf"{re.escape(label)} {NUM} \(median\)", text).group(1))


@pytest.mark.e2e
def test_bench_async_quick_prints_every_arm_and_ratios_of_its_figures(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_async.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check(proc.stdout)


def _check(text: str) -> None:
    """The quick run's printed figures, ratios and bounds (its stdout)."""
    bench = script_module("bench_async")
    async_ok = bench.accepted([*dict(bench.ARMS)["split_async"], "init_weights="]) is None
    arms = ["colocated_sync", "split_sync", "split_one_step_off"] + (["split_async"] if async_ok else [])
    figs = _figures(text)
    assert sorted(figs) == sorted(arms)
    if not async_ok:
        assert "split_async: not run, the config loader refuses it: " in text
    for name in arms[1:]:  # the split runs report both roles' times (async: its wait for buffer room)
        rollout_wait = "rollout_wait_send" if name == "split_async" else "rollout_wait_weights"
        assert {"wait_batch", "rollout_generate", rollout_wait, "update"} <= set(figs[name])
    # 1 repetition: each ratio is the one from the printed figures (to their rounding)
    base, coloc = figs["split_sync"], figs["colocated_sync"]
    t_r, t_u = (float(x) for x in re.search(rf"t_rollout {NUM} s, t_update {NUM} s", text).groups())
    assert t_r == base["rollout_generate"] and t_u == pytest.approx(
        base["step"] - base["wait_batch"], abs=2e-4
    )
    predicted = (t_r + t_u) / max(t_r, t_u)
    assert _ratio(text, "predicted from them, (t_rollout + t_update) / max:") == pytest.approx(
        predicted, abs=2e-3
    )
    assert ("the learner is" if t_u >= t_r else "the rollout rank is") in text
    # the bound: each split run against its own ideal step, from its own printed figures
    share = {}
    for name in arms[1:]:
        f, mode = figs[name], bench.MODE[name]
        got = re.search(
            rf"^rep 0 {name} own bound: learner busy {NUM} of its steps 1..n; rollout busy {NUM} = "
            rf"generate of batches 2..n {NUM} s / ([a-z ]+ [n0-9.-]+) {NUM} s; share of ideal {NUM} "
            rf"\(<= 1 \+ margin {NUM}: (holds|EXCEEDED)\)$",
            text,
            re.M,
        )
        assert got, f"{name}: no bound line"
        learner, rollout, generate = map(float, got.group(1, 2, 3))
        window, share[name], margin = map(float, got.group(5, 6, 7))
        busy = f["step"] - f["wait_batch"] - f["weight_broadcast_wait"]
        assert learner == pytest.approx(busy / f["step"], abs=1e-3) and learner <= 1  # exact
        # 2 measured steps: the batch of step 2 over the step that contains its generation
        assert (
            got.group(4)
            == bench.WINDOW[mode]
            == {
                "sync": "learner steps 2..n",
                "one_step_off": "its own time 2..n",  # the rollout rank's: wait, then generate
                "async": "its own time 2..n",
            }[mode]
        )
        assert 0 < generate <= 2 * f["rollout_generate"] + 1e-3
        if mode != "sync":  # the last batch's generation and its wait (<= both steps')
            own = f["rollout_wait_send" if mode == "async" else "rollout_wait_weights"]
            assert generate <= window <= generate + 2 * own + 1e-3
        else:
            assert 0 < window <= 2 * f["step"] + 1e-3
        assert rollout == pytest.approx(generate / window, abs=1e-3)
        assert share[name] == max(learner, rollout) and margin == 0.0
        assert share[name] <= 1 + margin + 2e-3 and got.group(8) == "holds"
    assert _ratio(text, "split_sync share of its own ideal step (no overlap)") == pytest.approx(
        share["split_sync"], abs=6e-4
    )
    for name in arms:
        got = _ratio(text, f"{name} steps/s over colocated_sync")
        assert got == pytest.approx(figs[name]["steps_per_s"] / coloc["steps_per_s"], abs=2e-3)
    for name in arms[2:]:
        speedup = figs[name]["steps_per_s"] / base["steps_per_s"]
        assert _ratio(text, f"{name} speedup over split_sync") == pytest.approx(speedup, abs=2e-3)
        label = f"{name} share of its own ideal step (the busier role's busy fraction)"
        assert _ratio(text, label) == pytest.approx(share[name], abs=6e-4)
        f = figs[name]
        rollout_wait = f.get("rollout_wait_weights", 0.0) + f.get("rollout_wait_send", 0.0)
        wait = (f["wait_batch"] + f["weight_broadcast_wait"] if t_u >= t_r else rollout_wait) / f["step"]
        assert _ratio(text, f"{name} slower role waiting fraction") == pytest.approx(wait, abs=2e-3)
    assert re.search(
        r"^on these \d+ cores the best overlapping mode, split_\w+, runs at [0-9.]+x colocated", text, re.M
    )
    # why, from the figures: colocated's half-batch phases against the split's whole batch on one core
    got = re.search(rf"rollout {NUM} s vs {NUM} s .* update {NUM} s vs {NUM} s", text).groups()
    want = (coloc["rollout"], base["rollout_generate"], coloc["update"], base["update"])
    assert tuple(map(float, got)) == want
    assert re.search(r"^  16 GPUs: sync .* one_step_off .* async ", text, re.M)
    assert re.search(r"^  128 GPUs: sync .* one_step_off .* async ", text, re.M)


@pytest.mark.unit
def test_cluster_model_orders_the_modes_and_the_tail_costs_sync_only():
    bench = script_module("bench_async")
    # no tail (sigma -> 0): every length is the mean, so sync = t_r + t_u, the others max(t_r, t_u)
    flat = bench.cluster_model(0.5, 0.75, sigma=1e-9, cap=4.0, alpha=0.5, n=8, trials=4)
    for step in flat.values():
        assert step["sync"] == pytest.approx(1.25) and step["one_step_off"] == pytest.approx(0.75)
        assert step["async"] == pytest.approx(0.75)
    # a long tail: the slowest engine grows with the engine count, async keeps the mean's throughput
    tail = bench.cluster_model(1.0, 1.0, sigma=1.0, cap=8.0, alpha=1.0, n=32, trials=50)
    assert tail[128]["sync"] > tail[16]["sync"] > 2.0 + 1.0
    assert tail[16]["sync"] > tail[16]["one_step_off"] > tail[16]["async"]
    assert tail[16]["async"] == pytest.approx(1.0, abs=0.05)
