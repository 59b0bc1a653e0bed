"""bad_input tier (issue 14): every mistake a user can make in a config, a file or the command
line ends with exit code 2 and exactly one line ``error: ...`` naming the file / key / override /
line and what to do, no traceback, and nothing on disk changed. These cases fail in the CLI's
config load or preflight, before any rank starts, so they run in-process through click's runner
(``moe_rl.cli.main``, the console script's entry point); ``test_real_process_*`` checks the same
contract on a real ``python -m moe_rl.cli`` process.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from moe_rl import cli
from moe_rl.config import load_config, to_yaml
from moe_rl.weights.warmstart import builtin_path
from tests.cli_helpers import ROOT, fails_with, fake_run, run_cli, snapshot, write

# ------------------------------------------------------------------ config files and overrides


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "text, line",
    [
        ("steps: [3\n", "{p}:2:1: YAML syntax error: did not find expected ',' or ']'"),
        (
            "steps: 3\nmodel:\n\thidden_size: 64\n",
            "{p}:3:1: YAML syntax error: found character that cannot start any token "
            "(a tab: indent YAML with spaces)",
        ),
        (
            "- steps: 3\n- seed: 1\n",
            "{p}: the top level is a list, expected a mapping of config keys (e.g. 'steps: 100')",
        ),
        ("steps: 3\nsteps: 4\n", "{p}:2:1: YAML syntax error: found duplicate key steps"),
        (
            "rollout:\n  temprature: 0.5\n",
            "{p}: config key 'rollout.temprature': Key 'temprature' not in 'RolloutConfig'. "
            "Did you mean: 'temperature'?",
        ),
        ("optim:\n  lr: .inf\n", "{p}: config key 'optim.lr': inf is not a finite number"),
        (
            "resume: maybe\n",
            "{p}: config key 'resume': 'maybe' is str, not taken as typed (a boolean key takes true or "
            "false; nothing is coerced)",
        ),
        (
            b"steps: 3\nseed: \xff\n",
            "{p}: cannot read the YAML config (UnicodeDecodeError: "
            "'utf-8' codec can't decode byte 0xff in position 15: invalid start byte)",
        ),
    ],
)
def test_bad_yaml_names_file_and_line(tmp_path, text, line):
    p = write(tmp_path / "c.yaml", text)
    fails_with(tmp_path, line.format(p=p), "train", str(p), f"run_dir={tmp_path / 'run'}")


@pytest.mark.bad_input
def test_config_path_that_is_a_directory_or_missing(tmp_path):
    (tmp_path / "d.yaml").mkdir()
    fails_with(
        tmp_path,
        f"config file {tmp_path / 'd.yaml'} is a directory; give a YAML file",
        "train",
        str(tmp_path / "d.yaml"),
    )
    fails_with(
        tmp_path, f"config file {tmp_path / 'no.yaml'} does not exist", "config", str(tmp_path / "no.yaml")
    )


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["model.hidden_size=big", "rollout.temperature=0.5"],
            "override 'model.hidden_size=big': config key 'model.hidden_size': "
            "'big' is str, not taken as typed (an integer key takes an integer; nothing is coerced)",
        ),
        (
            ["rollout.temperature=0.5", "model.hidden_size=big"],
            "override 'model.hidden_size=big': config key 'model.hidden_size': "
            "'big' is str, not taken as typed (an integer key takes an integer; nothing is coerced)",
        ),
        (["optim.lr=inf"], "override 'optim.lr=inf': config key 'optim.lr': inf is not a finite number"),
        (
            ["optim.lr=nan", "steps=3"],
            "override 'optim.lr=nan': config key 'optim.lr': nan is not a finite number",
        ),
        (
            ["rollout.temperature=-inf"],
            "override 'rollout.temperature=-inf': config key 'rollout.temperature': -inf "
            "is not a finite number",
        ),
        (
            ["correction.rejection=[{option: seq_sum_k2, upper: inf}]"],
            "override 'correction.rejection=[{option: seq_sum_k2, upper: inf}]': "
            "config key 'correction.rejection[0].upper': "
            "inf is not a finite number",
        ),
        (["steps"], "override 'steps' is not of the form key=value"),
        (
            ["stepz=3"],
            "override 'stepz=3': config key 'stepz': Key 'stepz' not in 'RunConfig'. Did you mean: 'steps'?",
        ),
        (["steps=0"], "override 'steps=0': config key 'steps': must be >= 1"),
        (
            ["rollout.max_new_tokens=64"],
            "override 'rollout.max_new_tokens=64': config key 'rollout.max_new_tokens': "
            "64 leaves no room for a prompt within model.max_seq_len=64",
        ),
        (
            ["parallel.expert_parallel=3"],
            "override 'parallel.expert_parallel=3': config key "
            "'parallel.expert_parallel': 3 does not divide model.num_experts 8",
        ),
        (
            ["routing.replay=r4"],
            "override 'routing.replay=r4': config key 'routing.replay': 'r4' is not one of "
            "['off', 'r2', 'r3']",
        ),
        (
            ["log.health.patience=0"],
            "override 'log.health.patience=0': config key 'log.health.patience': must be >= 1",
        ),
    ],
)
def test_bad_override_is_named(tmp_path, overrides, line):
    fails_with(tmp_path, line, "train", f"run_dir={tmp_path / 'run'}", *overrides)


@pytest.mark.bad_input
def test_empty_values_are_the_empty_string_as_documented(tmp_path):
    code, out, err = run_cli(tmp_path, "config", "init_weights=", "task.dataset=", "routing.replay=off")
    assert (code, err) == (0, "")
    assert "init_weights: ''\n" in out and "  dataset: ''\n" in out and "  replay: 'off'\n" in out
    cfg = load_config(None, ["init_weights=", "task.dataset= "])
    assert (cfg.init_weights, cfg.task.dataset) == ("", "")


# ------------------------------------------------------------------ the run directory


@pytest.mark.bad_input
def test_run_dir_that_is_a_file_or_under_one(tmp_path):
    f = write(tmp_path / "file", "x")
    fails_with(
        tmp_path,
        f"config key 'run_dir': {f} is a file, not a directory; give a new or existing run directory",
        "train",
        f"run_dir={f}",
    )
    fails_with(
        tmp_path,
        f"config key 'run_dir': {f} is a file, so {f}/run cannot be created",
        "train",
        f"run_dir={f}/run",
    )


@pytest.mark.bad_input
def test_existing_run_without_resume(tmp_path):
    run = tmp_path / "run"
    fake_run(run, 30)
    fails_with(
        tmp_path,
        f"config key 'run_dir': {run} already holds a run; pass resume=true to continue it, or "
        f"another run_dir=",
        "train",
        f"run_dir={run}",
        "steps=40",
    )


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["model.num_experts=4"],
            "resume=true: model.num_experts=4 but the run in {run} was made with "
            "model.num_experts=8 ({run}/config.yaml); a checkpoint cannot change it: use "
            "model.num_experts=8 or a new run_dir=",
        ),
        (
            ["model.hidden_size=64", "init_weights="],
            "resume=true: model.hidden_size=64 but the run in {run} was made with model.hidden_size=128 "
            "({run}/config.yaml); a checkpoint cannot change it: use model.hidden_size=128 or a new run_dir=",
        ),
        (
            ["parallel.expert_parallel=1"],
            "resume=true: parallel.expert_parallel=1 but the run in {run} was made with "
            "parallel.expert_parallel=2 ({run}/config.yaml); a checkpoint cannot change "
            "it: use parallel.expert_parallel=2 or a new run_dir=",
        ),
        (
            ["steps=3"],
            "config key 'steps': 3, but the run in {run} is at step 30 (step_000030); pass steps > 30 to "
            "train on",
        ),
        (
            ["steps=30"],
            "config key 'steps': 30, but the run in {run} is at step 30 (step_000030); pass steps > 30 to "
            "train on",
        ),
    ],
)
def test_resume_refuses_changed_fields_and_past_steps(tmp_path, args, line):
    run = tmp_path / "run"
    fake_run(run, 30)
    fails_with(tmp_path, line.format(run=run), "train", f"run_dir={run}", "resume=true", "steps=40", *args)


@pytest.mark.bad_input
def test_resume_without_a_checkpoint_or_with_a_dangling_pointer(tmp_path):
    run = tmp_path / "run"
    fails_with(
        tmp_path,
        f"resume=true but {run} holds no run to resume (no config.yaml); drop resume=true to start a new run",
        "train",
        f"run_dir={run}",
        "resume=true",
    )
    fake_run(run, 30)
    write(run / "checkpoints" / "latest", "step_000040\n")
    fails_with(
        tmp_path,
        f"{run}/checkpoints/latest names step_000040, which is not a complete checkpoint; point "
        f"it at a complete step_N directory",
        "train",
        f"run_dir={run}",
        "resume=true",
        "steps=50",
    )
    write(run / "checkpoints" / "latest", "step_000030\n")
    saved = (run / "config.yaml").read_text()
    (run / "config.yaml").unlink()
    missing = (
        f"resume=true but {run}/config.yaml is missing, so the checkpoint's model and layout are "
        f"unknown; write the config the run was started with there (moe-rl config [CONFIG.yaml] "
        f"[key=value ...] prints it)"
    )
    fails_with(tmp_path, missing, "train", f"run_dir={run}", "resume=true", "steps=50")
    # a config file given with resume=true is the base, but the checkpoint still needs the saved one
    given = write(tmp_path / "given.yaml", saved)
    fails_with(tmp_path, missing, "train", str(given), f"run_dir={run}", "resume=true", "steps=50")


@pytest.mark.bad_input
def test_resume_takes_the_saved_config_as_its_base(tmp_path):
    """resume=true without a config file: the run's config.yaml, then the overrides; with a file,
    the file (the command that started the run, re-run with resume=true, means what it said)."""
    run = tmp_path / "run"
    fake_run(run, 30, **{"model.num_experts": 4, "optim.lr": 0.001})
    code, out, err = run_cli(tmp_path, "config", f"run_dir={run}", "resume=true", "steps=50")
    assert (code, err) == (0, "")
    want = load_config(run / "config.yaml", ["resume=true", "steps=50"])
    assert out == to_yaml(want)
    assert "num_experts: 4\n" in out and "lr: 0.001\n" in out and "steps: 50\n" in out
    given = write(tmp_path / "recipe.yaml", "steps: 60\n")
    code, out, _ = run_cli(tmp_path, "config", str(given), f"run_dir={run}", "resume=true")
    assert code == 0 and out == to_yaml(load_config(given, [f"run_dir={run}", "resume=true"]))
    assert "num_experts: 8\n" in out and "steps: 60\n" in out  # the defaults under the file
    fails_with(
        tmp_path,
        "override 'resume=maybe': config key 'resume': 'maybe' is str, not taken as typed (a boolean key "
        "takes true or false; nothing is coerced)",
        "config",
        f"run_dir={run}",
        "resume=maybe",
    )


# ------------------------------------------------------------------ weights files


@pytest.mark.bad_input
def test_init_weights_that_are_not_safetensors_or_cut(tmp_path):
    bad = write(tmp_path / "w.safetensors", "this is not a checkpoint\n")
    fails_with(
        tmp_path,
        f"config key 'init_weights': {bad}: not a readable safetensors file, or a truncated one "
        f"(Error while deserializing header: header too large)",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"init_weights={bad}",
    )
    cut = write(tmp_path / "cut.safetensors", builtin_path().read_bytes()[:100_000])
    code, _, err = run_cli(tmp_path, "train", f"run_dir={tmp_path / 'run'}", f"init_weights={cut}")
    assert (
        code == 2
        and err.startswith(
            f"error: config key 'init_weights': {cut}: not a readable safetensors file, or a truncated one ("
        )
        and err.count("\n") == 1
    ), err
    fails_with(
        tmp_path,
        f"config key 'init_weights': {tmp_path} is a directory (a HF checkpoint directory is given "
        f"as hf:DIR)",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"init_weights={tmp_path}",
    )
    fails_with(
        tmp_path,
        f"config key 'init_weights': {tmp_path / 'nope'} is not a directory",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"init_weights=hf:{tmp_path / 'nope'}",
    )


def _train_from(tmp_path, hf_dir) -> tuple[str, ...]:
    """``moe-rl train`` warm-started from the HF directory, its tokenizer the built-in one."""
    run_dir = f"run_dir={tmp_path / 'run'}"
    return ("train", run_dir, f"init_weights=hf:{hf_dir}", "task.tokenizer=builtin:char")


@pytest.mark.bad_input
def test_hf_checkpoint_json_errors_name_the_file(tmp_path, hf_dir):
    config = hf_dir / "config.json"
    good = config.read_text()
    config.write_text(good + "{}\n")
    n = good.count("\n") + 1
    fails_with(tmp_path, f"{config}:{n}:1: not valid JSON (Extra data)", *_train_from(tmp_path, hf_dir))
    config.write_text("[1, 2]")
    fails_with(tmp_path, f"{config}: expected a JSON object, got a list", *_train_from(tmp_path, hf_dir))
    config.write_text(good)
    index = hf_dir / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-40])
    code, _, err = run_cli(tmp_path, *_train_from(tmp_path, hf_dir))
    assert (
        code == 2 and err.startswith(f"error: {index}:") and "not valid JSON" in err and err.count("\n") == 1
    )


@pytest.mark.bad_input
def test_truncated_hf_shard_names_the_shard(tmp_path, hf_dir):
    shard = sorted(hf_dir.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    code, _, err = run_cli(tmp_path, *_train_from(tmp_path, hf_dir))
    assert code == 2 and err.startswith(
        f"error: {shard}: not a readable safetensors file, or a truncated one ("
    )
    assert err.count("\n") == 1


# ------------------------------------------------------------------ prompts


@pytest.mark.bad_input
def test_prompt_longer_than_max_seq_len_names_file_and_line(tmp_path, caplog):
    data = write(
        tmp_path / "p.jsonl",
        '{"prompt": "C12:", "answer": "12"}\n\n{"prompt": "C' + "1" * 50 + ':", "answer": "1"}\n',
    )
    fails_with(
        tmp_path,
        f"{data}: row 2: prompt has 53 tokens (bos included), more than 52 (model.max_seq_len=64 minus "
        f"rollout.max_new_tokens=12); shorten it, raise model.max_seq_len, or set task.overlong=drop",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"task.dataset={data}",
    )
    fails_with(
        tmp_path,
        "config key 'task.max_len': 30 digits give prompts of up to 33 tokens, more than 32 "
        "(model.max_seq_len=44 minus rollout.max_new_tokens=12); lower task.max_len or raise "
        "model.max_seq_len",
        "train",
        f"run_dir={tmp_path / 'run'}",
        "task.max_len=30",
        "model.max_seq_len=44",
    )
    # task.overlong=drop: the line is dropped with a warning giving the count, and the run goes on
    from moe_rl.trainer import preflight

    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"task.dataset={data}", "task.overlong=drop"])
    with caplog.at_level(logging.WARNING, logger="moe_rl.tasks"):
        preflight(cfg)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"{data}: dropped 1 of 2 prompts longer than 52 tokens (model.max_seq_len=64 minus "
        f"rollout.max_new_tokens=12; task.overlong=drop)"
    ]


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "setup, args, line",
    [
        (None, ["task.dataset={d}/nope.jsonl"], "{d}/nope.jsonl: prompt file does not exist"),
        (
            "dir",
            ["task.dataset={d}/data"],
            "{d}/data: is a directory; task.dataset names a JSONL or Parquet file",
        ),
        (
            None,
            ["task.tasks=[reverse,frobnicate]"],
            "config key 'task': unknown task(s) ['frobnicate']; "
            "known tasks: ['add', 'copy', 'reverse', 'sort']",
        ),
        # a larger model vocabulary is allowed (padded embeddings): the warm start then does not fit
        (
            None,
            ["model.vocab_size=64"],
            "init_weights {root}/moe_rl/assets/warmstart.safetensors was made for "
            "model.vocab_size=50, but the config has model.vocab_size=64",
        ),
        (
            None,
            ["model.vocab_size=40"],
            "the tokenizer (builtin:char) has 50 tokens but the model's vocabulary "
            "(model.vocab_size) has only 40: every token id needs an embedding row",
        ),
    ],
)
def test_bad_task_inputs(tmp_path, setup, args, line):
    if setup == "dir":
        (tmp_path / "data").mkdir()
    fails_with(
        tmp_path,
        line.format(d=tmp_path, root=ROOT),
        "train",
        f"run_dir={tmp_path / 'run'}",
        *[a.format(d=tmp_path) for a in args],
    )


# ------------------------------------------------------------------ other commands, and the contract itself


@pytest.mark.bad_input
def test_report_and_export_of_a_directory_that_is_no_run(tmp_path):
    (tmp_path / "empty").mkdir()
    fails_with(
        tmp_path,
        f"{tmp_path / 'empty' / 'metrics.jsonl'} does not exist: {tmp_path / 'empty'} is not a "
        f"moe-rl run directory (or its first step has not been logged yet)",
        "report",
        str(tmp_path / "empty"),
        "--out",
        str(tmp_path / "empty" / "r"),
    )
    run = tmp_path / "run"
    fake_run(run, 30)
    shutil.rmtree(run / "checkpoints" / "step_000030")
    fails_with(
        tmp_path,
        f"{run}/checkpoints/latest names step_000030, which is not a complete checkpoint; point it "
        f"at a complete step_N directory",
        "export-hf",
        str(run),
        str(tmp_path / "out"),
    )


@pytest.mark.bad_input
def test_debug_shows_the_traceback_and_a_bug_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_RL_DEBUG", "0")  # restored (unset) after the test, though --debug sets it
    result = CliRunner().invoke(cli.main, ["--debug", "train", "optim.lr=inf"])
    assert result.exit_code == 1 and type(result.exception).__name__ == "ConfigError"
    assert (
        str(result.exception) == "override 'optim.lr=inf': config key 'optim.lr': inf is not a finite number"
    )
    assert os.environ["MOE_RL_DEBUG"] == "1"  # the ranks of `train` inherit it
    monkeypatch.setenv("MOE_RL_DEBUG", "0")

    def bug(*a, **k):
        raise KeyError("a bug, not a user error")

    monkeypatch.setattr("moe_rl.trainer.check_launch", bug)
    result = CliRunner().invoke(cli.main, ["train", f"run_dir={tmp_path / 'run'}"])
    assert result.exit_code == 1 and isinstance(result.exception, KeyError)  # not mapped, not hidden
    assert result.stderr == ""


@pytest.mark.bad_input
def test_real_process_exit_code_and_one_line(tmp_path):
    f = write(tmp_path / "file", "x")
    before = snapshot(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MOE_RL_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", f"run_dir={f}", "optim.lr=1e-5"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: config key 'run_dir': {f} is a file, not a directory; give a new or existing run directory\n"
    )
    assert snapshot(tmp_path) == before
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "optim.lr=inf"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "MOE_RL_DEBUG": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "moe_rl.errors.ConfigError: override 'optim.lr=inf': config key "
        "'optim.lr': inf is not a finite number"
    )


@pytest.mark.bad_input
def test_resume_with_a_corrupt_saved_config_or_trainer_state(tmp_path):
    run = tmp_path / "run"
    fake_run(run, 30)
    state = run / "checkpoints" / "step_000030" / "trainer_state.json"
    state.write_text('{"step": 30')
    fails_with(
        tmp_path,
        f"{state}:1:12: not valid JSON (Expecting ',' delimiter)",
        "train",
        f"run_dir={run}",
        "resume=true",
        "steps=40",
    )
    (run / "config.yaml").write_text("model:\n  num_experts: [8\n")
    fails_with(
        tmp_path,
        f"{run}/config.yaml:3:1: YAML syntax error: did not find expected ',' or ']'",
        "train",
        f"run_dir={run}",
        "resume=true",
        "steps=40",
    )


@pytest.mark.bad_input
def test_export_never_overwrites_and_unknown_reward(tmp_path):
    run = tmp_path / "run"
    fake_run(run, 30)
    (tmp_path / "out").mkdir()
    fails_with(
        tmp_path,
        f"{tmp_path / 'out'} already exists; an HF export never overwrites",
        "export-hf",
        str(run),
        str(tmp_path / "out"),
    )
    code, _, err = run_cli(tmp_path, "train", f"run_dir={tmp_path / 'r2'}", "task.reward=exact")
    assert (
        code == 2
        and err.startswith("error: config key 'task': unknown reward 'exact'")
        and err.count("\n") == 1
    )
