"""bad_input tier, issue 44 point 9 (config side): an ``agent.env`` that does not import, is no
environment, or refuses its kwargs, and agent keys the loop cannot run yet: one ``error:`` line
(exit code 2), before any rank starts, the disk unchanged."""

from __future__ import annotations

import pytest

from tests.cli_helpers import fails_with, write


@pytest.mark.bad_input
def test_environment_module_that_does_not_import(tmp_path):
    fails_with(
        tmp_path,
        "config key 'agent.env': no_such_env_mod:Env does not import: "
        "ModuleNotFoundError: No module named 'no_such_env_mod'",
        "train",
        f"run_dir={tmp_path / 'run'}",
        "agent.env=no_such_env_mod:Env",
    )


@pytest.mark.bad_input
def test_environment_module_that_raises_or_exits_on_import(tmp_path, monkeypatch):
    write(tmp_path / "mods" / "broken_env.py", "raise RuntimeError('no GPU here')\n")
    write(tmp_path / "mods" / "exiting_env.py", "import sys\nsys.exit(3)\n")
    write(tmp_path / "mods" / "not_env.py", "class Env:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    run = f"run_dir={tmp_path / 'run'}"
    fails_with(
        tmp_path,
        "config key 'agent.env': broken_env:Env does not import: RuntimeError: no GPU here",
        "train",
        run,
        "agent.env=broken_env:Env",
    )
    fails_with(
        tmp_path,
        "config key 'agent.env': exiting_env:Env does not import: SystemExit: 3",
        "train",
        run,
        "agent.env=exiting_env:Env",
    )
    fails_with(
        tmp_path,
        "config key 'agent.env': not_env:Env is a type, not a subclass of "
        "moe_rl.agentic.environment.Environment",
        "train",
        run,
        "agent.env=not_env:Env",
    )


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["agent.env=calculus"],
            "config key 'agent.env': unknown environment 'calculus'; known: ['calculator', 'lookup'] "
            "or module:Class",
        ),
        (
            ["agent.env=calculator", "agent.env_kwargs={num_opz: 2}"],
            "config key 'agent.env_kwargs': calculator refuses ['num_opz']: "
            "Calculator.__init__() got an unexpected keyword argument 'num_opz'",
        ),
        (
            ["agent.env=calculator", "agent.tool_format=qwen3"],
            "config key 'agent.tool_format': qwen3 is for an HF tokenizer with a chat template; "
            "this run's tokenizer is the char tokenizer",
        ),
        (
            ["agent.env=calculator", "rollout.staleness=1"],
            "override 'rollout.staleness=1': config key 'rollout.staleness': the simulated staleness "
            "does not take the multi-turn loop (agent.env=calculator); parallel.rollout_ranks with "
            "rollout.mode=one_step_off or async give real staleness",
        ),
        (
            ["routing.stale_rows=keep"],
            "override 'routing.stale_rows=keep': config key 'routing.stale_rows': 'keep' is not one of "
            "['drop_sample', 'native', 'replay']",
        ),
        (
            ["rollout.prefix_cache_blocks=-1"],
            "override 'rollout.prefix_cache_blocks=-1': config key 'rollout.prefix_cache_blocks': "
            "must be >= 0 (0: off)",
        ),
        (
            ["rollout.prefix_block_tokens=0"],
            "override 'rollout.prefix_block_tokens=0': config key 'rollout.prefix_block_tokens': "
            "must be >= 1",
        ),
        (
            ["rollout.engine=vllm", "rollout.prefix_cache_blocks=8"],
            "override 'rollout.prefix_cache_blocks=8': config key 'rollout.prefix_cache_blocks': 8: the "
            "built-in engine's prefix cache, and rollout.engine=vllm",
        ),
        (
            ["agent.env=calculator", "rollout.engine=vllm", "routing.verify.every=5"],
            "override 'routing.verify.every=5': config key 'routing.verify.every': 5: the verifier's "
            "full prefill is built for the built-in engine only; rollout.engine=vllm is not yet "
            "(docs/agentic.md 9)",
        ),
        (
            ["routing.verify.every=5"],
            "override 'routing.verify.every=5': config key 'routing.verify.every': 5: the verifier "
            "checks multi-turn route traces: set agent.env",
        ),
        (
            ["agent.max_turns=0"],
            "override 'agent.max_turns=0': config key 'agent.max_turns': must be >= 1 (got 0)",
        ),
    ],
)
def test_agent_keys_are_refused_by_name(tmp_path, overrides, line):
    fails_with(tmp_path, line, "train", f"run_dir={tmp_path / 'run'}", *overrides)
