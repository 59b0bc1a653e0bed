"""e2e tier: tiny training runs through the real CLI (`python -m moe_rl.cli`, which starts 2
ranks with torch's elastic launcher), checkpoint + exact resume, and input errors that must stop
a run before any rank starts."""

from __future__ import annotations

import json
import math
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.e2e.helpers import (
    DEFAULT_4_STEPS,
    TINY,
    assert_run_end,
    deterministic,
    metrics,
    moe_rl,
    signalled,
    stopped_copy,
)


@pytest.mark.e2e
def test_resume_reproduces_uninterrupted_run(tmp_path, default_run):
    full, proc = default_run
    part = tmp_path / "part"
    assert_run_end(proc, full)
    # Ctrl-C while step 0 runs (issue 42): the job finishes the step, saves a checkpoint no
    # checkpoint_every asked for, prints the command that resumes it and exits 130
    code, err = signalled(part, *DEFAULT_4_STEPS, after=0)
    again = f"moe-rl train run_dir={part} {' '.join(DEFAULT_4_STEPS)} resume=true"
    assert (code, err.splitlines()[-1]) == (
        130,
        f"stopped (SIGINT) after the step in progress, checkpoint saved at step 1; resume with: {again}  "
        "(from the checkpoint of step 1)",
    )
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["latest", "step_000001"]
    # one command: the run's saved config.yaml is the base (OTB, the LR decay, the layout ...)
    assert_run_end(moe_rl("train", f"run_dir={part}", "steps=4", "resume=true"), part, resumed_from=1)

    a, b = metrics(full), metrics(part)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in range(4):
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step} differs after resume"
    r = a[3]
    assert r["train/grad_norm"] > 0 and 0 <= r["reward/mean"] <= 1
    assert r["router_grad/zero_frac"] == pytest.approx(6 / 8)  # E=8, K=2, no aux loss: (E-K)/E
    # values, not only keys: each bounded by its definition or recomputed from other metrics
    vocab = yaml.safe_load((full / "config.yaml").read_text())["model"]["vocab_size"]
    assert r["rollout/num_seqs"] == 32.0  # 8 prompts x 4 samples
    assert 1 <= r["rollout/response_len_mean"] <= 8  # rollout.max_new_tokens=8
    assert r["rollout/response_len_mean"] == pytest.approx(r["rollout/num_response_tokens"] / 32)
    assert r["time/step_s"] > 0 and r["corr/k3_kl"] >= 0  # k3 = e^x - 1 - x >= 0 per token
    assert 0 < r["train/entropy"] <= math.log(vocab) and math.isfinite(r["train/pg_loss"])
    assert math.isfinite(r["adv/mean"]) and r["router_grad/norm"] > 0  # the gradient reaches the router
    assert 0 < r["router_grad/load_entropy/layer0"] <= 1  # normalised by ln E
    flips = [r[f"routing/flip_router_frac/layer{i}"] for i in range(4)]  # replay off: still measured
    assert all(0 <= f <= 1 for f in flips) and r["routing/flip_router_frac"] == pytest.approx(sum(flips) / 4)
    # OTB ran with its energies; the variance proxies follow from the step's grad norm and power
    # (moe_rl/maths/variance.py); the LR decayed on a length surge
    assert r["adv/proxy_signal"] == pytest.approx(r["train/grad_norm"] ** 2)
    n, power = r["adv/proxy_num_seqs"], r["adv/proxy_total_power"]
    assert n == 32.0 and power > 0
    assert r["adv/proxy_noise"] == pytest.approx(max(0.0, (power - r["adv/proxy_signal"]) / (n - 1)))
    assert 0 < r["train/length_lr/multiplier"] <= 1
    assert r["train/lr"] == pytest.approx(5e-5 * r["train/length_lr/multiplier"])
    events = [json.loads(x) for x in (full / "events.jsonl").read_text().splitlines()]
    assert events and "surged" in events[0]["cause"]
    assert (full / "events.jsonl").read_text() == (part / "events.jsonl").read_text()
    last = events[-1]
    assert a[last["step"]]["train/length_lr/multiplier"] == last["multiplier_after"] < 1.0
    assert a[last["step"]]["train/lr"] == pytest.approx(5e-5 * last["multiplier_after"])
    # the run dir: resolved config, checkpoints (only complete ones), offline wandb run files
    assert "expert_parallel: 2" in (full / "config.yaml").read_text()
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == [
        "latest",
        "step_000002",
        "step_000004",
    ]
    assert list((full / "wandb").glob("offline-run-*/run-*.wandb"))
    # the monitor's update-induced flips (replay off): step 0's first minibatch ran with the old
    # pass's weights, later minibatches after 1..3 optimizer steps; all in [0, 1]
    for step in range(4):
        assert (
            0 <= a[step]["router_grad/update_flip_frac"] <= a[step]["router_grad/update_flip_token_frac"] <= 1
        )
        assert a[step]["router_grad/rollout_flip_frac/layer0"] == a[step]["routing/flip_router_frac/layer0"]
    # the stability report of the real runs, side by side, through the CLI
    out = moe_rl("report", str(full), str(part), "--out", str(tmp_path / "cmp")).stdout
    assert "report.html" in out
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert md.count("finished: 4 of 4 steps logged") == 4  # per run: the header and the summary table
    assert md.count("- layer 0 ") == md.count("- layer 3 ") == 2  # a verdict per MoE layer and run
    assert "(figures/heatmap_update_flip_frac.png)" in md
    assert "(figures/heatmap_no_grad_expert_frac.png)" in md
    assert "| resume | False | True |" in md  # the config keys that differ


@pytest.mark.e2e
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.expert_parallel=1"],  # TP 2, DP 1
        # TP 2 x EP 2 with whole experts per rank, DP 2, routes replayed from the engine
        ["parallel.nproc=4", "parallel.expert_tensor_parallel=1", "routing.replay=r3"],
    ],
)
def test_tensor_parallel_run_counts_each_sample_once(tmp_path, layout):
    run = tmp_path / "tp"
    moe_rl(
        "train",
        f"run_dir={run}",
        "steps=2",
        "checkpoint_every=0",
        "parallel.tensor_parallel=2",
        *layout,
        *TINY,
    )
    m = metrics(run)
    # TP peers share one batch: metrics reduce over data-parallel ranks only
    assert [m[s]["rollout/num_seqs"] for s in (0, 1)] == [32.0, 32.0]  # 8 prompts x 4 samples
    assert m[1]["train/grad_norm"] > 0 and m[1]["router_grad/zero_frac"] == pytest.approx(6 / 8)
    if "routing.replay=r3" in layout:  # the engine's routes, recorded per sample, replayed on 2 SP blocks
        assert (
            0 < m[1]["routing/flip_router_frac"] < 0.2 and 0 <= m[1]["routing/update_flip_router_frac"] < 0.2
        )


@pytest.mark.e2e
def test_jsonl_dataset_run(tmp_path):
    """A JSONL dataset, rolled out by the built-in engine in blockwise FP8 (rollout.quantization=fp8,
    its only training run: the weights are requantized at every sync and the sync reports their error)."""
    data = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": f"C{a}{b}:", "answer": f"{a}{b}", "task": "copy2"} for a in range(10) for b in range(3)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    fp8 = ("rollout.quantization=fp8", "rollout.sync_check=true")
    moe_rl("train", f"run_dir={run}", "steps=2", "checkpoint_every=0", f"task.dataset={data}", *fp8, *TINY)
    recs = metrics(run)
    assert sorted(recs) == [0, 1]
    for rec in recs.values():  # one task in the file: its per-task reward is the step's reward
        assert rec["reward/mean/copy2"] == rec["reward/mean"] and 0 <= rec["reward/mean"] <= 1
        assert rec["rollout/num_seqs"] == 32.0  # 8 prompts x 4 samples
        # e4m3's 3 mantissa bits on the default init (N(0, 0.02) weights): 2.6%; and the engine's
        # log-probs, under FP8, still score the samples the learner scores
        assert 0.024 < rec["rollout/fp8_weight_rel_err"] < 0.029
        assert 0 < rec["corr/k3_kl"] < 0.05 and rec["routing/flip_router_frac"] < 0.2
        # the checked sync passed every sync; its probe batch, scored by engine and learner, differs
        # by FP8 alone (the same weights): a k3 of the size of the rollout's own
        assert 0 < rec["sync/probe_k3"] < 0.05
        assert (
            0 < rec["time/sync_check_s"] < rec["time/step_s"]
            and 0 < rec["time/sync_probe_s"] < rec["time/step_s"]
        )
    assert "quantization: fp8" in (run / "config.yaml").read_text()


@pytest.mark.e2e
def test_zero_signal_run_checkpoints_and_resumes(tmp_path):
    """No sample can ever solve these prompts (the answer is longer than any response), so every
    minibatch has zero advantage and is skipped: the optimizer never steps before (or after) the
    checkpoints, which must still be written and resume exactly (issue 26, point 1)."""
    data = tmp_path / "never.jsonl"
    rows = [{"prompt": f"R{a}{b}:", "answer": "9" * 40, "task": "never"} for a in range(10) for b in range(2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    full, part = tmp_path / "full", tmp_path / "part"
    # dynamic sampling reaches its cap at every step: 2 rounds, all 16 groups dropped, trained anyway
    ds = ["algo.dynamic_sampling.enabled=true", "algo.dynamic_sampling.max_rounds=2"]
    args = [f"task.dataset={data}", "checkpoint_every=2", *ds, *TINY]
    moe_rl("train", f"run_dir={full}", "steps=3", *args)
    stopped_copy(full, part, step=2)  # as a run stopped after its step-2 checkpoint leaves it
    moe_rl("train", f"run_dir={part}", "steps=3", "resume=true", *args)
    state = json.loads((part / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["data_cursor"] == 4  # 2 steps x 2 rounds: the resume draws from index 4 on
    a, b = metrics(full), metrics(part)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in range(3):
        assert a[step]["reward/mean"] == 0.0 and a[step]["train/grad_norm"] == 0.0
        assert a[step]["train/skipped_minibatches"] == 4  # algo.num_minibatches, every one skipped
        assert a[step]["sampling/rounds"] == 2 and a[step]["sampling/cap_reached"] == 1
        assert a[step]["sampling/groups_dropped_all_equal"] == 16 and a[step]["sampling/groups_kept"] == 0
        assert a[step]["sampling/useful_frac"] == 0 and a[step]["rollout/num_seqs"] == 32
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step} differs after resume"
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == [
        "latest",
        "step_000002",
        "step_000003",
    ]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args, needle",
    [
        (["parallel.expert_parallel=3"], "parallel.expert_parallel"),
        (["model.moe_router_topk=9"], "model.moe_router_topk"),
        (["rollout.temprature=0.5"], "rollout.temprature"),
        (["model.hidden_size=big"], "model.hidden_size"),
        (["rollout.prompts_per_step=7"], "rollout.prompts_per_step"),
        (["init_weights=/nonexistent.safetensors"], "init_weights"),
        (["model.hidden_size=64"], "model.hidden_size=128"),  # warm start made for another architecture
    ],
)
def test_bad_config_fails_before_launch(tmp_path, args, needle):
    proc = moe_rl("train", f"run_dir={tmp_path / 'r'}", *args, check=False, timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "r").exists()  # nothing started


@pytest.mark.e2e
def test_bad_dataset_line_names_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "C12:", "answer": "12"}\n\n{"prompt": "C1Z:", "answer": "1"}\n')
    proc = moe_rl("train", f"run_dir={tmp_path / 'r'}", f"task.dataset={data}", check=False, timeout=120)
    assert proc.returncode != 0
    assert f"{data}: row 2: key 'prompt': character 'Z'" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.e2e
def test_existing_run_dir_needs_resume(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    proc = moe_rl("train", f"run_dir={run}", check=False, timeout=120)
    # no checkpoint to resume: the refusal says what to delete (issue 26, point 4)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: config key 'run_dir': {run} holds a run that saved no checkpoint, so it cannot be "
        f"resumed; delete {run / 'metrics.jsonl'} to start over, or pass another run_dir="
    )
    step = run / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 2}')
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    proc = moe_rl("train", f"run_dir={run}", check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: config key 'run_dir': {run} already holds a run; pass resume=true to continue it, "
        f"or another run_dir="
    )
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]  # nothing written


@pytest.mark.e2e
def test_env_lists_versions_and_patches():
    out = moe_rl("env", timeout=120).stdout
    assert re.search(r"megatron-core +0\.1[6-9]", out)
    assert "vllm" in out and "transformer-engine" in out
    assert "cuda_stream" in out and "distopt_step_alias" in out


@pytest.mark.e2e
def test_external_torchrun_with_kl_to_reference(tmp_path):
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "moe_rl.cli",
        "train",
        f"run_dir={run}",
        "steps=3",
        "checkpoint_every=0",
        "algo.kl_coef=0.05",
        "algo.num_minibatches=1",
        *TINY,
    ]
    # SIGTERM to torchrun's agent while step 1 runs, as Slurm's --signal sends it (issue 42): the
    # agent passes it on, and the ranks finish the step and save its checkpoint before they end
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1  # torchrun's own SignalException
    stopped = [x for x in err.splitlines() if x.startswith("stopped")]  # rank 0's line alone
    assert stopped == [
        f"stopped (SIGTERM) after the step in progress, checkpoint saved at step 2; resume with: "
        f"{shlex.join(['moe-rl', 'train', *cmd[cmd.index('train') + 1 :], 'resume=true'])}  "
        "(from the checkpoint of step 2)"
    ], err[-4000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    recs = metrics(run)
    assert sorted(recs) == [0, 1]
    # step 0 updates from the reference weights themselves: KL(pi || ref) is exactly 0 there,
    # and positive once the policy has moved
    assert recs[0]["train/kl_ref"] == 0.0
    assert recs[1]["train/kl_ref"] > 0.0


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_routing_replay_modes_through_the_cli(tmp_path, mode):
    run = tmp_path / mode
    moe_rl(
        "train",
        f"run_dir={run}",
        "steps=2",
        "checkpoint_every=0",
        f"routing.replay={mode}",
        "rollout.router_noise=1.0",
        "algo.kl_coef=0.01",
        *TINY,
    )
    rec = metrics(run)[1]
    # the rollout's routes differ from the learner's native ones (noisy engine router) ...
    assert 0.0 < rec["routing/flip_router_frac"] < 1.0
    assert rec["routing/flip_token_frac"] >= rec["routing/flip_router_frac"]
    assert rec["routing/missing_frac"] == 0.0
    assert 0.0 < rec["routing/overlap_at_k"] < 1.0
    # the step's rate is the mean of the 4 MoE layers' (each counts the same rows), and the
    # flipped layers per token are their sum
    flips = [rec[f"routing/flip_router_frac/layer{i}"] for i in range(4)]
    assert all(0.0 < f < 1.0 for f in flips)
    assert rec["routing/flip_router_frac"] == pytest.approx(sum(flips) / 4)
    assert rec["routing/flip_layers_per_token"] == pytest.approx(sum(flips))
    # ... and the update passes replayed routes (R3: the rollout's; R2: the old policy's)
    assert 0.0 <= rec["routing/update_flip_router_frac"] <= 1.0
    if mode == "r2":
        # step 0's first minibatch runs with the old policy's weights: its native routes are the record
        assert metrics(run)[0]["routing/update_flip_router_frac"] < rec["routing/flip_router_frac"]
    # the mismatch split at step 0 (log.mismatch_split_every=10): the old pass is one side (r2: native
    # routes; r3: the engine's replayed), one extra forward the other; the parts add up
    s0 = metrics(run)[0]
    side = "replayed" if mode == "r3" else "native"
    assert s0[f"mismatch/k3_{side}"] == pytest.approx(s0["corr/k3_kl"], rel=1e-12)
    native, replayed = s0["mismatch/k3_native"], s0["mismatch/k3_replayed"]
    assert s0["mismatch/k3_flip_part"] == pytest.approx(native - replayed, rel=1e-9)
    assert s0["mismatch/k3_flip_share"] == pytest.approx((native - replayed) / native, rel=1e-9)
    assert s0["mismatch/k3_flip_share"] > 0.5  # router noise: a routing mismatch, mostly removed by replay
    assert "mismatch/k3_native" not in rec  # step 1: not due
    # flips by the learner's Top-K margin: the buckets partition the (token, layer) pairs, and their
    # flips add up to the flip rate
    buckets = ("lt1e-3", "1e-3_1e-2", "1e-2_1e-1", "ge1e-1")
    share = [s0[f"routing/margin_frac_{b}"] for b in buckets]
    assert sum(share) == pytest.approx(1.0, rel=1e-9)
    flips = [s0[f"routing/flip_frac_margin_{b}"] or 0.0 for b in buckets]  # null: an empty bucket
    assert sum(f * p for f, p in zip(flips, share)) == pytest.approx(s0["routing/flip_router_frac"], rel=1e-9)


@pytest.mark.e2e
def test_pipeline_parallel_run_has_every_stage_metric(tmp_path):
    import math

    # R2 replay, a reference model (KL) and a noisy engine router: every per-stage path is used
    args = [
        "steps=2",
        "checkpoint_every=0",
        "routing.replay=r2",
        "rollout.router_noise=1.0",
        "algo.kl_coef=0.01",
        "parallel.expert_parallel=1",
        *TINY,
    ]
    moe_rl("train", f"run_dir={tmp_path / 'pp'}", "parallel.pipeline_parallel=2", *args)
    moe_rl("train", f"run_dir={tmp_path / 'one'}", "parallel.nproc=1", *args)  # the same data (DP=1)
    m, ref = metrics(tmp_path / "pp"), metrics(tmp_path / "one")
    # both stages share one batch (DP=1); rank 0 (stage 0) writes the last stage's loss metrics
    # and the router metrics of stage 1's layers
    assert [m[s]["rollout/num_seqs"] for s in (0, 1)] == [32.0, 32.0]  # 8 prompts x 4 samples
    assert all(math.isfinite(m[s]["train/grad_norm"]) and m[s]["train/grad_norm"] > 0 for s in (0, 1))
    assert m[1]["router_grad/zero_frac"] == pytest.approx(6 / 8)
    for layer in range(4):  # stage 0 owns layers 0-1, stage 1 layers 2-3
        assert m[1][f"router_grad/zero_frac/layer{layer}"] == pytest.approx(6 / 8)  # (E-K)/E, each layer
        assert 0.0 < m[1][f"routing/flip_router_frac/layer{layer}"] < 1.0  # router noise 1.0
    flips = sum(m[1][f"routing/flip_router_frac/layer{layer}"] for layer in range(4))
    assert m[1]["routing/flip_router_frac"] == pytest.approx(flips / 4)  # both stages' layers joined
    for s in (0, 1):  # and they are the single-process run's metrics (summation order aside)
        got, want = deterministic(m[s]), deterministic(ref[s])
        assert sorted(got) == sorted(want)
        assert got == pytest.approx(want, rel=1e-3, abs=1e-6, nan_ok=True)


@pytest.mark.e2e
def test_stale_rollouts_log_the_version_lag_histogram(tmp_path):
    run = tmp_path / "stale1"
    moe_rl("train", f"run_dir={run}", "steps=3", "checkpoint_every=0", "rollout.staleness=1", *TINY)
    recs = metrics(run)
    # step 0 samples with W_0, the learner's own weights: lag 0; from step 1 on W_{t-1}: lag 1
    assert recs[0]["rollout/lag_frac/0"] == 1.0 and "rollout/lag_frac/1" not in recs[0]
    assert recs[0]["mismatch/k3_lag0"] == pytest.approx(recs[0]["corr/k3_kl"], rel=1e-9, abs=1e-15)
    assert recs[0]["routing/flip_frac_lag0"] == pytest.approx(recs[0]["routing/flip_router_frac"], rel=1e-9)
    for t in (1, 2):
        r = recs[t]
        assert (r["rollout/lag_frac/0"], r["rollout/lag_frac/1"]) == (0.0, 1.0), t
        assert (r["rollout/lag_mean"], r["rollout/lag_max"], r["rollout/policy_lag"]) == (1.0, 1.0, 1.0)
        assert r["mismatch/k3_lag0"] is None  # no token of lag 0: NaN, written as null
        assert r["mismatch/k3_lag1"] == pytest.approx(r["corr/k3_kl"], rel=1e-9) and r["corr/k3_kl"] > 0
        assert r["routing/flip_frac_lag0"] is None
        assert r["routing/flip_frac_lag1"] == pytest.approx(r["routing/flip_router_frac"], rel=1e-9)
