"""bad_input tier, issue 46 (dynamic sampling, docs/sampling.md): a filter key the reward does not
produce, a cap below one round, and greedy sampling (no group can carry signal): each one ``error:``
line naming the key, before any rank starts (exit code 2). Every schedule and the multi-turn loop
take it (docs/sampling.md 3)."""

from __future__ import annotations

import pytest

from tests.cli_helpers import fails_with
from tests.hf_assets import make_tokenizer

ON = "algo.dynamic_sampling.enabled=true"
KEY = f"override '{ON}': config key 'algo.dynamic_sampling.enabled'"


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["algo.dynamic_sampling.max_rounds=0"],
            "override 'algo.dynamic_sampling.max_rounds=0': config key 'algo.dynamic_sampling.max_rounds': "
            "0 is below one round: each step generates its own prompts at least once",
        ),
        (
            ["algo.dynamic_sampling.filter=reward/mean"],
            "override 'algo.dynamic_sampling.filter=reward/mean': config key 'algo.dynamic_sampling.filter': "
            "'reward/mean' is not one of ['accuracy', 'exact_match', 'reward']",
        ),
        (
            [ON, "rollout.top_k=1"],
            f"{KEY}: no group can carry signal with rollout.top_k=1: "
            "greedy samples of one prompt are all equal",
        ),
    ],
)
def test_dynamic_sampling_keys(tmp_path, overrides, line):
    fails_with(tmp_path, line, "train", f"run_dir={tmp_path / 'run'}", *overrides)


@pytest.mark.bad_input
def test_a_filter_key_the_reward_does_not_produce(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    fails_with(
        tmp_path,
        "config key 'algo.dynamic_sampling.filter': 'exact_match' is produced for the character "
        f"tokenizer's tasks only, not with task.tokenizer='hf:{tok}' and task.reward='exact_match'; "
        "filter on 'accuracy' (the reward's own score)",
        "train",
        f"run_dir={tmp_path / 'run'}",
        ON,
        "algo.dynamic_sampling.filter=exact_match",
        f"task.tokenizer=hf:{tok}",
    )
    assert not (tmp_path / "run").exists()  # before any rank started
