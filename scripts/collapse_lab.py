"""Collapse lab: the same tiny GRPO run under a large training-inference mismatch, once per arm
(no correction, routing replay, IS, rejection, TRM, DVP, an on-policy control) and seed, then one
N-run report and a table of outcomes per arm.

    python scripts/collapse_lab.py [--steps 100] [--seeds 0,1,2] [--arms none,r3,onpolicy | all] [--out runs/lab]
                                   [--router-noise 1.5] [--lr 4e-4] [--minibatches 8] [--staleness 0]
                                   [--set key=value ...] [--ci]
    python scripts/collapse_lab.py --arms none,r3 --map-noise 0.3,1.0,1.5 --map-lr 2e-4,3e-4   # map.md

The defaults are the documented collapsing setting (README, "Collapse lab"): the default grid
(no correction, R3, the on-policy control; 3 seeds; 100 steps) fits in 45 minutes on 2 cores;
`--arms all` runs every arm (about 2 h there).

Each run is a real `moe-rl train` subprocess on the embedded default (same warm start; `seed=`
per seed). The mismatch settings apply to every arm except `onpolicy`, the control: the built-in
engine in the learner's own numerics (fp32), no router noise, no staleness (the same lr and
minibatches), i.e. the best case any correction can reach. Outcome definitions (collapse step,
gradient-norm spikes, ...) are those of `moe_rl/report/outcome.py`. Finished runs are reused when
the script is run again with the same --out (delete a run's directory to redo it).

--ci: one collapsing arm (none) and one rescued arm (r3), one seed, 3 steps of a small batch
with rollout.staleness=2 unless given; checks only that the machinery runs (runs, report, table),
nothing about learning.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from moe_rl.report import data, outcome
from moe_rl.report.render import write_report

PRESETS = ROOT / "configs" / "corrections"
CONTROL = "onpolicy"
ARMS = {
    "none": [],
    "r2": ["routing.replay=r2"],
    "r3": ["routing.replay=r3"],
    "token_tis": [str(PRESETS / "token_tis.yaml")],
    "seq_mis": [str(PRESETS / "seq_mis.yaml")],
    "trm_max": [str(PRESETS / "trm_max.yaml")],
    "trm_avg": [str(PRESETS / "trm_avg.yaml")],
    "r3_trm": [str(PRESETS / "trm_max.yaml"), "routing.replay=r3"],
    "dvp": [str(PRESETS / "dvp.yaml")],
    CONTROL: [],
}
DEFAULT_ARMS = ["none", "r3", CONTROL]  # the headline: collapse, rescue, best case
CI_ARMS = ["none", "r3"]
CI_BATCH = ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
            "algo.num_minibatches=2"]


def arm_overrides(arm: str, args) -> list[str]:
    """Preset files first (positional configs), then key=value overrides; the control drops the
    engine-side mismatch."""
    mismatch = [f"rollout.router_noise={args.router_noise}", f"rollout.dtype={args.dtype}",
                f"rollout.staleness={args.staleness}"]
    control = ["rollout.router_noise=0.0", "rollout.dtype=fp32", "rollout.staleness=0"] if arm == CONTROL else []
    # the control's resets come last: no --set brings a mismatch back into it
    return [*ARMS[arm], *mismatch, f"optim.lr={args.lr}", f"algo.num_minibatches={args.minibatches}", *args.set,
            *control]


def finished(run_dir: Path, steps: int) -> bool:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return False
    lines = path.read_text().splitlines()
    return bool(lines) and json.loads(lines[-1]).get("step") == steps - 1


def run_one(arm: str, seed: int, args) -> Path:
    run_dir = Path(args.out).resolve() / f"{arm}_s{seed}"  # the subprocess runs in ROOT
    if finished(run_dir, args.steps):
        print(f"[{run_dir.name}] reused", flush=True)
        return run_dir
    if run_dir.exists():
        raise SystemExit(f"{run_dir} holds an unfinished run: delete it (or pass another --out) and rerun")
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", *arm_overrides(arm, args), f"run_dir={run_dir}",
           f"steps={args.steps}", f"seed={seed}", "checkpoint_every=0", "log.progress_bar=false",
           "log.wandb_mode=disabled"]
    print(f"[{run_dir.name}] {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"[{run_dir.name}] moe-rl train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return run_dir


def _mean_spread(xs: list[float]) -> str:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3g}"
    return f"{statistics.mean(xs):.3g} ± {statistics.stdev(xs):.2g}"


def collapsed_count(outs: list[outcome.Outcome]) -> str:
    """"k/n" seeds collapsed, or "n/a" when a run is too short to tell."""
    return f"{sum(o.collapsed for o in outs)}/{len(outs)}" if all(o.judged for o in outs) else "n/a"


def arm_table(results: dict[str, list[outcome.Outcome]]) -> str:
    """Markdown: one row per arm, mean ± sample std over seeds (collapses counted)."""
    head = ("| arm | seeds | start reward | final reward | collapsed | collapse step | peak k3 KL "
            "| grad-norm spikes | router flips | TRM acceptance | skipped updates |")
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, outs in results.items():
        steps = [float(o.collapse_step) for o in outs if o.collapse_step is not None]
        collapsed = collapsed_count(outs)
        rows.append(" | ".join([
            f"| {arm}", str(len(outs)), _mean_spread([o.start_reward for o in outs]),
            _mean_spread([o.final_reward for o in outs]), collapsed, _mean_spread(steps) if steps else "-",
            _mean_spread([o.peak_k3 for o in outs]), _mean_spread([float(o.grad_spikes) for o in outs]),
            _mean_spread([o.mean_flip for o in outs]), _mean_spread([o.trm_accept for o in outs]),
            _mean_spread([o.skipped_updates for o in outs])]) + " |")
    return "\n".join(rows) + "\n"


def parse(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/lab", help="one directory for every run, the report and the table")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (config key seed=)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"comma-separated, from {','.join(ARMS)}; all: every one")
    ap.add_argument("--router-noise", type=float, default=1.5, help="rollout.router_noise (std of router-logit noise)")
    ap.add_argument("--dtype", default="bf16", help="rollout.dtype of the engine (bf16 | fp32)")
    ap.add_argument("--lr", type=float, default=4e-4, help="optim.lr")
    ap.add_argument("--minibatches", type=int, default=8, help="algo.num_minibatches (optimizer steps per RL step)")
    ap.add_argument("--staleness", type=int, default=None,
                    help="rollout.staleness (rollouts from k updates ago); default 0, 2 with --ci")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every arm (repeatable)")
    ap.add_argument("--map-noise", default="", help="comma-separated router noises: run the grid per (noise, lr)")
    ap.add_argument("--map-lr", default="", help="comma-separated learning rates for the map")
    ap.add_argument("--ci", action="store_true", help="none + r3, one seed, 3 steps of a small batch")
    args = ap.parse_args(argv)
    if args.ci:  # staleness on, so the CI run exercises every mismatch source
        args.arms, args.seeds, args.steps = ",".join(CI_ARMS), "0", 3
        args.set = [*CI_BATCH, *args.set]
    if args.staleness is None:
        args.staleness = 2 if args.ci else 0
    args.arm_list = list(ARMS) if args.arms == "all" else [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arm_list) - set(ARMS))
    if unknown:
        ap.error(f"--arms: unknown {unknown}; known: {','.join(ARMS)}")
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    if args.steps < 1 or not args.seed_list:
        ap.error("--steps must be >= 1 and --seeds must name at least one seed")
    return args


def run_grid(args) -> dict[str, list[outcome.Outcome]]:
    """Every arm x seed under ``args``' settings (into ``args.out``); their outcomes per arm."""
    dirs = {arm: [run_one(arm, s, args) for s in args.seed_list] for arm in args.arm_list}
    return {arm: [outcome.outcome(r.steps_T, r.series) for r in map(data.load_run, ds)] for arm, ds in dirs.items()}


def collapse_map(args) -> None:
    """--map-noise x --map-lr: the grid once per (router noise, lr) cell, one table of where the
    arms collapse."""
    noises = [float(x) for x in args.map_noise.split(",")] if args.map_noise else [args.router_noise]
    lrs = [float(x) for x in args.map_lr.split(",")] if args.map_lr else [args.lr]
    rows = ["| router noise, lr |" + "".join(f" {lr:g} |" for lr in lrs), "|---|" + "---|" * len(lrs)]
    for noise in noises:
        cells = []
        for lr in lrs:
            cell = argparse.Namespace(**{**vars(args), "router_noise": noise, "lr": lr,
                                         "out": str(Path(args.out) / f"map_n{noise:g}_lr{lr:g}")})
            res = run_grid(cell)
            cells.append("; ".join(f"{arm} {collapsed_count(outs)} collapsed, final "
                                   f"{_mean_spread([o.final_reward for o in outs])}" for arm, outs in res.items()))
        rows.append(f"| {noise:g} | " + " | ".join(cells) + " |")
    text = (f"# Collapse map: router noise x lr, {args.steps} steps, seeds {args.seeds}\n\n"
            f"Other settings: rollout.dtype={args.dtype} rollout.staleness={args.staleness} "
            f"algo.num_minibatches={args.minibatches} {' '.join(args.set)}\n\n" + "\n".join(rows) + "\n\n"
            f"{outcome.DEFINITIONS}\n")
    (Path(args.out) / "map.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.map_noise or args.map_lr:
        collapse_map(args)
        return
    results = run_grid(args)
    html = write_report([Path(args.out).resolve() / f"{arm}_s{s}" for arm in args.arm_list for s in args.seed_list],
                        out / "report")
    settings = " ".join(arm_overrides("none", args))
    text = (f"# Collapse lab: {len(args.arm_list)} arms x {len(args.seed_list)} seeds, {args.steps} steps\n\n"
            f"Mismatch settings (every arm but `{CONTROL}`): `{settings}`\n\n{arm_table(results)}\n"
            f"{outcome.DEFINITIONS} Spread: sample standard deviation over seeds.\n")
    (out / "table.md").write_text(text)
    print(text)
    print(f"report: {html}\ntable: {out / 'table.md'}")


if __name__ == "__main__":
    main()
