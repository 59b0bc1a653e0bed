"""The in-process CLI checks of the bad_input tier (and any test that runs ``moe-rl`` through
click's runner): run a command and check the disk did not change, expect one ``error:`` line
with exit code 2, write a file, fake a run directory as training leaves it, and the options of a
tiny real run; the processes a job's session left and its stderr lines with a prefix."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

from click.testing import CliRunner

from moe_rl import cli
from moe_rl.config import load_config, to_yaml
from moe_rl.tasks.task import resolve_vocab
from moe_rl.tasks.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
# a training run of a few seconds a step, for the tests that start real ranks
TINY = [
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "log.progress_bar=false",
    "log.wandb_mode=disabled",
]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root with its content hash (directories: 'dir')."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_cli(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `moe-rl ARGS`, asserting nothing under tmp_path changed."""
    before = snapshot(tmp_path)
    result = CliRunner().invoke(cli.main, list(args))
    assert snapshot(tmp_path) == before, "a failed command changed files"
    return result.exit_code, result.stdout, result.stderr


def fails_with(tmp_path: Path, line: str, *args: str) -> None:
    code, out, err = run_cli(tmp_path, *args)
    assert (code, err) == (2, f"error: {line}\n"), err
    assert out == ""


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def fake_run(run: Path, step: int, **changes) -> None:
    """A run directory as training leaves it: config.yaml and a complete checkpoint at ``step``."""
    cfg = resolve_vocab(
        load_config(None, [f"run_dir={run}", "steps=30", *[f"{k}={v}" for k, v in changes.items()]]),
        CharTokenizer(),
    )
    write(run / "config.yaml", to_yaml(cfg))
    write(run / "metrics.jsonl", "")
    write(run / "checkpoints" / f"step_{step:06d}" / "trainer_state.json", json.dumps({"step": step}))
    write(run / "checkpoints" / "latest", f"step_{step:06d}\n")


def left_in_session(sid: int) -> list[str]:
    """The session's processes that still run (a few seconds for them to go)."""
    deadline = time.time() + 10
    while True:
        ps = subprocess.run(
            ["ps", "-ww", "-o", "pid=,stat=,args=", "-s", str(sid)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.splitlines()
        alive = [x for x in ps if x.split()[1][0] != "Z"]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


def last_lines(err: str, prefix: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith(prefix)]


def run_faulted(args: list[str], extra_env: dict[str, str] | None = None) -> tuple[int, str, int]:
    """``python -m tests.bad_input.faults ARGS`` in its own session (the fault tests' launcher):
    its exit code, stderr and pid (the session to check for leftovers)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(extra_env or {})}
    env.pop("MOE_RL_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.bad_input.faults", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, err, proc.pid
