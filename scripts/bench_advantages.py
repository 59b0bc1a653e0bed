"""Advantage estimators side by side on the tiny task: GRPO n=4, GRPO n=16, OTB n=4.

    python scripts/bench_advantages.py [--steps 120] [--prompts 16] [--target 0.7] [--reuse]
        [--out runs/bench_adv]

Each arm is a real `moe-rl train` run (same seed, same prompts per step, same warm start); only
the estimator and the samples per prompt differ. Prints per arm: final reward (mean of the last
10% of steps), area under the reward curve (mean over steps), response tokens consumed in total
and until the 10-step moving average of reward first reaches --target, and the variance proxies
(docs/math.md 6.4) averaged over steps, and the machine load during the runs (scripts/bench_stats.py;
one run per arm, no repeated timing, so no interval).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from bench_stats import MachineLoad

ARMS = {
    "grpo_n4": ["algo.advantage=grpo", "rollout.samples_per_prompt=4"],
    "grpo_n16": ["algo.advantage=grpo", "rollout.samples_per_prompt=16"],
    "otb_n4": ["algo.advantage=otb", "rollout.samples_per_prompt=4"],
}


def run_arm(name: str, overrides: list[str], args) -> list[dict]:
    run_dir = Path(args.out) / name
    if args.reuse:
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        f"run_dir={run_dir}",
        f"steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        "checkpoint_every=0",
        "log.progress_bar=false",
        "log.wandb_mode=disabled",
        *overrides,
    ]
    print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(recs: list[dict], target: float) -> dict:
    rewards = [r["reward/mean"] for r in recs]
    tokens = [r["rollout/num_response_tokens"] for r in recs]
    k = max(1, len(recs) // 10)
    reached = None
    cum = 0.0
    for i, t in enumerate(tokens):
        cum += t
        window = rewards[max(0, i - 9) : i + 1]
        if reached is None and len(window) == 10 and sum(window) / 10 >= target:
            reached = cum

    def mean(key):
        vals = [r[key] for r in recs if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    return {
        "final": sum(rewards[-k:]) / k,
        "auc": sum(rewards) / len(rewards),
        "tokens": sum(tokens),
        "tokens_to_target": reached,
        "signal": mean("adv/proxy_signal"),
        "power": mean("adv/proxy_total_power"),
        "noise": mean("adv/proxy_noise"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--target", type=float, default=0.7)
    ap.add_argument("--reuse", action="store_true", help="summarise the runs already in --out, train nothing")
    ap.add_argument("--out", default="runs/bench_adv")
    args = ap.parse_args()
    load = MachineLoad()
    rows = {name: summarize(run_arm(name, o, args), args.target) for name, o in ARMS.items()}
    print(
        f"\n{args.steps} steps x {args.prompts} prompts per step; "
        f"target = 10-step mean reward >= {args.target}"
    )
    head = (
        f"{'arm':10}{'final':>8}{'AUC':>8}{'tokens':>10}{'tok->target':>13}"
        f"{'signal':>10}{'power':>10}{'noise':>10}"
    )
    print(head)
    for name, s in rows.items():
        reach = f"{s['tokens_to_target']:.0f}" if s["tokens_to_target"] is not None else "not reached"
        print(
            f"{name:10}{s['final']:8.3f}{s['auc']:8.3f}{s['tokens']:10.0f}{reach:>13}"
            f"{s['signal']:10.3g}{s['power']:10.3g}{s['noise']:10.3g}"
        )
    print(load.line(2))


if __name__ == "__main__":
    main()
