"""`moe-rl` command line: parse, load the config, call one function.

The error contract (issue 14): a ``moe_rl.errors.UserError`` raised anywhere below (config, files,
command line, a rank of the job) becomes one line ``error: <message>`` on stderr and exit code 2,
without a traceback; ``--debug`` (or ``MOE_RL_DEBUG=1``) shows the traceback. Any other exception
is a bug and keeps its traceback.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import sys
from importlib import metadata
from pathlib import Path
from typing import NoReturn

import click

from moe_rl.config import RunConfig, load_run_config
from moe_rl.errors import ConfigError, UserError, disk_full_named, one_line

_OPTIONAL = (
    "transformer-engine",
    "transformer-engine-torch",
    "vllm",
    "sglang",
    "apex",
    "transformers",
    "wandb",
)


def _split_args(args: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]`: the first argument is a config file unless it has an '='."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def _load(args: tuple[str, ...]) -> RunConfig:
    """The config of ``args``; with ``resume=true`` and no file, the run's saved config is the base."""
    path, overrides = _split_args(args)
    return load_run_config(path, overrides)


def _positive(flag: str, value: float) -> None:
    """A size flag: a finite number > 0 (click's FloatRange lets nan through)."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} must be a finite number > 0, got {value:g}")


def debug_enabled() -> bool:
    return os.environ.get("MOE_RL_DEBUG", "") not in ("", "0")


def _usage_error(e: click.UsageError) -> NoReturn:
    """click's own usage errors (a missing argument, a bad choice or type, an unknown option or
    command) as one ``error:`` line naming the command and the parameter, exit code 2, instead of
    click's usage text; a command given alone still shows its help."""
    if isinstance(e, click.exceptions.NoArgsIsHelpError):
        raise e
    where = e.ctx.command_path if e.ctx is not None else "moe-rl"
    message = one_line(e.format_message()).removesuffix(".")
    if message[:2].istitle():  # "Invalid value ..." reads as the rest of the line; "RUN_DIR" stays
        message = message[0].lower() + message[1:]
    click.echo(f"error: {where}: {message} (see '{where} --help')", err=True)
    raise click.exceptions.Exit(2)


class _Group(click.Group):
    """Maps the project's user errors, and click's usage errors, to one line and exit code 2, and
    nothing else."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:  # the group's own options
            _usage_error(e)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a command's arguments and options, an unknown command
            _usage_error(e)
        except UserError as e:
            if debug_enabled():
                raise
            click.echo(f"error: {one_line(e)}", err=True)
            ctx.exit(e.exit_code)


@click.group(cls=_Group, name="moe-rl")
@click.option("--debug", is_flag=True, help="show the traceback of a user error (or MOE_RL_DEBUG=1)")
def main(debug: bool) -> None:
    """RL training for Mixture-of-Experts LLMs on megatron-core."""
    if debug:
        os.environ["MOE_RL_DEBUG"] = "1"  # the ranks of `train` inherit it
    from moe_rl.quiet import silence_known_noise

    silence_known_noise()  # megatron's and torch's messages that are no user's business (not under --debug)


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train(args: tuple[str, ...]) -> None:
    """Train: moe-rl train [CONFIG.yaml] [key=value ...]  (no config: the embedded tiny CPU default).
    Resume: moe-rl train run_dir=RUN resume=true [steps=N]  (RUN/config.yaml is the base)."""
    from moe_rl import rank_server
    from moe_rl.launch import under_torchrun
    from moe_rl.rank_errors import RankDiedError
    from moe_rl.stop import JobInterrupted, handle_signals

    cfg = _load(args)
    if not under_torchrun():
        rank_server.start()  # it imports what a rank imports while this process runs preflight
    # under an external torchrun its agent passes its SIGTERM on, and SIGKILLs after its
    # --shutdown_timeout: the first only asks for a checkpoint (a flag, read at the step's end)
    previous = {} if under_torchrun() else _stop_signals_raise()
    if under_torchrun() and cfg.stop_grace_s > 0:
        handle_signals()
    lead = not under_torchrun() or os.environ.get("RANK") == "0"
    try:
        resumed_from = _checkpoint_step(Path(cfg.run_dir)) if cfg.resume else None
        _train(cfg)
        if lead:
            _end(cfg, resumed_from)
    except (JobInterrupted, KeyboardInterrupt) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        if lead:
            click.echo(f"{_stopped(signum, e)}{_resume_hint(cfg, args)}", err=True)
        sys.exit(128 + signum)  # the shell's code for the signal: 130 (SIGINT), 143 (SIGTERM)
    except RankDiedError as e:
        hint = _after_sigkill_hint(cfg, args) if e.sigkilled else _resume_hint(cfg, args)
        click.echo(f"error: {e}{hint}", err=True)
        sys.exit(1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _train(cfg: RunConfig) -> None:
    """Preflight, then the job under the run directory's lock (taken by the leader, or by rank 0
    under an external torchrun, before anything is written there)."""
    from moe_rl import run_lock
    from moe_rl.launch import launch, under_torchrun
    from moe_rl.preflight import check_run_dir, check_tokenizer_files
    from moe_rl.trainer import MEMORY_TIMELINE, prepare

    lead = not under_torchrun() or os.environ.get("RANK") == "0"
    if lead:
        run_lock.check_free(cfg.run_dir)  # a live job's lock first: its files say "already holds a run"
    check_tokenizer_files(cfg)
    # data, weights (headers) and run dir are checked here, before any rank starts
    prepared = prepare(cfg, check_run_dir=lead)  # e.g. model.vocab_size from the tokenizer
    if not lead:
        launch(cfg, prepared)
        return
    with run_lock.hold(cfg.run_dir, fresh=not cfg.resume):
        check_run_dir(prepared.cfg)  # again, now that no other start can race this one
        launch(cfg, prepared)
    if not under_torchrun():  # the launcher's own preflight, next to its ranks' phases
        prepared.memory.attach(Path(cfg.run_dir) / MEMORY_TIMELINE)


def _checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's last checkpoint (None if it has none, or an unreadable pointer,
    which preflight names)."""
    from moe_rl.learner import checkpoint

    try:
        latest = checkpoint.latest(run_dir / "checkpoints")
    except UserError:
        return None
    return None if latest is None else int(latest.name.removeprefix("step_"))


def _end(cfg: RunConfig, resumed_from: int | None) -> None:
    """The lines a finished run ends with (``moe_rl.run_end``), on stdout."""
    from moe_rl.run_end import end_lines, gather

    click.echo("\n".join(end_lines(gather(cfg.run_dir, cfg.log.wandb_mode, resumed_from))))


def _stop_signals_raise() -> dict:
    """SIGTERM (and SIGHUP) raise like Ctrl-C does, so that every stop unwinds: the lock is
    released, a failed start is undone, and the one-line message is printed. torch's elastic agent
    puts its own handler in place while the ranks run (``moe_rl.launch.spawn_local``)."""
    from moe_rl.stop import JobInterrupted

    def stop(signum, frame):
        raise JobInterrupted(signum)

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


def _stopped(signum: int, e: BaseException) -> str:
    """How a signal ended the job: after a checkpoint, or without one (issue 42)."""
    name = signal.Signals(signum).name
    if getattr(e, "checkpoint", None) is not None:
        return f"stopped ({name}) after the step in progress, checkpoint saved"
    if getattr(e, "grace_s", None) is not None:
        return f"interrupted ({name}; no checkpoint: the step outlasted stop_grace_s={e.grace_s:g} s)"
    return f"interrupted ({name})"


def _resume_command(args: tuple[str, ...]) -> str:
    """The command line that resumes the run ``args`` started."""
    return shlex.join(["moe-rl", "train", *[a for a in args if not a.startswith("resume=")], "resume=true"])


def _resume_hint(cfg: RunConfig, args: tuple[str, ...]) -> str:
    """Where the run stopped and the command that continues it (or what to do instead)."""
    run_dir = Path(cfg.run_dir)
    done = _steps_logged(run_dir / "metrics.jsonl")
    ck = _checkpoint_step(run_dir)
    if ck is not None:
        again = _resume_command(args)
        return f" at step {done}; resume with: {again}  (from the checkpoint of step {ck})"
    if done == 0 and not run_dir.exists():
        return " before the first step; nothing was kept: run the same command again"
    if done == 0:
        return f" before the first step of this start; {run_dir} is as it was: run the same command again"
    return (
        f" at step {done}; no checkpoint was saved, so it cannot be resumed: delete {run_dir} or "
        f"pass another run_dir= to start over"
    )


# what a rank killed for host memory can change before the next start (docs/reliability.md 5)
_LESS_HOST_MEMORY = (
    "give each rank less host memory (fewer ranks per node, optim.cpu_adam=false, "
    "parallel.offload_during_rollout=false, a smaller model; `moe-rl estimate CONFIG` prints the host "
    "memory per rank) or free host memory on this node"
)


def _after_sigkill_hint(cfg: RunConfig, args: tuple[str, ...]) -> str:
    """``_resume_hint`` after a rank's SIGKILL, most likely the OOM killer's: the same command
    would likely be killed again, so it says what to change first instead."""
    run_dir = Path(cfg.run_dir)
    done = _steps_logged(run_dir / "metrics.jsonl")
    ck = _checkpoint_step(run_dir)
    if ck is not None:
        again = _resume_command(args)
        return (
            f" at step {done}; a resume holds as much host memory: free some on this node first, then "
            f"resume with: {again}  (from the checkpoint of step {ck})"
        )
    if done == 0:
        return f" before the first step; the same command would likely be killed again: {_LESS_HOST_MEMORY}"
    return (
        f" at step {done}; no checkpoint was saved: {_LESS_HOST_MEMORY}, then delete {run_dir} or pass "
        f"another run_dir= to start over"
    )


def _steps_logged(metrics: Path) -> int:
    """1 + the last step in metrics.jsonl (0 when none): the steps the run has done."""
    import json

    try:
        lines = [x for x in metrics.read_text(encoding="utf-8").splitlines() if x.strip()]
        return int(json.loads(lines[-1])["step"]) + 1 if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


@main.command("config")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def show_config(args: tuple[str, ...]) -> None:
    """Print the resolved config: moe-rl config [CONFIG.yaml] [key=value ...]."""
    from moe_rl.config import to_yaml

    click.echo(to_yaml(_load(args)), nl=False)


@main.command("estimate", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--gpu-gib", type=float, default=80.0, show_default=True, help="memory of one GPU")
@click.option(
    "--gpus-per-node", type=int, default=8, show_default=True, help="for --rank: TP stays within a node"
)
@click.option("--rank", "top", type=int, default=0, help="also rank the N best layouts for the config's GPUs")
@click.option(
    "--cpu-adam-gelems-per-s",
    "cpu_adam_gelems",
    type=float,
    default=None,
    help="CPU Adam's throughput a rank, G elements/s (default: the measured one-core figure x 12 cores)",
)
def show_estimate(
    args: tuple[str, ...], gpu_gib: float, gpus_per_node: int, top: int, cpu_adam_gelems: float | None
) -> None:
    """Per-GPU memory of a config's layout (moe_rl/memory/), per pipeline stage, and its table row;
    --rank N: the N best layouts for parallel.nproc GPUs instead:
    moe-rl estimate [CONFIG.yaml] [key=value ...]."""
    from moe_rl.memory import (
        COLOCATED_ORDER,
        CPU_ADAM_ELEMS_PER_S_PER_CORE,
        HOST_CORES_PER_RANK,
        IB_GBS,
        MARGIN_GIB,
        NVLINK_GBS,
        PEAK_PHASES,
        GiB,
        Layout,
        Ranked,
        estimate,
        fits,
        format_estimate,
        layout_table,
        peer_sync_range,
        phase_peak_gib,
        rank_layouts,
        rollout_peaks,
        stage_memory,
        unfit_phase,
    )
    from moe_rl.preflight import unfit_reason

    _positive("--gpu-gib", gpu_gib)
    if gpu_gib <= MARGIN_GIB:  # nothing left: every phase would "not fit" against a negative size
        raise ConfigError(
            f"--gpu-gib must be more than the {MARGIN_GIB:g} GiB each GPU keeps for the CUDA context "
            f"(moe_rl/memory/), got {gpu_gib:g}"
        )
    if cpu_adam_gelems is not None:
        _positive("--cpu-adam-gelems-per-s", cpu_adam_gelems)
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    if top < 0:
        raise ConfigError(f"--rank must be >= 0 (0: the config's own layout only), got {top}")
    cfg = _load(args)
    lay = Layout.of(cfg.parallel)
    click.echo(f"{lay.describe(cfg.model.num_layers)} on {lay.world} GPUs of {gpu_gib:g} GiB")
    rate = cpu_adam_gelems * 1e9 if cpu_adam_gelems else None
    est = estimate(cfg, gpu_gib, gpus_per_node=gpus_per_node, cpu_adam_elems_per_s=rate)
    click.echo(format_estimate(est))
    if lay.pp > 1:
        for s in range(lay.pp):
            st = stage_memory(cfg, lay, s)
            click.echo(
                f"stage {s}: {st['layers']:.0f} layers, static {st['static'] / GiB:.1f} GiB, "
                f"train peak {st['train_peak'] / GiB:.1f} GiB"
            )
    without, with_ = rollout_peaks(cfg, gpu_gib)
    unloadable = cfg.rollout.engine == "vllm" and est["vllm_weights_gib"] > est["vllm_budget_gib"]
    click.echo(
        f"rollout peak: {without:.1f} GiB without parallel.offload_during_rollout, {with_:.1f} GiB with it"
        + (f" (vLLM's share; its weights alone need {est['vllm_weights_gib']:.1f})" if unloadable else "")
    )
    click.echo(
        "device peak per phase (GiB a GPU; "
        + " -> ".join(COLOCATED_ORDER)
        + "): "
        + ", ".join(f"{p} {phase_peak_gib(est, p):.1f}" for p in PEAK_PHASES)
        + f" of {gpu_gib - MARGIN_GIB:g} usable: "
        + (f"{phase} does not fit" if (phase := unfit_phase(cfg, est)) else "fits")
    )
    click.echo(
        f"host memory per rank: {est['host_gib_per_rank']:,.1f} GiB (CPU Adam "
        f"{est['host_cpu_adam_gib_per_rank']:,.1f}, offloaded learner "
        f"{est['host_offload_gib_per_rank']:,.1f}, "
        f"vLLM asleep {est['host_vllm_asleep_gib_per_rank']:,.1f}; pinned buffers rounded to powers of two)"
    )
    click.echo(
        f"host memory per node: {est['host_gib_per_node']:,.0f} GiB ({min(gpus_per_node, lay.world)} GPUs: "
        "CPU Adam state, the offloaded learner state, vLLM's sleeping weights)"
    )
    if cfg.optim.cpu_adam:
        click.echo(
            f"CPU Adam: {est['cpu_adam_s']:.1f} s a step (the rank's shard at "
            f"{(cpu_adam_gelems or 0) or CPU_ADAM_ELEMS_PER_S_PER_CORE * HOST_CORES_PER_RANK / 1e9:g} "
            "G elements/s; --cpu-adam-gelems-per-s overrides)"
        )
    peer, lo, hi = peer_sync_range(est["params_total_b"] * 1e9)
    click.echo(
        f"weight sync: {est['sync_gb_per_rank']:.1f} GB received per engine rank (its shard); "
        f"{est['sync_s']:.2f} s at line rate (NVLink {NVLINK_GBS:g} / InfiniBand {IB_GBS:g} GB/s per GPU, "
        f"a lower bound) to {lo:g}-{hi:g} s at the peers' measured efficiency (a {peer})"
    )
    rows = [Ranked(lay, est, fits(cfg, est))]
    if top > 0:
        nodes, per_node = max(1, lay.world // gpus_per_node), min(gpus_per_node, lay.world)
        rows = rank_layouts(cfg, nodes, per_node, gpu_gib)[:top]
    click.echo(layout_table(cfg, rows))
    why = unfit_reason(cfg, est)
    verdict = f"does not fit: {why}" if why else "fits"
    click.echo(f"verdict for {lay.describe(cfg.model.num_layers)}: {verdict}")


@main.command("export-hf")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path())
@click.option("--step", type=int, default=None, help="checkpoint step (default: the latest)")
@click.option("--max-shard-gb", type=float, default=5.0, show_default=True, help="safetensors shard size")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bf16", "fp16", "fp32"]),
    default="auto",
    show_default=True,
    help="auto: the init_weights=hf:DIR checkpoint's dtype, else fp32",
)
def export_hf(run_dir: str, out_dir: str, step: int | None, max_shard_gb: float, dtype: str) -> None:
    """Write a run's checkpoint as a Hugging Face checkpoint: moe-rl export-hf RUN_DIR OUT_DIR [--step N]."""
    from moe_rl.export import export_run

    _positive("--max-shard-gb", max_shard_gb)
    export_run(run_dir, out_dir, step, int(max_shard_gb * 2**30), dtype)


@main.group()
def data() -> None:
    """Prompt data sets: moe-rl data make-math OUT."""


@data.command("make-math")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--num", type=int, default=1000, show_default=True, help="problems")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--style",
    type=click.Choice(["verl", "slime"]),
    default="verl",
    show_default=True,
    help="row layout (verl: chat prompt + reward_model.ground_truth; slime: input/label)",
)
def make_math(out: str, num: int, seed: int, style: str) -> None:
    """Arithmetic word problems with answers, as .parquet or JSONL (moe_rl/tasks/make_data.py)."""
    from moe_rl.tasks.make_data import write_math_dataset

    click.echo(f"wrote {write_math_dataset(out, num, seed, style)} ({num} problems)")  # DataError: exit 2


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="output directory (default: RUN_DIR/report, RUN_A/compare_<B> for two runs, "
    "RUN_A/compare_<N>_runs for more)",
)
def report(run_dirs: tuple[str, ...], out: str | None) -> None:
    """Router stability report: moe-rl report RUN_DIR [RUN_DIR ...]  (HTML + markdown; several
    runs share every axis and colour scale)."""
    from moe_rl.report.render import report_runs

    with disk_full_named(out or f"{run_dirs[0]}/report"):
        html, verdicts = report_runs(list(run_dirs), out)
    click.echo("\n".join(verdicts))  # the run's one verdict first (docs/report.md 5)
    click.echo(f"wrote {html} and {html.with_name('report.md')}")


@main.command()
def env() -> None:
    """Versions of torch, megatron-core and the optional GPU packages, and the patch plan."""
    import torch

    import megatron_patches

    click.echo(f"python                     {sys.version.split()[0]}")
    click.echo(
        f"torch                      {torch.__version__} (cuda available: {torch.cuda.is_available()})"
    )
    click.echo(f"megatron-core              {metadata.version('megatron-core')}")
    for name in _OPTIONAL:
        try:
            ver = metadata.version(name)
        except metadata.PackageNotFoundError:
            ver = "not installed"
        click.echo(f"{name:<26} {ver}")
    click.echo("megatron patches:")
    for name, applies, reason in megatron_patches.plan():
        click.echo(f"  {name:<22} {'apply' if applies else 'skip ':<5}  {reason}")


if __name__ == "__main__":
    main()
