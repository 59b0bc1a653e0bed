"""Rollout correction under a dialled-in engine mismatch, side by side on the tiny task.

    python scripts/bench_correction.py [--steps 100] [--router-noise 0.1] [--out runs/bench_corr]

Each arm is a real `moe-rl train` run with the same seed, warm start and budget; the rollout
engine runs bf16 with Gaussian noise on its router logits, so the rollout policy really differs
from the learner's. Arms: no correction, token TIS, Seq-MIS, TRM (max + avg against pi_theta), DVP.
Prints per arm: final reward (mean of the last 10% of steps), peak k3 KL (rollout vs learner),
grad-norm spikes (steps whose pre-clip gradient norm exceeds 3x the run's median), mean TRM
acceptance, and the cost of the correction math (its per-batch preparation plus the loss over a
batch of the run's shape, timed in this process against the plain PPO loss, interleaved: the
median of the paired per-rep differences and its 95% interval, scripts/bench_stats.py) as a
fraction of the median step time; then the machine load during the whole benchmark.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_stats import MachineLoad, median_interval

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "none": [],
    "token_tis": [str(ROOT / "configs/corrections/token_tis.yaml")],
    "seq_mis": [str(ROOT / "configs/corrections/seq_mis.yaml")],
    "trm": [str(ROOT / "configs/corrections/trm_both.yaml")],
    "dvp": [str(ROOT / "configs/corrections/dvp.yaml")],
}


def run_arm(name: str, args) -> list[dict]:
    run_dir = Path(args.out) / name
    if not args.reuse:
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [
            sys.executable,
            "-m",
            "moe_rl.cli",
            "train",
            *ARMS[name],
            f"run_dir={run_dir}",
            f"steps={args.steps}",
            "checkpoint_every=0",
            "log.progress_bar=false",
            "log.wandb_mode=disabled",
            f"rollout.router_noise={args.router_noise}",
        ]
        print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def correction_cost_s(preset: list[str], reps: int = 20, pairs: int = 10) -> list[float]:
    """Seconds per step the correction adds over the plain PPO loss, on one rank's batch shape: one
    difference per pair of timings (each the mean of ``reps`` steps), interleaved corr/plain,
    plain/corr, ... after a warm-up pair."""
    import torch

    from moe_rl.config import load_config
    from moe_rl.step import drift
    from moe_rl.step.plan import StepPlan
    from moe_rl.types import TokenStats, TrainBatch

    cfg = load_config(preset[0] if preset else None)
    g = torch.Generator().manual_seed(0)
    B, S = 128, 16  # one rank: 16 prompts x 8 samples, prompt + response tokens
    mask = torch.rand(B, S, generator=g) > 0.5
    rollout = -torch.rand(B, S, generator=g)
    old = rollout + 0.05 * torch.randn(B, S, generator=g)
    mb = TrainBatch(
        torch.zeros(B, S, dtype=torch.int64),
        torch.full((B,), S),
        loss_mask_BS=mask,
        old_logp_BS=old,
        rollout_logp_BS=rollout,
        advantages_BS=torch.randn(B, S, generator=g),
    )

    def one(c) -> float:
        plan = StepPlan.from_config(c)  # the loss is built once per run, not per step
        t0 = time.perf_counter()
        for _ in range(reps):
            corr, _ = drift.drift_tensors(plan.correction, old, rollout, mask, None)
            logp = old.clone().requires_grad_(True)
            st = TokenStats(logp, torch.zeros_like(logp), torch.zeros_like(logp))
            loss, _ = plan.loss(
                mb.replace(is_weights_BS=corr.is_weights_BS, keep_BS=corr.keep_BS), st, mask.sum()
            )
            loss.backward()
        return (time.perf_counter() - t0) / reps

    cfgs, diffs = {"corr": cfg, "plain": load_config(None)}, []
    for i in range(pairs + 1):
        t = {name: one(cfgs[name]) for name in (("corr", "plain") if i % 2 == 0 else ("plain", "corr"))}
        if i:  # the first pair warms up
            diffs.append(t["corr"] - t["plain"])
    return diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--router-noise", type=float, default=0.1)
    ap.add_argument("--out", default="runs/bench_corr")
    ap.add_argument("--reuse", action="store_true", help="summarise the runs already in --out, train nothing")
    ap.add_argument("--reps", type=int, default=10, help="interleaved pairs of the correction-cost timing")
    args = ap.parse_args()
    load = MachineLoad()
    print(f"{args.steps} steps, default batch, bf16 engine + router-logit noise std {args.router_noise}")
    print(
        f"corr cost: median of {args.reps} paired differences (correction - plain loss, each the mean of 20 "
        f"steps) / median step time, with its interval (scripts/bench_stats.py)"
    )
    print(
        f"{'arm':10}{'final':>8}{'peak k3':>10}{'spikes':>8}{'TRM acc':>9}{'step s':>8}{'corr cost':>11}"
        f"  interval"
    )
    for name in ARMS:
        recs = run_arm(name, args)
        k = max(1, len(recs) // 10)
        final = sum(r["reward/mean"] for r in recs[-k:]) / k
        norms = [r["train/grad_norm"] for r in recs]
        med = statistics.median(norms)
        spikes = sum(n > 3 * med for n in norms)
        acc = [r["corr/trm_accept_rate"] for r in recs if "corr/trm_accept_rate" in r]
        step_s = statistics.median(r["time/step_s"] for r in recs)
        med_s, lo_s, hi_s, cov = median_interval(correction_cost_s(ARMS[name], pairs=args.reps))
        cost, lo, hi = med_s / step_s, lo_s / step_s, hi_s / step_s
        acc_s = f"{sum(acc) / len(acc):.3f}" if acc else "-"
        print(
            f"{name:10}{final:8.3f}{max(r['corr/k3_kl'] for r in recs):10.2e}{spikes:8d}{acc_s:>9}"
            f"{step_s:8.2f}{cost:11.2%}  {lo:.2%}..{hi:.2%} (coverage {cov:.0%})"
        )
    print(load.line(2))


if __name__ == "__main__":
    main()
