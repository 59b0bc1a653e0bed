"""Colocated sync vs rollout/learner split sync vs one-step-off (vs fully async, once the config
loader accepts `rollout.mode=async`): the same work, in one run, interleaved, each role pinned to
its own core; then a model of what each mode gives on a 16-GPU and a 128-GPU cluster.

    python scripts/bench_async.py [--reps 3] [--steps 6] [--shape long_tail|uniform] [--max-new-tokens N]
                                  [--out DIR] [--quick]
    python scripts/bench_async.py --reps 6 --out DIR --report-only   # the figures of a run cut short

Arms (each a real `moe-rl train` subprocess; docs/design.md 15): colocated sync (2 ranks, EP=2,
DP=2), and, with `parallel.nproc=2 parallel.rollout_ranks=1` (1 learner rank + 1 rollout rank),
split sync, split one_step_off and split async. Every arm runs the same work: the same steps,
prompts, samples and max_new_tokens, in one of two shapes (--shape): long_tail (the default), the
warm start's short answers with 1 sample in 8 that ignores eos and runs to max_new_tokens (224;
`rollout.long_tail_frac`), so a generation outlasts the learner's update and async differs from
one_step_off (docs/design.md 15.3); uniform, the tiny model from a random init (`init_weights=`:
responses run to about max_new_tokens, 48, so rollout and update times are comparable). Printed
too: the responses of async and one_step_off with tokens of two or more weight versions
(`rollout/mixed_version_seqs`), and async's steps/s over one_step_off's. `MOE_RL_PIN_ROLES=1` pins
each rank to its own core with one thread (moe_rl/launch.py: the learner rank on core 0, the
rollout rank on core 1). The repetitions are interleaved (A B C A B C ...), so drift and the
machine's other load hit every arm alike.

Per run, from its metrics.jsonl (step 0 is a warm-up and left out when there are more steps):
steps/s and generated tokens/s over the learner's `time/step_s`, and the mean of each phase and
wait: the learner's `time/wait_batch_s` and phases `time/*_s`, the rollout rank's
`time/rollout_generate_s` and `time/rollout_wait_weights_s` (its wait for the weights, their load
included).

**The bound: each split run against its own ideal step** (``own_bound``). A schedule that overlaps
the two roles perfectly steps no faster than the busier role, so the ideal step is the busier
role's busy time per step and the share of the ideal is the busier role's busy fraction, each role
timed in the same run over the learner steps that contain its work: learner busy = (step_s -
wait_batch_s - weight_broadcast_wait_s) / step_s over steps 1..n (everything the learner does but
wait for the rollout rank; <= 1 exactly, the waits are timed inside the step); rollout busy = the
rollout_generate_s of the batches of steps 2..n over the learner steps that contain their
generation: steps 2..n in sync (B_t is generated while the learner waits in step t), <= 1 up to
the milliseconds between two of the learner's timed steps. In one_step_off and async the rollout
rank's own time is the window: before each batch its wait (one_step_off: for the weights,
rollout_wait_weights_s, their load included; async: for buffer room, rollout_wait_send_s), then its
generation, one after the other, over the batches of steps 2..n: <= 1 exactly (margin 0). It was
the learner steps 1..n-1 (async: with a noise margin of max(0, wait_n - wait_1) / the window);
under a long tail, where the rollout rank is the slower role and its generation spans the
learner's untimed work between two steps (metrics, logs), that window came out short (async 1.982
against a bound of 1.977, one_step_off 1.0003 against 1). Step 1's batch is left out because it
may predate the window (one_step_off generates B_1 with W_0 while the learner starts up). share =
max(learner busy, rollout busy); 1 = the busier role never waits; split sync, which runs the roles
one after the other, is the no-overlap reference. The script prints per run whether share <= 1 + margin holds.

The old figure, an overlapping run's speedup over split sync divided by (t_rollout + t_update) /
max predicted from split sync's role times, was no bound: as split sync's step is t_update +
wait_batch ~ t_rollout + t_update, it came to about split sync's max(t_rollout, t_update) over the
overlapping run's step, above 1 whenever the overlapping run's busier role ran faster than the
same role in the split sync run (another run, under the machine's load of its moment): 1.09-1.50
re-measured. That prediction is still printed, as one.

Printed per overlapping mode, each ratio as the median over the paired repetitions with its
interval (scripts/bench_stats.py): its speedup over split sync, its share of its own ideal step
(goal >= 0.8), and the slower role's waiting fraction (goal < 10%; the learner's wait_batch_s +
weight_broadcast_wait_s, or the rollout rank's rollout_wait_weights_s, over step_s:
``slower_wait``; the slower role as split sync's medians t_rollout = rollout_generate_s and
t_update = step_s - wait_batch_s say). --quick: 1 repetition of 3 steps of 16 new tokens (the
test's: 2 measured steps, the least the bound needs).

The cluster model (``cluster_model``): numbers and the command in docs/measurements.md 9.
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
sys.path.insert(0, str(ROOT / "scripts"))  # bench_stats, also when a test imports this file

from bench_stats import MachineLoad, median_interval, paired_ratios, ratio_line  # noqa: E402

SPLIT = ["parallel.nproc=2", "parallel.rollout_ranks=1", "parallel.expert_parallel=1"]
# (name, overrides): an overlapping mode is one more entry; async joins when the loader accepts it
ARMS = [
    ("colocated_sync", ["parallel.nproc=2", "parallel.expert_parallel=2"]),
    ("split_sync", [*SPLIT, "rollout.mode=sync"]),
    ("split_one_step_off", [*SPLIT, "rollout.mode=one_step_off"]),
    ("split_async", [*SPLIT, "rollout.mode=async", "rollout.max_staleness=1"]),
]
BASE = "split_sync"  # the overlapping modes' reference
MODE = {name: next((o[13:] for o in ovr if o.startswith("rollout.mode=")), "sync") for name, ovr in ARMS}
PHASES = (
    "time/step_s",
    "time/rollout_s",
    "time/wait_batch_s",
    "time/rollout_generate_s",
    "time/rollout_wait_weights_s",
    "time/rollout_wait_send_s",
    "time/old_logprob_s",
    "time/update_s",
    "time/sync_s",
    "time/weight_broadcast_s",
    "time/weight_broadcast_wait_s",
)
GOAL_FRAC, GOAL_WAIT = 0.8, 0.10
# the overlapping modes' rollout busy over the rank's own time: before each batch it waits for this
# (one_step_off: the weights, their load included; async: buffer room), then generates
OWN_WAIT = {"one_step_off": "time/rollout_wait_weights_s", "async": "time/rollout_wait_send_s"}


# --shape: long_tail (the default; docs/design.md 15.3): the warm start's short answers and 1 sample
# in 8 that ignores eos and runs to max_new_tokens, so a generation outlasts the learner's update and
# async's in-flight updates land inside responses; uniform (the figures of docs/measurements.md 9
# before 2026-12-04): a random init, every response runs to about max_new_tokens
SHAPES = {
    "long_tail": (["model.max_seq_len=256", "rollout.long_tail_frac=0.125"], 224),
    "uniform": (["init_weights="], 48),
}


def work(args) -> list[str]:
    """The work every arm does."""
    return [
        *SHAPES[args.shape][0],
        f"steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "checkpoint_every=0",
        "log.progress_bar=false",
        "log.wandb_mode=disabled",
    ]


def accepted(overrides: list[str]) -> str | None:
    """None when the config loader takes these overrides, else its one-line reason."""
    sys.path.insert(0, str(ROOT))
    from moe_rl.config import load_config
    from moe_rl.errors import ConfigError, one_line

    try:
        load_config(None, overrides)
    except ConfigError as e:
        return one_line(e)
    return None


def run_metrics(run_dir: Path) -> dict[str, float]:
    """One run's figures: steps/s, tokens/s and the mean of each phase (step 0 left out when there
    are more)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = recs[1:] if len(recs) > 1 else recs
    total = sum(r["time/step_s"] for r in recs)
    out = {
        "steps_per_s": len(recs) / total,
        "tokens_per_s": sum(r["rollout/num_response_tokens"] for r in recs) / total,
    }
    # responses with tokens of two or more weight versions (an update landed inside them)
    out["mixed"] = sum(r.get("rollout/mixed_version_seqs", 0.0) for r in recs)
    out["seqs"] = sum(r["rollout/num_seqs"] for r in recs)
    if "time/rollout_generate_s" in recs[0]:  # a split run: own_bound's per-step series
        keys = ("time/step_s", "time/wait_batch_s", "time/rollout_generate_s", *OWN_WAIT.values())
        out["per_step"] = {k: [r[k] for r in recs] for k in keys if k in recs[0]}
    for k in PHASES:
        if all(k in r for r in recs):
            out[k] = statistics.fmean(r[k] for r in recs)
    return out


def overlap(split_sync: dict[str, float]) -> tuple[float, float, float]:
    """(t_rollout, t_update, predicted overlap speedup) of a split sync run: a prediction from its
    role times, not a bound (an overlapping run keeps other role times; ``own_bound`` is the bound)."""
    t_r = split_sync["time/rollout_generate_s"]
    t_u = split_sync["time/step_s"] - split_sync["time/wait_batch_s"]
    return t_r, t_u, (t_r + t_u) / max(t_r, t_u)


def own_bound(run: dict, mode: str) -> dict[str, float]:
    """A split run against its own ideal step (the module docstring): the learner's busy fraction
    (step - wait_batch - weight_broadcast_wait) / step over steps 1..n, the rollout rank's, the
    generate time of the batches of steps 2..n over the learner steps that contain them (``mode``:
    sync, one_step_off; async: over its own time), the share (the larger) and the margin (0)."""
    step = run["time/step_s"]
    learner = step - run["time/wait_batch_s"] - run.get("time/weight_broadcast_wait_s", 0.0)
    per = run["per_step"]
    steps, gens = per["time/step_s"], per["time/rollout_generate_s"]
    if len(steps) < 2:
        raise SystemExit("the bound needs 2 measured steps: --steps 3 or more")
    window = steps[1:] if mode == "sync" else steps[:-1]
    if mode in OWN_WAIT:  # the rollout rank's own time: a batch's wait (room, weights), then its generation
        window = [g + w for g, w in zip(gens[1:], per[OWN_WAIT[mode]][1:])]
    margin = 0.0
    rollout = sum(gens[1:]) / sum(window)
    return {
        "learner": learner / step,
        "rollout": rollout,
        "share": max(learner / step, rollout),
        "margin": margin,
        "generate": sum(gens[1:]),
        "window": sum(window),
    }


WINDOW = {"sync": "learner steps 2..n", "one_step_off": "its own time 2..n", "async": "its own time 2..n"}


def bound_line(name: str, m: dict, mode: str) -> str:
    b = own_bound(m, mode)
    holds = b["share"] <= 1 + b["margin"]
    return (
        f"{name} own bound: learner busy {b['learner']:.4f} of its steps 1..n; rollout busy "
        f"{b['rollout']:.4f} = generate of batches 2..n {b['generate']:.4f} s / "
        f"{WINDOW[mode]} {b['window']:.4f} s; share of ideal {b['share']:.4f} (<= 1 + margin "
        f"{b['margin']:.4f}: {'holds' if holds else 'EXCEEDED'})"
    )


def slower_wait(run: dict[str, float], learner_slower: bool) -> float:
    """The slower role's waiting time as a fraction of the step: the rollout rank's wait for the
    weights (their load included; async: for room in its buffer, it never waits for weights), or
    the learner's wait for its batch plus its broadcast's wait for the rollout rank to join
    (``time/weight_broadcast_wait_s``: in one_step_off the rank finishes the batch it is generating
    first; the transfer itself is work, not waiting)."""
    if learner_slower:
        wait = run["time/wait_batch_s"] + run["time/weight_broadcast_wait_s"]
    else:
        wait = run.get("time/rollout_wait_weights_s", 0.0) + run.get("time/rollout_wait_send_s", 0.0)
    return wait / run["time/step_s"]


def train(name: str, overrides: list[str], run_dir: Path) -> dict[str, float]:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, never a resume
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", f"run_dir={run_dir}", *overrides]
    env = {**os.environ, "MOE_RL_PIN_ROLES": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] moe-rl train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return run_metrics(run_dir)


def complete(run_dir: Path, steps: int) -> bool:
    """Whether ``run_dir`` holds a finished run of ``steps`` steps (--report-only)."""
    path = run_dir / "metrics.jsonl"
    return path.exists() and len(path.read_text().splitlines()) == steps


def figures(name: str, m: dict[str, float]) -> str:
    phases = " ".join(f"{k[5:-2]} {m[k]:.4f}" for k in PHASES if k in m)
    return f"{name}: steps/s {m['steps_per_s']:.4f} tokens/s {m['tokens_per_s']:.1f} | s: {phases}"


def report(runs: dict[str, list[dict[str, float]]]) -> tuple[float, float]:
    """The ratios, each from the per-repetition figures printed above them; (t_rollout, t_update)."""
    base = runs[BASE]
    ov = [overlap(m) for m in base]
    t_r, t_u = statistics.median(o[0] for o in ov), statistics.median(o[1] for o in ov)
    learner_slower = t_u >= t_r
    predicted = [o[2] for o in ov]
    print(
        f"split sync: t_rollout {t_r:.4f} s, t_update {t_u:.4f} s (medians): the "
        f"{'learner' if learner_slower else 'rollout rank'} is the slower role; overlap speedup "
        f"predicted from them, (t_rollout + t_update) / max: {median_interval(predicted)[0]:.3f} "
        f"(median), a prediction, not a bound"
    )
    share = [own_bound(m, MODE[BASE])["share"] for m in base]
    print(f"  {ratio_line('split_sync share of its own ideal step (no overlap)', share)}")
    colocated = [m["steps_per_s"] for m in runs["colocated_sync"]]
    for name, ms in runs.items():
        steps = [m["steps_per_s"] for m in ms]
        print(f"  {ratio_line(f'{name} steps/s over colocated_sync', paired_ratios(steps, colocated))}")
        if name in (BASE, "colocated_sync"):
            continue
        speedup = paired_ratios(steps, [m["steps_per_s"] for m in base])
        frac = [own_bound(m, MODE[name])["share"] for m in ms]
        wait = [slower_wait(m, learner_slower) for m in ms]
        print(f"  {ratio_line(f'{name} speedup over split_sync', speedup)}")
        f_med, w_med = median_interval(frac)[0], median_interval(wait)[0]
        label = f"{name} share of its own ideal step (the busier role's busy fraction)"
        print(
            f"  {ratio_line(label, frac)}; goal >= {GOAL_FRAC}: {'met' if f_med >= GOAL_FRAC else 'not met'}"
        )
        print(
            f"  {ratio_line(f'{name} slower role waiting fraction', wait)}; goal < {GOAL_WAIT:.0%}: "
            f"{'met' if w_med < GOAL_WAIT else 'not met'}"
        )
    if "split_async" in runs and "split_one_step_off" in runs:
        a, o = runs["split_async"], runs["split_one_step_off"]
        mixed = ", ".join(
            f"{n} {int(sum(m['mixed'] for m in runs[n]))}" for n in ("split_async", "split_one_step_off")
        )
        print(
            f"responses with tokens of 2+ weight versions, of {int(sum(m['seqs'] for m in a))} "
            f"per arm: {mixed}"
        )
        ratios = paired_ratios([m["steps_per_s"] for m in a], [m["steps_per_s"] for m in o])
        print(f"  {ratio_line('split_async steps/s over split_one_step_off', ratios)}")
    overlapping = [n for n in runs if n not in (BASE, "colocated_sync")]
    if overlapping:
        best = max(overlapping, key=lambda n: statistics.median(m["steps_per_s"] for m in runs[n]))
        ratio = median_interval(paired_ratios([m["steps_per_s"] for m in runs[best]], colocated))[0]
        co, sp = runs["colocated_sync"], runs[BASE]
        co_r, co_u = (statistics.median(m[k] for m in co) for k in ("time/rollout_s", "time/update_s"))
        split_keys = ("time/rollout_generate_s", "time/update_s")
        sp_r, sp_u = (statistics.median(m[k] for m in sp) for k in split_keys)
        print(
            f"on these {os.cpu_count()} cores the best overlapping mode, {best}, runs at {ratio:.2f}x "
            f"colocated sync's steps/s ({'faster' if ratio > 1 else 'slower'}). Why: colocated sync "
            f"(2 ranks, DP=2) gives every phase both cores, each rank half the batch, and halving the "
            f"batch hardly shortens a phase here: rollout {co_r:.4f} s vs {sp_r:.4f} s for the whole "
            f"batch on one core ({1 - co_r / sp_r:.0%} less), update {co_u:.4f} s vs {sp_u:.4f} s "
            f"({1 - co_u / sp_u:.0%} less) (medians): at this model size a phase costs per forward "
            f"pass, not per token. The split gives the second core a role of its own instead, so an "
            f"overlapping mode runs the two phases at once."
        )
    return t_r, t_u


def cluster_model(t_r: float, t_u: float, sigma: float, cap: float, alpha: float, n: int, trials: int = 200):
    """Modelled step time of each mode on 16 and 128 engines, from the measured role times.

    Response lengths ~ LogNormal(mu, sigma) with mean 1 (mu = -sigma^2/2), clipped at ``cap`` x
    the mean (max_new_tokens); each engine decodes ``n`` of them per step. An engine's rollout time
    is t_rollout x (alpha x its longest + (1 - alpha) x its mean length): alpha is the part of a
    decode step that costs the same however many sequences are still running (memory-bound
    decoding: the tail runs at the full batch's price), 1 - alpha the part that scales with them.
    The update costs t_update x the batch's mean length (tokens). sync: the slowest engine, then
    the update; one_step_off: max(the slowest engine, update) per step (the rollout of step t + 1
    overlaps the update of step t); async: max(t_rollout x the mean length, update): engines refill
    finished slots at once, so the tail is absorbed by the buffer and only throughput counts."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    for engines in (16, 128):
        z = torch.randn(trials, engines, n, generator=g, dtype=torch.float64)
        len_TEN = torch.exp(sigma * z - sigma**2 / 2).clamp(max=cap)
        engine_TE = t_r * (alpha * len_TEN.amax(-1) + (1 - alpha) * len_TEN.mean(-1))
        slowest_T, update_T = engine_TE.amax(-1), t_u * len_TEN.mean((-1, -2))
        step = {
            "sync": (slowest_T + update_T).mean().item(),
            "one_step_off": torch.maximum(slowest_T, update_T).mean().item(),
            "async": torch.maximum(t_r * len_TEN.mean((-1, -2)), update_T).mean().item(),
        }
        out[engines] = step
    return out


def print_model(t_r: float, t_u: float, args) -> None:
    print(
        f"cluster model (one engine per GPU, {args.model_n} responses per engine per step, lengths "
        f"LogNormal(sigma={args.model_sigma}) with mean 1, clipped at {args.model_cap} x the mean, "
        f"alpha={args.model_alpha}; t_rollout {t_r:.4f} s and t_update {t_u:.4f} s measured above):"
    )
    for engines, step in cluster_model(
        t_r, t_u, args.model_sigma, args.model_cap, args.model_alpha, args.model_n
    ).items():
        line = ", ".join(f"{mode} {s:.3f} s/step ({step['sync'] / s:.2f}x sync)" for mode, s in step.items())
        print(f"  {engines} GPUs: {line}")


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--shape", choices=sorted(SHAPES), default="long_tail", help="the response lengths")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 224 (long_tail), 48 (uniform)")
    p.add_argument("--out", default="runs/bench_async")
    p.add_argument(
        "--quick", action="store_true", help="1 repetition of 3 steps of 16 new tokens (the test's)"
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: report the complete repetitions already in --out (a run cut short)",
    )
    p.add_argument("--model-sigma", type=float, default=0.6)
    p.add_argument("--model-cap", type=float, default=4.0)
    p.add_argument("--model-alpha", type=float, default=0.5)
    p.add_argument("--model-n", type=int, default=32)
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.max_new_tokens = 1, 3, 16
    if args.max_new_tokens is None:
        args.max_new_tokens = SHAPES[args.shape][1]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    arms = []
    for name, overrides in ARMS:
        why = accepted([*overrides, *work(args)])
        if why is None:
            arms.append((name, overrides))
        else:
            print(f"{name}: not run, the config loader refuses it: {why}")
    out = Path(args.out).resolve()
    load = MachineLoad()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in arms}
    for rep in range(args.reps):
        done = [out / f"{name}_r{rep}" for name, _ in arms]
        if args.report_only and not all(complete(d, args.steps) for d in done):
            print(f"--report-only: {rep} complete repetitions in {out}")
            break
        for name, overrides in arms:
            run_dir = out / f"{name}_r{rep}"
            m = run_metrics(run_dir) if args.report_only else train(name, [*overrides, *work(args)], run_dir)
            runs[name].append(m)
            print(f"rep {rep} {figures(name, m)}", flush=True)
            if "per_step" in m:
                print(f"rep {rep} {bound_line(name, m, MODE[name])}", flush=True)
    if not runs[BASE]:
        raise SystemExit(f"no complete repetition in {out}")
    t_r, t_u = report(runs)
    print_model(t_r, t_u, args)
    if not args.report_only:
        print(load.line(2))


if __name__ == "__main__":
    main()
