"""The nested correction keys, their deprecated flat spellings, the typed rejection spec, and the
layout checks in moe_rl/config/layout.py (issue 23.2)."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from moe_rl import cli
from moe_rl.config import (
    DEPRECATED_KEYS,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RejectionSpec,
    load_config,
    to_dict,
)
from moe_rl.config.layout import check_layout, data_parallel_size, pipeline_stage_layers

pytestmark = pytest.mark.unit


def _warning(where: str, old: str, new: str | None) -> str:
    what = f"use '{new}'" if new else "removed; its value is ignored"
    return (
        f"warning: {where}: config key '{old}' is deprecated: {what} (the old key goes in the next release)\n"
    )


# ------------------------------------------------------------------ deprecated keys

TRM_VALUES = {
    "max": "0.05",
    "avg": "0.002",
    "reference": "theta",
    "kl": "exact",
    "length_neutral": "ser",
    "ln_threshold": "0.07",
    "ln_eps": "0.04",
    "ln_delta": "0.002",
}


@pytest.mark.parametrize("leaf, value", TRM_VALUES.items())
def test_old_trm_override_resolves_like_the_new_key_with_one_warning(leaf, value, capsys):
    new = load_config(None, [f"correction.trm.{leaf}={value}"])
    assert capsys.readouterr().err == ""
    old = load_config(None, [f"correction.trm_{leaf}={value}"])
    assert capsys.readouterr().err == _warning(
        f"override 'correction.trm_{leaf}={value}'", f"correction.trm_{leaf}", f"correction.trm.{leaf}"
    )
    assert to_dict(old) == to_dict(new) and str(getattr(new.correction.trm, leaf)) == value


def test_alias_table_names_every_old_trm_key():
    assert {k: v for k, v in DEPRECATED_KEYS.items() if k.startswith("correction.trm_")} == {
        f"correction.trm_{leaf}": f"correction.trm.{leaf}" for leaf in TRM_VALUES
    }


def test_old_flat_yaml_resolves_like_the_nested_one(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text(
        "correction:\n  trm_max: 0.1\n  trm_reference: theta\n  rs: [seq_sum_k1, seq_max_k2]\n"
        "  rs_bounds: ['0.5_2.0', '0.05']\nrollout:\n  vllm:\n    weight_sync: transfer\n"
    )
    new = tmp_path / "new.yaml"
    new.write_text(
        "correction:\n  trm:\n    max: 0.1\n    reference: theta\n  rejection:\n"
        "    - {option: seq_sum_k1, lower: 0.5, upper: 2.0}\n    - {option: seq_max_k2, upper: 0.05}\n"
    )
    assert to_dict(load_config(old)) == to_dict(load_config(new))
    assert capsys.readouterr().err == "".join(
        [
            _warning(str(old), "correction.trm_max", "correction.trm.max"),
            _warning(str(old), "correction.trm_reference", "correction.trm.reference"),
            _warning(str(old), "correction.rs", "correction.rejection"),
            _warning(str(old), "correction.rs_bounds", "correction.rejection"),
            _warning(str(old), "rollout.vllm.weight_sync", None),
        ]
    )


@pytest.mark.parametrize(
    "rs, bounds, specs",
    [
        ("[seq_sum_k1]", "[0.5_2.0]", [RejectionSpec("seq_sum_k1", upper=2.0, lower=0.5)]),
        (
            "[token_k1, seq_mean_k3]",
            "['3']",
            [RejectionSpec("token_k1", upper=3.0), RejectionSpec("seq_mean_k3", upper=3.0)],
        ),
        ("[seq_mean_k3]", "[0.01]", [RejectionSpec("seq_mean_k3", upper=0.01)]),
    ],
)
def test_old_rs_and_rs_bounds_become_typed_specs(rs, bounds, specs, capsys):
    cfg = load_config(None, [f"correction.rs={rs}", f"correction.rs_bounds={bounds}"])
    assert cfg.correction.rejection == specs
    rs_item, bounds_item = f"correction.rs={rs}", f"correction.rs_bounds={bounds}"
    assert capsys.readouterr().err == (
        _warning(f"override {rs_item!r}", "correction.rs", "correction.rejection")
        + _warning(f"override {bounds_item!r}", "correction.rs_bounds", "correction.rejection")
    )


def test_old_rs_errors_are_the_old_lines():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["correction.rs=[seq_sum_k1]"])
    assert str(e.value) == (
        "override 'correction.rs=[seq_sum_k1]': config key 'correction.rs_bounds': "
        "give bounds exactly when rs is set"
    )
    with pytest.raises(ConfigError) as e:
        load_config(None, ["correction.rs=[token_k1, token_k2]", "correction.rs_bounds=[2.0, 0.1, 0.2]"])
    assert str(e.value) == (
        "override 'correction.rs_bounds=[2.0, 0.1, 0.2]': config key 'correction.rs': "
        "2 rejection options but 3 bounds"
    )


def test_deprecated_key_through_the_cli_warns_then_errors(tmp_path):
    result = CliRunner().invoke(
        cli.main,
        ["train", f"run_dir={tmp_path / 'r'}", "correction.rs=[seq_sum_k2]", "correction.rs_bounds=[inf]"],
    )
    assert result.exit_code == 2
    assert result.stderr == (
        _warning("override 'correction.rs=[seq_sum_k2]'", "correction.rs", "correction.rejection")
        + _warning("override 'correction.rs_bounds=[inf]'", "correction.rs_bounds", "correction.rejection")
        + "error: override 'correction.rs_bounds=[inf]': config key 'correction.rs_bounds': "
        "['inf'] are not finite numbers ('0.5_2.0' or '0.01')\n"
    )


def test_renamed_override_errors_name_the_override_and_the_new_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["correction.trm_max=-1"])
    assert str(e.value) == (
        "override 'correction.trm_max=-1': config key 'correction.trm.max': TRM deltas must be >= 0"
    )
    with pytest.raises(ConfigError) as e:
        load_config(None, ["correction.trm_kl=full"])
    assert str(e.value) == (
        "override 'correction.trm_kl=full': config key 'correction.trm.kl': "
        "'full' is not one of ['exact', 'sample']"
    )


def test_removed_weight_sync_is_ignored(capsys):
    assert to_dict(load_config(None, ["rollout.vllm.weight_sync=load_weights"])) == to_dict(load_config(None))
    assert capsys.readouterr().err == _warning(
        "override 'rollout.vllm.weight_sync=load_weights'", "rollout.vllm.weight_sync", None
    )


# ------------------------------------------------------------------ the typed rejection spec


def test_rejection_spec_parses_into_options_and_bounds():
    cfg = load_config(
        None,
        [
            (
                "correction.rejection=[{option: token_k1, lower: 0.6, upper: 1.6}, "
                "{option: seq_max_k2, upper: 2.5}, {option: seq_sum_k1, upper: 4}]"
            )
        ],
    )
    c = cfg.correction
    assert tuple(r.option for r in c.rules) == ("token_k1", "seq_max_k2", "seq_sum_k1")
    assert tuple(s.bound for s in c.rejection) == ((0.6, 1.6), 2.5, 4.0)
    # parsed once, into typed rules (k1: log bounds on rho; a bare k1 upper U means (1/U, U))
    assert c.rules[0] == ("token", "k1", math.log(0.6), math.log(1.6))
    assert c.rules[1] == ("seq_max", "k2", -math.inf, 2.5)
    assert c.rules[2] == ("seq_sum", "k1", math.log(0.25), math.log(4.0))
    assert load_config(None).correction.rejection == [] and load_config(None).correction.rules == ()


@pytest.mark.parametrize(
    "value, line",
    [
        (
            "[{option: seq_max_k1, upper: 2.0}]",
            "config key 'correction.rejection[0]': seq_max_k1 is not supported (k1 is sign-indefinite); "
            "use seq_max_k2",
        ),
        (
            "[{option: token_k1, upper: 2.0}, {option: seq_mean_k3, lower: 0.5, upper: 2.0}]",
            "config key 'correction.rejection[1]': seq_mean_k3: bound must be one float > 0, got (0.5, 2.0)",
        ),
        (
            "[{option: seq_mean_k3}]",
            "config key 'correction.rejection[0]': seq_mean_k3: bound must be one float > 0, got 0.0",
        ),
        (
            "[{option: token_k1, upper: 0.5}]",
            "config key 'correction.rejection[0]': token_k1: a single k1 bound U means (1/U, U) "
            "and needs U >= 1, got 0.5",
        ),
        (
            "[{option: token_k1, lower: 3.0, upper: 2.0}]",
            "config key 'correction.rejection[0]': token_k1: k1 bounds on rho need 0 < lo <= hi, "
            "got (3.0, 2.0)",
        ),
        (
            "[{option: seq_k1, upper: 2.0}]",
            (
                "config key 'correction.rejection[0]': unknown rejection option 'seq_k1'; "
                "use <agg>_<k1|k2|k3>, agg in "
                "['seq_max', 'seq_mean', 'seq_sum', 'token']"
            ),
        ),
        (
            "[{option: token_k1, upper: .nan}]",
            "config key 'correction.rejection[0].upper': nan is not a finite number",
        ),
        (  # YAML's nan is text; inf and nan reach the finiteness check, not a type error
            "[{option: token_k1, upper: nan}]",
            "config key 'correction.rejection[0].upper': nan is not a finite number",
        ),
    ],
)
def test_bad_rejection_spec_is_one_line_naming_the_rule(value, line):
    item = f"correction.rejection={value}"
    with pytest.raises(ConfigError) as e:
        load_config(None, [item])
    assert str(e.value) == f"override {item!r}: {line}"


def test_bad_rejection_spec_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("correction:\n  rejection:\n    - {option: token_k1, hi: 2.0}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        f"{path}: config key 'correction.rejection[0].hi': not a field of a rejection rule "
        f"['option', 'upper', 'lower']"
    )


def test_rejection_spec_bound_is_what_the_grammar_takes():
    assert RejectionSpec("token_k1", upper=2.0).bound == 2.0
    assert RejectionSpec("token_k1", upper=2.0, lower=0.25).bound == (0.25, 2.0)
    from moe_rl.corrections.correction_specs import parse_rs_spec

    assert parse_rs_spec(["token_k1"], [RejectionSpec("token_k1", upper=2.0).bound]) == [
        ("token", "k1", math.log(0.5), math.log(2.0))
    ]


# ------------------------------------------------------------------ layout checks (moe_rl/config/layout.py)


@pytest.mark.parametrize(
    "model, par, line",
    [
        (
            {},
            {"expert_parallel": 3},
            "config key 'parallel.expert_parallel': 3 does not divide model.num_experts 8",
        ),
        (
            {"num_query_groups": 1, "num_attention_heads": 3},
            {"tensor_parallel": 2, "expert_parallel": 1},
            "config key 'parallel.tensor_parallel': 2 does not divide model.num_query_groups 1",
        ),
        (
            {"vocab_size": 33},
            {"tensor_parallel": 2, "expert_parallel": 1},
            "config key 'parallel.tensor_parallel': 2 does not divide model.vocab_size 33",
        ),
        (
            {},
            {"nproc": 4, "tensor_parallel": 2, "expert_tensor_parallel": 3},
            "config key 'parallel.expert_tensor_parallel': 3 does not divide model.moe_ffn_hidden_size 128",
        ),
        (
            {},
            {"nproc": 3, "tensor_parallel": 2, "expert_parallel": 1},
            "config key 'parallel.nproc': 3 ranks are not a multiple of "
            "tensor_parallel x pipeline_parallel = 2 x 1",
        ),
        (
            {},
            {"nproc": 4, "expert_parallel": 8},
            (
                "config key 'parallel.expert_parallel': "
                "expert_parallel x expert_tensor_parallel x pipeline_parallel = "
                "8 x 1 x 1 does not divide parallel.nproc 4"
            ),
        ),
        (
            {},
            {"nproc": 3, "pipeline_parallel": 3, "expert_parallel": 1},
            (
                "config key 'parallel.pipeline_parallel': 4 layers do not split evenly "
                "over 3 pipeline stages "
                "(model.num_layers, parallel.layers_in_first_stage / layers_in_last_stage)"
            ),
        ),
        (
            {"first_k_dense": 2},
            {"pipeline_parallel": 2, "expert_parallel": 1},
            "config key 'model.first_k_dense': 2 dense layers leave pipeline stage 0 (layers 0..1) "
            "without a MoE layer",
        ),
        (
            {"tie_word_embeddings": True},
            {"pipeline_parallel": 2, "expert_parallel": 1},
            "config key 'model.tie_word_embeddings': true with parallel.pipeline_parallel=2 is not "
            "supported (the embedding and the lm_head would live on different stages): use "
            "parallel.pipeline_parallel=1",
        ),
    ],
)
def test_layout_checks_name_keys_and_numbers(model, par, line):
    with pytest.raises(ConfigError) as e:
        check_layout(ModelConfig(**model), ParallelConfig(**par))
    assert str(e.value) == line
    # the loader says the same, after the source
    overrides = [f"model.{k}={v}" for k, v in model.items()] + [f"parallel.{k}={v}" for k, v in par.items()]
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).endswith(": " + line)


def test_layout_sizes():
    par = ParallelConfig(
        nproc=8, tensor_parallel=2, pipeline_parallel=2, expert_parallel=2, layers_in_first_stage=1
    )
    assert data_parallel_size(par) == 2
    assert pipeline_stage_layers(5, par) == (1, 4)
    check_layout(ModelConfig(num_layers=5), par)  # divides: no error
    assert load_config(None, ["parallel.nproc=8", "parallel.tensor_parallel=2"]).data_parallel == 4


def test_registries_hold_the_names_configs_accept():
    from moe_rl import names
    from moe_rl.corrections import dvp, importance, trm
    from moe_rl.maths.advantages import ADVANTAGES
    from moe_rl.weights.hf import FAMILIES

    assert set(ADVANTAGES) == set(names.ADVANTAGE_NAMES)
    assert set(importance.IS_LEVELS) == set(names.IS_LEVEL_NAMES)
    assert set(importance.RS_AGGREGATIONS) == set(names.RS_AGGREGATION_NAMES)
    assert set(dvp.SAFE_SET_RULES) == set(names.SAFE_SET_RULE_NAMES)
    assert set(FAMILIES) == set(names.HF_FAMILY_NAMES)
    assert trm.TRM_REFERENCES is names.TRM_REFERENCE_NAMES
    assert trm.LENGTH_NEUTRAL is names.LENGTH_NEUTRAL_NAMES
    assert trm.TRM_KL_SOURCES is names.TRM_KL_SOURCE_NAMES


_BOOL = "a boolean key takes true or false"


@pytest.mark.parametrize(
    "item, shown, kind, hint",
    [
        ('rollout.sync_check="false"', "'false'", "str", _BOOL),
        ("rollout.sync_check=1", "1", "int", _BOOL),
        ("rollout.sync_check=0", "0", "int", _BOOL),
        ("resume=2", "2", "int", _BOOL),
        ('steps="4"', "'4'", "str", "an integer key takes an integer"),
        ('optim.lr="0.5"', "'0.5'", "str", "a number key takes an integer or a float"),
        ("optim.lr=true", "True", "bool", "a number key takes an integer or a float"),
    ],
)
def test_a_value_of_another_type_is_refused_not_coerced(item, shown, kind, hint):
    key = item.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, [item])
    assert str(e.value) == (
        f"override {item!r}: config key '{key}': {shown} is {kind}, not taken as typed "
        f"({hint}; nothing is coerced)"
    )


def test_values_of_the_keys_type_are_taken_and_a_file_is_named(tmp_path):
    cfg = load_config(None, ["rollout.sync_check=true", "steps=4", "optim.lr=1", "resume=no"])
    assert (cfg.rollout.sync_check, cfg.steps, cfg.optim.lr, cfg.resume) == (True, 4, 1.0, False)
    assert type(cfg.optim.lr) is float  # an integer for a number key is the number
    path = tmp_path / "c.yaml"
    path.write_text('rollout:\n  sync_check: "false"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        f"{path}: config key 'rollout.sync_check': 'false' is str, not taken as typed "
        f"({_BOOL}; nothing is coerced)"
    )
    path.write_text("correction:\n  rejection:\n    - {option: token_k1, upper: '2.0'}\n")
    with pytest.raises(ConfigError, match=r"'correction.rejection\[0\].upper': '2.0' is str"):
        load_config(path)
