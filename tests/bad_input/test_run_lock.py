"""bad_input tier, issue 26: one run, one writer (``RUN_DIR/.lock``, moe_rl/run_lock.py), and
starts that fail leave nothing that blocks the retry: a run dir that cannot be resumed says what to
delete, and an HF directory without tokenizer files fails in preflight. In-process through the
real CLI (click's runner), exit code, the exact line, and the disk unchanged; the live-job and
signal cases with real processes are in test_job_end.py."""

from __future__ import annotations

import json
import os
import socket

import pytest

from moe_rl import run_lock
from tests.cli_helpers import fails_with, fake_run, run_cli, write


@pytest.mark.bad_input
def test_a_held_lock_refuses_train_and_resume_naming_the_owner(tmp_path):
    run = tmp_path / "run"
    fake_run(run, 30)
    fd = run_lock.acquire(run)  # as a live job holds it (flock conflicts across open files)
    try:
        owner = json.loads((run / ".lock").read_text())
        assert (owner["host"], owner["pid"]) == (socket.gethostname(), os.getpid())
        line = (
            f"run_dir {run} is in use by pid {os.getpid()} on host {socket.gethostname()} since "
            f"{owner['since']}; wait for that job to end or stop it (kill {os.getpid()} on "
            f"{socket.gethostname()}), or pass another run_dir="
        )
        fails_with(tmp_path, line, "train", f"run_dir={run}", "steps=40")
        fails_with(tmp_path, line, "train", f"run_dir={run}", "steps=40", "resume=true")
        with pytest.raises(run_lock.RunDirInUseError, match="is in use by pid"):
            run_lock.acquire(run)
    finally:
        os.close(fd)
    # the flock went with its holder: the file left behind is no lock (the run's own refusal is next)
    fails_with(
        tmp_path,
        f"config key 'run_dir': {run} already holds a run; pass resume=true to continue it, "
        f"or another run_dir=",
        "train",
        f"run_dir={run}",
        "steps=40",
    )
    fd = run_lock.acquire(run)  # a stale file is simply locked again, with the new owner
    os.close(fd)
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()


@pytest.mark.bad_input
def test_a_run_without_a_checkpoint_says_what_to_delete(tmp_path):
    """A run that stopped after some steps but saved no checkpoint: neither a new start nor
    resume=true can use the directory, and both say which files to delete."""
    run = tmp_path / "run"
    write(run / "config.yaml", "steps: 30\n")
    write(run / "metrics.jsonl", '{"step": 0}\n')
    write(run / "events.jsonl", "")
    files = f"{run}/config.yaml {run}/metrics.jsonl {run}/events.jsonl"
    fails_with(
        tmp_path,
        f"config key 'run_dir': {run} holds a run that saved no checkpoint, so it cannot be "
        f"resumed; delete {files} to start over, or pass another run_dir=",
        "train",
        f"run_dir={run}",
    )
    fails_with(
        tmp_path,
        f"resume=true but {run}/checkpoints has no checkpoint (the run saved none); delete "
        f"{files} and drop resume=true to start over, or pass another run_dir=",
        "train",
        f"run_dir={run}",
        "resume=true",
    )


@pytest.mark.bad_input
def test_failed_start_is_undone_and_a_logged_step_is_kept(tmp_path):
    """run_lock.hold: a fresh run whose job raises before its first step leaves the directory as
    it was (absent, or with only what was there before); after a logged step it is kept."""
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="rank crash"), run_lock.hold(run, fresh=True):
        write(run / "config.yaml", "steps: 3\n")
        raise RuntimeError("rank crash")
    assert not run.exists()
    write(run / "notes.txt", "mine")
    with pytest.raises(KeyboardInterrupt), run_lock.hold(run, fresh=True):
        write(run / "config.yaml", "steps: 3\n")
        write(run / "checkpoints" / "tmp" / "x", "")
        raise KeyboardInterrupt
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    with pytest.raises(RuntimeError), run_lock.hold(run, fresh=True):
        write(run / "metrics.jsonl", '{"step": 0}\n')
        raise RuntimeError("after the first step")
    assert sorted(p.name for p in run.iterdir()) == [".lock", "metrics.jsonl", "notes.txt"]


@pytest.mark.bad_input
def test_hf_dir_without_tokenizer_files_fails_in_preflight(tmp_path):
    import torch
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    from moe_rl.weights.hf_config import hf_config_dict
    from tests.models import hf_tiny

    write(hf / "config.json", json.dumps(hf_config_dict(hf_tiny(vocab_size=50))))
    save_file({"model.embed_tokens.weight": torch.zeros(50, 4)}, str(hf / "model.safetensors"))
    files = "tokenizer.json, tokenizer.model, vocab.json + merges.txt, vocab.txt"
    fails_with(
        tmp_path,
        f"config key 'init_weights': {hf} has no tokenizer files (none of {files}), and "
        f"task.tokenizer=auto reads the tokenizer from it; copy the checkpoint's tokenizer files "
        f"there, or pass task.tokenizer=hf:DIR",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"init_weights=hf:{hf}",
    )
    write(hf / "vocab.json", "{}")  # half of a BPE tokenizer is still none
    fails_with(
        tmp_path,
        f"config key 'task.tokenizer': {hf} has no tokenizer files (none of {files}), and "
        f"task.tokenizer=hf:{hf} reads the tokenizer from it; copy the checkpoint's tokenizer "
        f"files there, or pass task.tokenizer=hf:DIR",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"task.tokenizer=hf:{hf}",
    )
    code, _, err = run_cli(tmp_path, "config", f"init_weights=hf:{hf}")  # only `train` checks it
    assert (code, err) == (0, "")
