"""What the e2e tests share: ``moe-rl`` as a real process, a run's metrics and its end lines, and
a random checkpoint of an HF family as transformers writes it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from moe_rl.weights.canonical import random_canonical_weights
from moe_rl.weights.hf import write_hf_checkpoint
from tests.hf_assets import make_tokenizer
from tests.models import HF_FAMILY_TINY

VOCAB = 512  # the trained tokenizer has 460 tokens: padded embeddings, as hub checkpoints have


TINY = [
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "log.progress_bar=false",
    "log.wandb_mode=offline",
]


# a response-length LR decay that triggers at almost any length change, so its state matters
EAGER_LENGTH_LR = [
    "optim.length_lr.enabled=true",
    "optim.length_lr.surge_ratio=1.001",
    "optim.length_lr.min_observations=0",
    "optim.length_lr.patience=1",
    "optim.length_lr.ema_alpha=1.0",
    "optim.length_lr.cooldown_steps=0",
    "optim.length_lr.rebase_after_trigger=false",
]


# the default run of 4 steps the ``default_run`` session fixture (tests/e2e/conftest.py) makes once:
# the resume below and the two-node run (tests/e2e/test_multinode.py, test_slurm.py) must reproduce it
DEFAULT_4_STEPS = [
    "steps=4",
    "checkpoint_every=2",
    "algo.advantage=otb",
    "correction.is_level=token",
    *EAGER_LENGTH_LR,
    *TINY,
]


def moe_rl(*args: str, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"moe-rl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


# what `moe-rl train` must no longer print (moe_rl/quiet.py, the checkpoint's common state, wandb)
SILENCED = (
    "common state dict differs",
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "is deprecated",  # torch's all_gather_into_tensor / reduce_scatter_tensor, megatron's "full scope"
    "deprecating ShardedTensor",  # a resume's checkpoint load
    "Tensor that is not a leaf Tensor",
    "Rerun State Machine",
    "RerunStateMachine",
    "wandb:",
)


def assert_run_end(proc: subprocess.CompletedProcess, run_dir: Path, resumed_from: int | None = None) -> None:
    """The run's end lines (stdout), each value read back from the run directory; and none of the
    silenced warnings anywhere in the output."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    ck_step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    first, last = recs[0], recs[-1]
    final = sum(r["reward/mean"] for r in recs[-10:]) / len(recs[-10:])
    resumed = "" if resumed_from is None else f" (resumed from step {resumed_from})"
    assert proc.stdout.splitlines() == [
        f"run finished: {last['step'] + 1} steps in {run_dir}{resumed}",
        f"last checkpoint: step {ck_step}, {ckpt}",
        f"reward/mean: start {first['reward/mean']:.4f} (the first logged step), "
        f"final {final:.4f} (the mean of the last 10 logged steps)",
        f"wandb (offline): {wandb_runs[-1]}; upload with: wandb sync {run_dir}/wandb/offline-run-*",
        "next:",
        f"  moe-rl report {run_dir}",
        f"  moe-rl train run_dir={run_dir} resume=true steps={2 * (last['step'] + 1)}",
        f"  moe-rl export-hf {run_dir} {run_dir}-hf",
    ]
    for needle in SILENCED:
        assert needle not in proc.stdout + proc.stderr, needle


def deterministic(rec: dict) -> dict:
    """A metrics record without its timings: what a resumed run must reproduce exactly."""
    return {k: v for k, v in rec.items() if not k.startswith(("time/", "perf/"))}


def stopped_copy(full: Path, part: Path, step: int) -> Path:
    """``part``: the run directory ``full`` as a run stopped right after its checkpoint of
    ``step`` leaves it (later checkpoints gone, ``latest`` at ``step``; the metrics lines after it
    stay, as a run stopped between checkpoints leaves them: the resume drops them itself). A
    resume of ``part`` must then reproduce ``full``'s later steps; this saves the launch of a
    shorter run that would only write the same checkpoint (each launch is ~15 s on 2 cores)."""
    shutil.copytree(full, part, ignore=shutil.ignore_patterns(".lock"))
    ckpts = part / "checkpoints"
    keep = f"step_{step:06d}"
    assert (ckpts / keep / "trainer_state.json").is_file(), f"{full} has no checkpoint of step {step}"
    for d in ckpts.glob("step_*"):
        if d.name > keep:
            shutil.rmtree(d)
    (ckpts / "latest").write_text(keep + "\n")
    return part


def signalled(run_dir: Path, *args: str, after: int, sig: int = signal.SIGINT, timeout: int = 300):
    """``moe-rl train run_dir=RUN_DIR ARGS`` sent ``sig`` (as Ctrl-C sends SIGINT: to its process
    group) once its metrics.jsonl holds ``after`` steps, then waited for: (exit code, stderr). The
    job stops after the step in progress (issue 42): the signal comes while step ``after`` runs."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_rl.cli", "train", f"run_dir={run_dir}", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        metrics_file, deadline = run_dir / "metrics.jsonl", time.time() + timeout
        while not metrics_file.is_file() or len(metrics_file.read_text().splitlines()) < after:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-4000:]
            time.sleep(0.05)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, err


def family_checkpoint(root: Path, family: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random checkpoint of ``family`` as transformers writes it: our config.json and weights
    loaded by AutoModelForCausalLM and saved again by it (bf16, its own tensor names)."""
    import transformers  # the callers importorskip it

    cfg = HF_FAMILY_TINY[family](vocab_size=VOCAB, max_seq_len=128)  # GLM-4.5's is tied
    ours = write_hf_checkpoint(root / "ours", random_canonical_weights(cfg, seed=3), cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ours), torch_dtype=torch.float32)
    out = root / family
    model.to(torch.bfloat16).save_pretrained(str(out))
    make_tokenizer(out)
    return out, {k: v.clone() for k, v in model.state_dict().items()}


# algo.dynamic_sampling in the split, async and agent runs (docs/sampling.md): every step trains its
# configured groups, with signal unless the cap says so
DYNAMIC = ["algo.dynamic_sampling.enabled=true", "algo.dynamic_sampling.max_rounds=3"]


def dynamic_rounds(m: dict[int, dict], groups: int, factor: int = 1, partial: bool = False) -> list[int]:
    """Each step of a run with ``DYNAMIC`` (rewards unshaped: the filter's accuracy is the reward)
    generated ``groups`` groups a round and trained ``groups``: with signal, or (the cap reached)
    topped up with groups without, which ``adv/zero_std_group_frac`` (the trained groups whose
    rewards are all equal) counts exactly. With ``algo.over_sampling.factor`` (on_abort=drop) a round
    starts ``factor`` x ``groups``: each is decided (``groups_generated``) or dropped, surplus or cut
    (``dropped_aborted``, 4 samples a group); ``partial``: nothing is dropped (what is not decided
    stays pending, the pending groups start a round). Returns each step's rounds: the data cursor's
    advance."""
    for step, r in m.items():
        rounds, kept = r["sampling/rounds"], r["sampling/groups_kept"]
        started = r["sampling/groups_generated"] + r.get("sampling/dropped_aborted", 0.0) / 4
        assert rounds >= 1, step
        if partial:
            assert r["sampling/dropped_aborted"] == r["sampling/dropped_surplus"] == 0, step
        else:
            assert started == rounds * groups * factor, step
        assert kept == groups or r["sampling/cap_reached"] == 1.0, step
        assert r["adv/zero_std_group_frac"] == (groups - kept) / groups, step
        assert r["sampling/groups_generated"] - r["sampling/groups_dropped_all_equal"] >= kept, step
        assert r["rollout/num_seqs"] == groups * 4, step  # TINY: 4 samples a prompt
    rounds = [int(m[t]["sampling/rounds"]) for t in sorted(m)]
    # about half the groups carry signal at TINY's shape: a step's one round almost never suffices
    assert sum(rounds) > len(rounds), rounds
    return rounds


def data_cursor(run_dir: Path, step: int) -> int:
    """The data cursor the checkpoint of ``step`` saved (trainer_state.json)."""
    state = run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json"
    return json.loads(state.read_text())["data_cursor"]
