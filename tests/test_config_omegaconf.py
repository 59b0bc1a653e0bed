"""load_config works on every omegaconf the project allows (>=2.3,<2.5).

omegaconf 2.3's merge refused to write into the read-only nodes that frozen dataclasses make
('config key model.transformer_impl: Cannot set value of read-only config node'); 2.4 accepts it.
CI runs these under both: 2.4 in the main venv, 2.3.0 in the lowest-direct venv
(scripts/test_lowest.sh).
"""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from moe_rl.config import ConfigError, load_config

pytestmark = pytest.mark.unit


def test_installed_omegaconf_is_an_allowed_version() -> None:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    deps = [Requirement(d) for d in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]
    (spec,) = [d.specifier for d in deps if d.name == "omegaconf"]
    assert spec.contains(Version(metadata.version("omegaconf"))), spec


def test_nested_keys_from_file_and_overrides(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  transformer_impl: local\n  hidden_size: 96\nrollout:\n  temperature: 0.7\n")
    cfg = load_config(
        path, ["model.num_layers=3", "routing.replay=off", "parallel.nproc=1", "parallel.expert_parallel=1"]
    )
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.rollout.temperature) == (96, 3, 0.7)
    assert cfg.routing.replay == "off"
    assert cfg.parallel.nproc == 1


def test_loaded_config_is_still_frozen_and_defaults_untouched() -> None:
    cfg = load_config(None, ["model.hidden_size=96"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.hidden_size = 1  # type: ignore[misc]
    assert load_config().model.hidden_size != 96  # the override did not leak into the defaults


def test_wrong_nested_key_still_names_it_on_this_omegaconf() -> None:
    with pytest.raises(ConfigError, match=r"model\.no_such_key"):
        load_config(None, ["model.no_such_key=1"])
    with pytest.raises(ConfigError, match=r"model\.hidden_size"):
        load_config(None, ["model.hidden_size=abc"])
