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


OS = "algo.over_sampling.factor=2"
OS_KEY = f"override '{OS}': config key 'algo.over_sampling.factor'"


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["algo.over_sampling.factor=0.5"],
            "override 'algo.over_sampling.factor=0.5': config key 'algo.over_sampling.factor': 0.5 is "
            "below 1: a round starts at least the prompts the step needs",
        ),
        (
            [OS, "algo.over_sampling.on_abort=partial", "rollout.max_staleness=0"],
            "override 'rollout.max_staleness=0': config key 'rollout.max_staleness': 0 drops every partial "
            "rollout: a resumed response's earlier tokens are 1 version old when it trains; use "
            "rollout.max_staleness >= 1, or algo.over_sampling.on_abort=drop",
        ),
        (  # split sync and one_step_off take it (tests/e2e/test_split_runs.py), async does not
            [OS, "parallel.nproc=3", "parallel.rollout_ranks=1", "rollout.mode=async"],
            f"{OS_KEY}: is not built for rollout.mode=async: each round is the buffer's next request, "
            "generated to the end (docs/sampling.md 6); use rollout.mode=sync or one_step_off",
        ),
        (  # split sync and one_step_off keep partials (tests/e2e/test_split_runs.py); one_step_off's
            # first round is generated ahead: its partials lag 2 when they train
            [OS, "parallel.nproc=3", "parallel.rollout_ranks=1", "rollout.mode=one_step_off"]
            + ["algo.over_sampling.on_abort=partial", "rollout.max_staleness=1"],
            "override 'rollout.max_staleness=1': config key 'rollout.max_staleness': 1 drops every partial "
            "rollout of a step's first round with rollout.mode=one_step_off: that round is generated ahead "
            "with the weights one update behind, so a response it leaves pending lags 2 versions when the "
            "next step trains it; use rollout.max_staleness >= 2",
        ),
        (
            [OS, "rollout.engine=vllm", "rollout.vllm.tensor_parallel=2"],
            f"{OS_KEY}: aborts vLLM's requests on engines of rollout.vllm.tensor_parallel=1 only (got 2): "
            "the aborted requests' route rows are read on the rank that runs them (docs/sampling.md 6)",
        ),
        (  # vLLM on rollout ranks aborts at TP=1 (tests/vllm/test_vllm_split.py), on a TP group never
            [OS, "parallel.nproc=4", "parallel.rollout_ranks=2", "rollout.engine=vllm"]
            + ["rollout.vllm.tensor_parallel=2"],
            f"{OS_KEY}: aborts vLLM's requests on engines of rollout.vllm.tensor_parallel=1 only (got 2): "
            "the aborted requests' route rows are read on the rank that runs them (docs/sampling.md 6)",
        ),
    ],
)
def test_over_sampling_keys(tmp_path, overrides, line):
    fails_with(tmp_path, line, "train", f"run_dir={tmp_path / 'run'}", *overrides)
    assert not (tmp_path / "run").exists()  # before any rank started
