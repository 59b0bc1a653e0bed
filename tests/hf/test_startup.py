"""Start-up that never holds the whole model (issue 32 point 4, docs/design.md 2.2): preflight
checks the init weights from the safetensors headers alone, a resume never opens them, and under
an external torchrun the task is built once per process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import safetensors

from moe_rl.config import load_config
from moe_rl.weights.canonical import canonical_param_shapes
from moe_rl.weights.warmstart import builtin_path, load_init_weights
from tests.dist_harness import free_port


class HeaderOnly:
    """safetensors' ``safe_open`` with every tensor-data read refused: keys, metadata, shapes and
    dtypes answer; ``get_tensor`` and slicing raise."""

    reads = 0

    def __init__(self, *args, **kwargs) -> None:
        self.f = REAL_SAFE_OPEN(*args, **kwargs)

    def __enter__(self) -> HeaderOnly:
        self.f.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def metadata(self):
        return self.f.metadata()

    def get_slice(self, name):
        return _SliceHeader(self.f.get_slice(name))

    def get_tensor(self, name):
        HeaderOnly.reads += 1
        raise AssertionError(f"tensor data read: {name}")


class _SliceHeader:
    def __init__(self, s) -> None:
        self.s = s

    def get_shape(self):
        return self.s.get_shape()

    def get_dtype(self):
        return self.s.get_dtype()

    def __getitem__(self, index):
        HeaderOnly.reads += 1
        raise AssertionError("tensor data read (a slice)")


REAL_SAFE_OPEN = safetensors.safe_open


@pytest.mark.unit
def test_preflight_reads_no_tensor_data(tmp_path, monkeypatch, hf_dir):
    from moe_rl import trainer
    from moe_rl.weights.hf import load_hf_checkpoint, open_hf_checkpoint
    from tests.hf.conftest import CFG

    monkeypatch.setattr(safetensors, "safe_open", HeaderOnly)
    HeaderOnly.reads = 0
    args = [f"run_dir={tmp_path / 'a'}", "log.wandb_mode=disabled"]
    cfg = trainer.preflight(load_config(None, args))
    assert cfg.init_weights == "builtin:warmstart"
    stored = open_hf_checkpoint(hf_dir, CFG)  # what preflight runs for init_weights=hf:DIR
    assert {k: t.shape for k, t in stored.items()} == canonical_param_shapes(CFG)
    assert HeaderOnly.reads == 0
    # the proxy is live: loading the same files whole reads tensor data, and it refuses
    with pytest.raises(AssertionError, match="tensor data read"):
        load_init_weights("builtin:warmstart", cfg.model, _char())
    with pytest.raises(AssertionError, match="tensor data read"):
        load_hf_checkpoint(hf_dir, CFG)
    assert HeaderOnly.reads == 2


def _char():
    from moe_rl.tasks.tokenizer import CharTokenizer

    return CharTokenizer()


TINY = [
    "parallel.nproc=1",
    "parallel.expert_parallel=1",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=4",
    "log.progress_bar=false",
    "log.wandb_mode=disabled",
    "log.val_every=0",
    "task.reward_workers=0",
]

# `moe-rl train` as one rank of an external torchrun (world 1), counting build_task calls
COUNTING = """
import sys
import moe_rl.tasks.task as task_mod
calls = []
real = task_mod.build_task
def counted(*a, **k):
    calls.append(1)
    return real(*a, **k)
task_mod.build_task = counted
from moe_rl import cli
try:
    code = cli.main(sys.argv[1:], standalone_mode=False)  # click returns an Exit's code here
finally:
    print("BUILD_TASK_CALLS", len(calls))
sys.exit(code if isinstance(code, int) else 0)
"""


def _train_rank(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", COUNTING, "train", *TINY, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.e2e
def test_resume_never_opens_the_init_weights_and_the_task_is_built_once(tmp_path):
    init = tmp_path / "init.safetensors"
    shutil.copy(builtin_path(), init)
    run = tmp_path / "run"
    first = _train_rank(f"run_dir={run}", f"init_weights={init}", "steps=1")
    assert "BUILD_TASK_CALLS 1\n" in first.stdout, first.stdout[-2000:]
    init.unlink()  # the checkpoint has every weight: a resume must not need the file
    again = _train_rank(f"run_dir={run}", "resume=true", "steps=2")
    assert "BUILD_TASK_CALLS 1\n" in again.stdout, again.stdout[-2000:]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    # the memory timeline: the first start loads the init weights, the resume does not
    recs = [json.loads(x) for x in (run / "memory_timeline.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(recs) if r["phase"] == "preflight"]
    assert len(starts) == 2 and all(r["rank"] == 0 for r in (recs[i] for i in starts))
    one, two = [r["phase"] for r in recs[: starts[1]]], [r["phase"] for r in recs[starts[1] :]]
    startup = ["preflight", "learner model", "init load", "learner optimizer", "engine build", "resume"]
    assert one[:7] == [*startup, "first sync"], one
    assert "init load" not in two and two[:6] == [x for x in startup if x != "init load"] + ["first sync"]
    assert {"rollout", "update", "sync"} <= set(one) and {"rollout", "update", "sync"} <= set(two)
    assert all(r["peak_rss_gib"] >= r["rss_gib"] > 0 for r in recs)
    assert all(r["t0"] <= r["t1"] for r in recs)  # a span's wall-clock bounds (gpu_smoke's phase peaks)
