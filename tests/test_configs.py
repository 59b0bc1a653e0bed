"""Every shipped config parses through the real loader and validates (style.md rule 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import ConfigError, RunConfig, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


@pytest.mark.unit
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.run_dir != RunConfig().run_dir  # each config writes its own run dir


@pytest.mark.unit
def test_configs_exist():
    assert len(CONFIGS) >= 2


@pytest.mark.unit
@pytest.mark.parametrize("overrides, needle", [
    (["parallel.expert_parallel=3"], "'parallel.expert_parallel'"),
    (["model.moe_router_topk=9"], "'model.moe_router_topk'"),
    (["model.num_query_groups=3"], "'model.num_query_groups'"),
    (["model.first_k_dense=4"], "'model.first_k_dense'"),
    (["rollout.top_p=0"], "'rollout.top_p'"),
    (["algo.kl_estimator=k9"], "'algo.kl_estimator'"),
    (["algo.advantage=ppo"], "'algo.advantage'"),
    (["algo.num_minibatches=3"], "'algo.num_minibatches'"),
    (["parallel.tensor_parallel=2"], "'parallel.tensor_parallel'"),
    (["nosuch=1"], "'nosuch'"),
    (["model.hidden_size=1.5"], "'model.hidden_size'"),
    (["steps"], "key=value"),
])
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


@pytest.mark.unit
def test_yaml_then_overrides_precedence(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  temperature: 0.7\n  top_k: 5\nsteps: 9\n")
    cfg = load_config(p, ["rollout.top_k=3"])
    assert (cfg.rollout.temperature, cfg.rollout.top_k, cfg.steps) == (0.7, 3, 9)
    assert cfg.model == RunConfig().model


@pytest.mark.unit
def test_unknown_key_in_file_names_file_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  hiden_size: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "model.hiden_size" in str(e.value)
