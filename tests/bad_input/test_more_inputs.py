"""bad_input tier, issue 26 point 5: more user-controlled inputs, each one ``error:`` line (exit
code 2, no traceback) naming the file / row / key / flag, and the disk unchanged: invalid UTF-8 in
a dataset, Adam betas and weight decay, a reward file that calls sys.exit, a corrupt config.yaml
for ``report``, the ``estimate`` / ``export-hf`` / ``data make-math`` flags, task.val_max_prompts
over the data-parallel ranks, and a full disk at a report, an HF export or a data write (an
OSError with errno ENOSPC raised in-process where the write happens). The cost of
rollout.staleness is said, not refused: ``estimate`` shows it and the trainer logs it.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from moe_rl import cli
from tests.cli_helpers import fails_with, fake_run, run_cli, snapshot, write


@pytest.mark.bad_input
def test_invalid_utf8_in_a_dataset_names_file_and_line_or_row(tmp_path):
    data = write(
        tmp_path / "p.jsonl", b'{"prompt": "C12:", "answer": "12"}\n{"prompt": "C1\xff:", "answer": "1"}\n'
    )
    fails_with(
        tmp_path,
        f"{data}: line 2: not valid UTF-8 (invalid start byte at byte 14)",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"task.dataset={data}",
    )
    strings = pa.array([b"C1:", b"C2\xc3:"], pa.binary()).view(pa.string())  # pyarrow writes it unchecked
    pq.write_table(pa.table({"prompt": strings, "answer": ["1", "2"]}), str(tmp_path / "p.parquet"))
    fails_with(
        tmp_path,
        f"{tmp_path / 'p.parquet'}: row 2: not valid UTF-8 (invalid continuation byte)",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"task.dataset={tmp_path / 'p.parquet'}",
    )


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "override, line",
    [
        ("optim.adam_beta1=1.0", "config key 'optim.adam_beta1': 1.0 is not in [0, 1)"),
        ("optim.adam_beta1=-0.5", "config key 'optim.adam_beta1': -0.5 is not in [0, 1)"),
        ("optim.adam_beta2=1", "config key 'optim.adam_beta2': 1.0 is not in [0, 1)"),
        ("optim.weight_decay=-0.01", "config key 'optim.weight_decay': must be >= 0 (got -0.01)"),
        ("stop_grace_s=-1", "config key 'stop_grace_s': must be a finite number >= 0 (got -1.0)"),
        ("stop_grace_s=inf", "config key 'stop_grace_s': must be a finite number >= 0 (got inf)"),
        (
            "task.val_max_prompts=3",
            ("config key 'task.val_max_prompts': 3 prompts do not split over 2 data-parallel ranks"),
        ),
    ],
)
def test_optimizer_and_validation_keys(tmp_path, override, line):
    fails_with(tmp_path, f"override '{override}': {line}", "train", f"run_dir={tmp_path / 'run'}", override)


@pytest.mark.bad_input
def test_adam_beta_in_a_file_names_the_file(tmp_path):
    p = write(tmp_path / "c.yaml", "optim:\n  adam_beta2: 1.5\n")
    fails_with(
        tmp_path,
        f"{p}: config key 'optim.adam_beta2': 1.5 is not in [0, 1)",
        "train",
        str(p),
        f"run_dir={tmp_path / 'run'}",
    )


@pytest.mark.bad_input
def test_reward_file_that_exits_on_import(tmp_path):
    reward = write(tmp_path / "r.py", "import sys\nsys.exit(3)\n")
    fails_with(
        tmp_path,
        f"config key 'task': task.reward='python:{reward}:score': {reward} calls sys.exit(3) on import",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"task.reward=python:{reward}:score",
    )


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "text, line",
    [
        (
            "model:\n  num_experts: [8\n",
            "{p}:3:1: YAML syntax error: expected ',' or ']', but got '<stream end>'",
        ),
        ("- 1\n- 2\n", "{p}: the top level is a list, expected the run's config mapping"),
        (b"steps: \xff\n", "{p}: not valid UTF-8 (invalid start byte at byte 7)"),
    ],
)
def test_report_of_a_run_with_a_corrupt_config(tmp_path, text, line):
    run = tmp_path / "run"
    fake_run(run, 30)
    cfg = write(run / "config.yaml", text)
    fails_with(tmp_path, line.format(p=cfg), "report", str(run))


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "args, line",
    [
        (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1, got 0"),
        (["--gpu-gib", "0"], "--gpu-gib must be a finite number > 0, got 0"),
        (["--gpu-gib", "-8"], "--gpu-gib must be a finite number > 0, got -8"),
        (["--gpu-gib", "nan"], "--gpu-gib must be a finite number > 0, got nan"),
        (["--gpu-gib", "inf"], "--gpu-gib must be a finite number > 0, got inf"),
        (["--cpu-adam-gelems-per-s", "0"], "--cpu-adam-gelems-per-s must be a finite number > 0, got 0"),
        (["--cpu-adam-gelems-per-s", "nan"], "--cpu-adam-gelems-per-s must be a finite number > 0, got nan"),
        (
            ["parallel.sync_bucket_mib=0"],
            "override 'parallel.sync_bucket_mib=0': "
            "config key 'parallel.sync_bucket_mib': must be >= 1 (got 0)",
        ),
    ],
)
def test_estimate_flags(tmp_path, args, line):
    fails_with(tmp_path, line, "estimate", *args)


@pytest.mark.bad_input
@pytest.mark.parametrize("size", ["0", "-1", "nan"])
def test_export_shard_size(tmp_path, size):
    run = tmp_path / "run"
    fake_run(run, 30)
    fails_with(
        tmp_path,
        f"--max-shard-gb must be a finite number > 0, got {size}",
        "export-hf",
        str(run),
        str(tmp_path / "out"),
        "--max-shard-gb",
        size,
    )


@pytest.mark.bad_input
def test_make_math_errors_exit_2(tmp_path):
    existing = write(tmp_path / "m.jsonl", "x\n")
    fails_with(
        tmp_path, f"{existing} already exists; make-math never overwrites", "data", "make-math", str(existing)
    )
    fails_with(
        tmp_path, "--num must be >= 1, got 0", "data", "make-math", str(tmp_path / "n.jsonl"), "--num", "0"
    )


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.bad_input
@pytest.mark.parametrize("name", ["m.jsonl", "m.parquet"])
def test_make_math_on_a_full_disk(tmp_path, monkeypatch, name):
    monkeypatch.setattr("pathlib.Path.write_text", _enospc)
    monkeypatch.setattr("pyarrow.parquet.write_table", _enospc)
    fails_with(
        tmp_path, f"no space left on device: {tmp_path / name}", "data", "make-math", str(tmp_path / name)
    )


@pytest.mark.bad_input
def test_report_on_a_full_disk(tmp_path, monkeypatch):
    run = tmp_path / "run"
    fake_run(run, 30)
    write(run / "metrics.jsonl", "".join(f'{{"step": {s}, "reward/mean": 0.5}}\n' for s in range(3)))
    monkeypatch.setattr(
        "moe_rl.report.render.build", lambda runs: {"figures": []}
    )  # no figures: report.md first
    monkeypatch.setattr(
        "moe_rl.report.render._ENV.get_template",
        lambda name: type("T", (), {"render": lambda self, **kw: "text"})(),
    )
    monkeypatch.setattr("os.fdopen", _enospc)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(cli.main, ["report", str(run)])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: no space left on device: {run / 'report' / 'report.md'}\n",
    )
    # no file written, no temp file left, not even the report's directories
    assert snapshot(tmp_path) == before


@pytest.mark.bad_input
def test_hf_export_on_a_full_disk_leaves_nothing(tmp_path, monkeypatch):
    """export_from_checkpoint's rank-0 write, in-process with a stand-in learner: safetensors reports
    a full disk as its own error ('... (os error 28)'), which is named like an OSError."""
    from safetensors import SafetensorError

    from moe_rl import export
    from moe_rl.config import load_config
    from moe_rl.tasks.task import resolve_vocab
    from moe_rl.tasks.tokenizer import CharTokenizer
    from moe_rl.weights.warmstart import load_init_weights

    cfg = resolve_vocab(load_config(None), CharTokenizer())
    weights = load_init_weights("builtin:warmstart", cfg.model, CharTokenizer())
    gpt = type(
        "G",
        (),
        {"sharded_state_dict": lambda self, prefix: {}, "load_state_dict": lambda self, sd, strict: 0},
    )
    learner = type(
        "L", (), {"gpt": gpt(), "model_cfg": cfg.model, "export_canonical": lambda self: weights}
    )()
    monkeypatch.setattr("moe_rl.learner.checkpoint.load_sharded", lambda sd, path: {"model": {}})

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("moe_rl.weights.hf.save_file", full)
    out = tmp_path / "hf"
    with pytest.raises(Exception) as err:
        export.export_from_checkpoint(learner, tmp_path / "ckpt", out, 400_000)
    assert (type(err.value).__name__, str(err.value)) == ("DiskFullError", f"no space left on device: {out}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither hf nor hf.tmp


@pytest.mark.bad_input
def test_staleness_cost_is_said(tmp_path, caplog):
    from moe_rl.pipeline.simulated_staleness import SimulatedStaleness

    code, out, err = run_cli(
        tmp_path, "estimate", "configs/qwen3_30b_a3b_1x8h100.yaml", "rollout.staleness=2"
    )
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[lines.index("reference_gib              0.0") + 1] == "stale_weights_gib          170.6"
    assert "learner_static_gib         237.9" in lines
    code, out0, _ = run_cli(tmp_path, "estimate", "configs/qwen3_30b_a3b_1x8h100.yaml")
    assert (
        code == 0
        and "stale_weights_gib" not in out0
        and "learner_static_gib         67.3" in out0.splitlines()
    )
    stale = SimulatedStaleness(3)
    with caplog.at_level(logging.INFO, logger="moe_rl.pipeline.simulated_staleness"):
        stale.push({"w": torch.zeros(2**27)})  # 0.5 GiB of fp32
        stale.push({"w": torch.ones(2**27)})
    assert [r.getMessage() for r in caplog.records] == [
        "rollout.staleness=3 keeps 4 weight sets of 0.50 GiB on this rank (2.00 GiB)"
    ]


@pytest.mark.bad_input
def test_apply_chat_template_value(tmp_path):
    fails_with(
        tmp_path,
        "override 'task.apply_chat_template=maybe': config key 'task.apply_chat_template': 'maybe' "
        "is not one of ['auto', 'false', 'true']",
        "train",
        f"run_dir={tmp_path / 'run'}",
        "task.apply_chat_template=maybe",
    )


@pytest.mark.bad_input
def test_chat_messages_without_a_template_name_tokenizer_and_row(tmp_path):
    data = write(
        tmp_path / "p.jsonl",
        '{"prompt": "C12:", "answer": "12"}\n'
        '{"prompt": [{"role": "user", "content": "C1:"}], "answer": "1"}\n',
    )
    fails_with(
        tmp_path,
        f"{data}: row 2: key 'prompt' holds chat messages but the tokenizer builtin:char has no "
        f"chat template; use an HF tokenizer with one (task.tokenizer=hf:DIR) or plain string "
        f"prompts",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"task.dataset={data}",
    )


@pytest.mark.bad_input
def test_stale_weight_sets_on_a_full_disk(tmp_path, monkeypatch):
    """rank 0's stale_weights_step_N.pt, written before the step's checkpoint: torch.save reports a
    full disk as RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos ...')
    (seen on a 64 KiB tmpfs), so the free space decides; the temp file is removed."""
    from moe_rl.checkpointing import CheckpointManager
    from moe_rl.config import load_config
    from moe_rl.errors import DiskFullError
    from moe_rl.pipeline.simulated_staleness import SimulatedStaleness

    stale = SimulatedStaleness(1)
    stale.push({"w": torch.zeros(4)})
    manager = CheckpointManager(
        load_config(None, [f"run_dir={tmp_path}", "rollout.staleness=1"]), None, None, stale
    )

    def full(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr("torch.save", full)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # a disk with room: not a full disk
        manager._save_stale("step_000002")
    monkeypatch.setattr("moe_rl.learner.checkpoint.FULL_DISK_FREE_BYTES", 2**62)
    with pytest.raises(DiskFullError) as err:
        manager._save_stale("step_000002")
    assert (
        str(err.value)
        == f"no space left on device: {tmp_path / 'checkpoints' / 'stale_weights_step_000002.pt'}"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.bad_input
def test_cpu_adam_without_the_distributed_optimizer_stops_before_any_rank(tmp_path):
    fails_with(
        tmp_path,
        "override 'optim.cpu_adam=true': config key 'optim.cpu_adam': needs "
        "parallel.distributed_optimizer=true (megatron-core steps "
        "on the host only as the distributed optimizer's precision-aware inner optimizer)",
        "train",
        f"run_dir={tmp_path / 'run'}",
        "optim.cpu_adam=true",
        "parallel.distributed_optimizer=false",
    )
