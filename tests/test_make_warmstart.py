"""unit tier: scripts/make_warmstart.py's --model overrides (a warm start for another architecture,
e.g. the collapse lab's fine-grained FP8 setting, docs/collapse_lab.md 4)."""

from __future__ import annotations

import sys

import pytest

from moe_rl.config import RunConfig
from moe_rl.errors import ConfigError
from tests.script_module import script_module


@pytest.mark.unit
def test_model_overrides_reach_the_config_and_nothing_else():
    ws = script_module("make_warmstart")
    cfg = ws.run_config(["num_experts=32", "moe_router_topk=4"])
    assert (cfg.model.num_experts, cfg.model.moe_router_topk) == (32, 4)
    # every other field is the default: the shipped warm start's config is unchanged without --model
    default = RunConfig()
    assert cfg.model.hidden_size == default.model.hidden_size == 128
    assert cfg.rollout == default.rollout and cfg.optim == default.optim
    assert ws.run_config([]) == default


@pytest.mark.unit
def test_bad_model_override_is_one_error_line_naming_the_key(monkeypatch, capsys):
    ws = script_module("make_warmstart")
    with pytest.raises(ConfigError, match=r"model\.num_expert\b"):
        ws.run_config(["num_expert=32"])  # a typo: no silent default
    with pytest.raises(ConfigError, match=r"model\.num_experts"):
        ws.run_config(["num_experts=4.6"])  # no coercion of a float to an int
    # main: one line and exit 2, before megatron or a rank starts
    monkeypatch.setattr(sys, "argv", ["make_warmstart.py", "--model", "moe_router_topk=two"])
    with pytest.raises(SystemExit) as exc:
        ws.main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: --model: ") and "model.moe_router_topk" in err
    assert err.count("\n") == 1
    # --agent starts from the shipped default-architecture file: no --model with it
    monkeypatch.setattr(sys, "argv", ["make_warmstart.py", "--agent", "--model", "num_experts=32"])
    with pytest.raises(SystemExit) as exc:
        ws.main()
    err = capsys.readouterr().err
    assert (
        exc.value.code == 2
        and err == "error: --model: only without --agent (it starts from the default-architecture file)\n"
    )
