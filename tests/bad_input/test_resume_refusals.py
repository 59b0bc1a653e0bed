"""bad_input tier, issue 42.3: a resume the checkpoint cannot take is refused by preflight, in the
launcher, before any rank starts: one ``error:`` line, exit code 2, nothing on disk changed (the
saved config.yaml is not rewritten), and ``moe_rl.launch.launch`` never called. Refused: a changed
``rollout.mode`` (a one_step_off / async checkpoint holds the batches in flight, sync has none) or
``parallel.rollout_ranks``, the in-flight batch's shape, dynamic sampling turned off on a split run
that asked for its rounds (issue 46) and an over-sampled batch in flight's factor, a missing or
truncated in-flight file, and the checkpoint's own files (``checkpoint.check_files``, as
``export-hf`` checks them).

The checkpoints are ``fake_run``'s (config.yaml + trainer_state.json + the in-flight files as
``torch.save`` writes them); a real one_step_off checkpoint is refused the same way in
tests/e2e/test_split_runs.py, before it resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.config import load_run_config
from moe_rl.errors import CheckpointError
from moe_rl.preflight import check_resume
from tests.cli_helpers import fails_with, fake_run

pytestmark = pytest.mark.bad_input
ONE_STEP_OFF = {"parallel.nproc": 4, "parallel.rollout_ranks": 2, "rollout.mode": "one_step_off"}


@pytest.fixture()
def no_launch(monkeypatch) -> list:
    """The calls of ``moe_rl.launch.launch`` (which starts the ranks): none may happen."""
    calls: list = []
    monkeypatch.setattr("moe_rl.launch.launch", lambda *a, **k: calls.append(a))
    return calls


def _resume_fails(tmp_path: Path, run: Path, line: str, *args: str) -> None:
    fails_with(tmp_path, line, "train", f"run_dir={run}", "resume=true", "steps=40", *args)


def _changed(run: Path, key: str, now, was) -> str:
    return (
        f"resume=true: {key}={now} but the run in {run} was made with {key}={was} "
        f"({run}/config.yaml); a checkpoint cannot change it: use {key}={was} or a new run_dir="
    )


def _in_flight(run: Path, dp: int) -> Path:
    """A batch in flight as the trainer writes it (a ``torch.save`` zip of tensors)."""
    path = run / "checkpoints" / f"in_flight_step_000030_dp{dp}.pt"
    torch.save({"tokens": torch.arange(4096).reshape(64, 64), "version": 30}, path)
    return path


def test_a_one_step_off_checkpoint_refuses_another_mode_or_shape(tmp_path, no_launch):
    run = tmp_path / "run"
    fake_run(run, 30, **ONE_STEP_OFF)
    # the batch in flight would be dropped (sync) or read as a buffer of requests (async)
    _resume_fails(tmp_path, run, _changed(run, "rollout.mode", "sync", "one_step_off"), "rollout.mode=sync")
    _resume_fails(tmp_path, run, _changed(run, "rollout.mode", "async", "one_step_off"), "rollout.mode=async")
    # colocated on the same 4 ranks: 4 learner ranks where the checkpoint has 2
    _resume_fails(
        tmp_path,
        run,
        _changed(run, "parallel.rollout_ranks", 0, 2),
        "parallel.rollout_ranks=0",
        "rollout.mode=sync",
    )
    # the batch in flight holds 32 prompts x 8 samples
    _resume_fails(
        tmp_path, run, _changed(run, "rollout.prompts_per_step", 16, 32), "rollout.prompts_per_step=16"
    )
    _resume_fails(
        tmp_path, run, _changed(run, "rollout.samples_per_prompt", 4, 8), "rollout.samples_per_prompt=4"
    )
    assert no_launch == []


def test_a_dynamic_one_step_off_checkpoint_refuses_to_go_on_without_it(tmp_path):
    # its data cursor is ahead of its step: the rollout ranks would draw each step's own index again
    # (in-process: the check the CLI's preflight runs, as the refusals above show it does)
    run, key = tmp_path / "run", "algo.dynamic_sampling.enabled"
    fake_run(run, 30, **ONE_STEP_OFF, **{key: "true"})
    resume = [f"run_dir={run}", "resume=true", "steps=40"]
    with pytest.raises(CheckpointError) as e:
        check_resume(load_run_config(None, [*resume, f"{key}=false"]))
    assert str(e.value) == _changed(run, key, "false", "true")
    with pytest.raises(CheckpointError, match="step_000030"):  # kept on: past this check (no .metadata)
        check_resume(load_run_config(None, resume))


def test_an_over_sampled_one_step_off_checkpoint_keeps_its_factor(tmp_path):
    # its batch in flight holds factor x the step's groups (the rollout rank's round, issue 46): the
    # learner would draw another count of prompts; turned off, the rounds would no longer be asked for
    run, key = tmp_path / "run", "algo.over_sampling.factor"
    fake_run(run, 30, **ONE_STEP_OFF, **{key: 2})
    resume = [f"run_dir={run}", "resume=true", "steps=40"]
    for now in (3, 1):
        with pytest.raises(CheckpointError) as e:
            check_resume(load_run_config(None, [*resume, f"{key}={now}"]))
        assert str(e.value) == _changed(run, key, float(now), 2.0)
    with pytest.raises(CheckpointError, match="step_000030"):  # kept: past this check (no .metadata)
        check_resume(load_run_config(None, resume))


def test_a_missing_or_truncated_resume_file_is_named_before_any_rank(tmp_path, no_launch):
    run = tmp_path / "run"
    fake_run(run, 30, **ONE_STEP_OFF)
    ckpts = run / "checkpoints"
    dp0 = _in_flight(run, 0)
    dp1 = ckpts / "in_flight_step_000030_dp1.pt"
    _resume_fails(
        tmp_path,
        run,
        f"resume=true but {dp1} (the batches in flight, rollout.mode=one_step_off) is missing: the "
        f"checkpoint in {ckpts} is incomplete; resume from another step (point {ckpts / 'latest'} at it)",
    )
    whole = _in_flight(run, 1).read_bytes()
    corrupt = (
        f"{dp1} (the batches in flight, rollout.mode=one_step_off) is truncated or corrupt: the "
        f"checkpoint in {ckpts} cannot be resumed; resume from another step (point {ckpts / 'latest'} at it)"
    )
    for damaged in (whole[:-1], whole[: len(whole) // 2], b"\0" * len(whole)):
        dp1.write_bytes(damaged)
        _resume_fails(tmp_path, run, corrupt)
    # whole in-flight files: the checkpoint's own files are next (fake_run's has no .metadata)
    dp1.write_bytes(whole)
    step = ckpts / "step_000030"
    _resume_fails(
        tmp_path,
        run,
        f"{step / '.metadata'}: unreadable checkpoint metadata (FileNotFoundError); the checkpoint in "
        f"{step} is truncated or corrupt: resume from another step",
    )
    assert dp0.is_file() and no_launch == []


def test_a_sync_checkpoint_with_stale_weights_needs_their_file(tmp_path, no_launch):
    run = tmp_path / "run"
    fake_run(run, 30, **{"rollout.staleness": 2})
    stale = run / "checkpoints" / "stale_weights_step_000030.pt"
    ckpts = stale.parent
    _resume_fails(
        tmp_path,
        run,
        f"resume=true but {stale} (the engine's stale weight sets, rollout.staleness=2) is missing: the "
        f"checkpoint in {ckpts} is incomplete; resume from another step (point {ckpts / 'latest'} at it)",
    )
    _resume_fails(tmp_path, run, _changed(run, "rollout.staleness", 1, 2), "rollout.staleness=1")
    assert no_launch == []
