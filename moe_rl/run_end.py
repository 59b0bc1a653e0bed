"""The lines `moe-rl train` ends with: where the run is, its last checkpoint, the reward at its
start and end, where an offline wandb run went, and the commands that come next (report, resume,
export), each runnable as printed from the directory the run was started in.

Reward at start and end: the report's one definition (``moe_rl.report.outcome.start_and_final_reward``:
the first logged step's ``reward/mean``, and the mean over the last 10 logged steps) over the run's
``metrics.jsonl`` (a resumed run's file holds every step since step 0), so the end line and
``moe-rl report`` print the same two numbers. Every value is read back from the run directory, not
from the ranks.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from moe_rl.metrics import METRICS_FILE, read_metrics
from moe_rl.report.outcome import FINAL_WINDOW, start_and_final_reward


@dataclass(frozen=True)
class RunEnd:
    run_dir: Path
    steps_done: int  # 1 + the last logged step
    resumed_from: int | None  # the checkpoint step this start continued from (None: a fresh start)
    checkpoint: Path | None  # the last complete checkpoint
    checkpoint_step: int | None
    reward_start_final: tuple[float, float] | None  # start_and_final_reward (None: no reward logged)
    wandb_offline: Path | None  # the newest offline wandb run directory


def gather(run_dir: str | Path, wandb_mode: str, resumed_from: int | None) -> RunEnd:
    """What the run directory says after a run (a UserError of an unreadable checkpoint pointer
    propagates: the run just wrote it)."""
    from moe_rl.fsutil import read_json
    from moe_rl.learner import checkpoint

    run_dir = Path(run_dir)
    records, _ = read_metrics(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else ([], [])
    rewards = [float(r["reward/mean"]) for r in records if "reward/mean" in r]
    latest = checkpoint.latest(run_dir / "checkpoints")
    offline = sorted((run_dir / "wandb").glob("offline-run-*")) if wandb_mode == "offline" else []
    return RunEnd(
        run_dir=run_dir,
        steps_done=int(records[-1]["step"]) + 1 if records else 0,
        resumed_from=resumed_from,
        checkpoint=latest,
        checkpoint_step=None if latest is None else int(read_json(latest / "trainer_state.json")["step"]),
        reward_start_final=start_and_final_reward(rewards) if rewards else None,
        wandb_offline=offline[-1] if offline else None,  # named offline-run-<YYYYmmdd_HHMMSS>-<id>
    )


def export_dir(run_dir: Path) -> Path:
    """A new directory beside the run for ``moe-rl export-hf`` (which never overwrites)."""
    p = run_dir if run_dir.name not in ("", ".", "..") else run_dir.resolve()
    return p.with_name(p.name + "-hf")


def end_lines(end: RunEnd) -> list[str]:
    q, run = shlex.quote, end.run_dir
    resumed = "" if end.resumed_from is None else f" (resumed from step {end.resumed_from})"
    lines = [f"run finished: {end.steps_done} steps in {run}{resumed}"]
    if end.checkpoint is not None:
        lines.append(f"last checkpoint: step {end.checkpoint_step}, {end.checkpoint}")
    else:
        lines.append("no checkpoint saved: the run cannot be resumed or exported")
    if end.reward_start_final is not None:
        start, final = end.reward_start_final
        lines.append(
            f"reward/mean: start {start:.4f} (the first logged step), "
            f"final {final:.4f} (the mean of the last {FINAL_WINDOW} logged steps)"
        )
    if end.wandb_offline is not None:
        glob = f"{q(str(end.wandb_offline.parent))}/offline-run-*"
        lines.append(f"wandb (offline): {end.wandb_offline}; upload with: wandb sync {glob}")
    lines.append("next:")
    lines.append(f"  moe-rl report {q(str(run))}")
    if end.checkpoint is not None:
        lines.append(f"  moe-rl train run_dir={q(str(run))} resume=true steps={2 * end.steps_done}")
        lines.append(f"  moe-rl export-hf {q(str(run))} {q(str(export_dir(run)))}")
    return lines
