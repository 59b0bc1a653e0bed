"""bad_input tier, issue 33: what the split loop (``parallel.rollout_ranks``, docs/design.md 15)
cannot run, each one ``error:`` line naming the key before any rank starts, the disk unchanged."""

from __future__ import annotations

import pytest

from moe_rl.config import load_run_config
from tests.cli_helpers import fails_with

SPLIT = ["parallel.nproc=4", "parallel.rollout_ranks=2"]


def _fails(tmp_path, line: str, *args: str) -> None:
    fails_with(tmp_path, line, "train", f"run_dir={tmp_path / 'run'}", *args)


@pytest.mark.bad_input
def test_a_learner_layout_that_does_not_fit_the_learner_ranks(tmp_path):
    _fails(
        tmp_path,
        "override 'parallel.expert_parallel=2': config key 'parallel.expert_parallel': expert_parallel x "
        "expert_tensor_parallel x pipeline_parallel = 2 x 1 x 1 does not divide the 3 learner ranks "
        "(parallel.nproc 4 - parallel.rollout_ranks 1)",
        "parallel.nproc=4",
        "parallel.rollout_ranks=1",
        "parallel.expert_parallel=2",
    )
    _fails(
        tmp_path,
        "override 'parallel.rollout_ranks=1': config key 'parallel.rollout_ranks': 3 learner ranks are "
        "not a multiple of tensor_parallel x pipeline_parallel = 2 x 1",
        "parallel.nproc=4",
        "parallel.rollout_ranks=1",
        "parallel.expert_parallel=1",
        "parallel.tensor_parallel=2",
    )


@pytest.mark.bad_input
def test_rollout_engines_that_do_not_serve_whole_data_parallel_ranks(tmp_path):
    # 2 learner ranks (EP 2: DP 2) and 3 engines: dp rank d goes to engine d % 3, engine 2 idles
    _fails(
        tmp_path,
        "override 'parallel.rollout_ranks=3': config key 'parallel.rollout_ranks': 3 rollout engine(s) do "
        "not split the 2 learner data-parallel ranks: each engine serves whole dp ranks (dp rank d: "
        "engine d % 3), so the engines must divide the learner's data-parallel size",
        "parallel.nproc=5",
        "parallel.rollout_ranks=3",
        "parallel.expert_parallel=2",
    )


@pytest.mark.bad_input
def test_vllm_tensor_parallel_must_divide_the_rollout_ranks(tmp_path):
    _fails(
        tmp_path,
        "override 'rollout.vllm.tensor_parallel=4': config key 'rollout.vllm.tensor_parallel': 4 does not "
        "divide parallel.rollout_ranks 2 (each engine spans consecutive ranks) (rollout.engine=vllm)",
        *SPLIT,
        "rollout.engine=vllm",
        "rollout.vllm.tensor_parallel=4",
    )


@pytest.mark.bad_input
def test_the_checked_sync_on_vllm_tp2_is_taken_colocated_and_on_rollout_ranks(tmp_path):
    """Both layouts check per shard (docs/vllm.md 11): the keys load colocated and split; a value
    that is no bool is refused by one line naming the key, as for any layout."""
    vllm_tp2 = ["rollout.engine=vllm", "rollout.vllm.tensor_parallel=2", "rollout.sync_check=true"]
    for layout in (["parallel.nproc=2"], SPLIT):
        cfg = load_run_config(None, [*layout, *vllm_tp2])
        assert (cfg.rollout.sync_check, cfg.rollout.vllm.tensor_parallel) == (True, 2)
        assert cfg.parallel.rollout_ranks == (2 if layout == SPLIT else 0)
    line = (  # a quoted "false" is text: refused, not read as false
        "override 'rollout.sync_check=\"false\"': config key 'rollout.sync_check': 'false' is str, not "
        "taken as typed (a boolean key takes true or false; nothing is coerced)"
    )
    _fails(tmp_path, line, "parallel.nproc=2", *vllm_tp2[:2], 'rollout.sync_check="false"')


@pytest.mark.bad_input
def test_settings_the_split_cannot_hold(tmp_path):
    _fails(
        tmp_path,
        "override 'rollout.inflight_kv=recompute': config key 'rollout.inflight_kv': recompute: vLLM's "
        "in-flight updates keep the running requests' KV cache (keep); the re-prefill is built for the "
        "built-in engine only (rollout.engine=vllm)",
        *SPLIT,
        "rollout.engine=vllm",
        "rollout.mode=async",
        "rollout.inflight_kv=recompute",
    )
    _fails(
        tmp_path,
        "override 'correction.bypass_loss=reinforce': config key 'correction.bypass_loss': reinforce has "
        "no ratio: it assumes samples from the current policy, and rollout.mode=async samples from "
        "an older one; use correction.bypass_loss=ppo_clip or correction.mode=decoupled",
        *SPLIT,
        "rollout.mode=async",
        "correction.mode=bypass",
        "correction.bypass_loss=reinforce",
    )
    _fails(
        tmp_path,
        "override 'rollout.max_staleness=-1': config key 'rollout.max_staleness': must be >= 0 (got -1)",
        *SPLIT,
        "rollout.mode=async",
        "rollout.max_staleness=-1",
    )
    _fails(
        tmp_path,
        "override 'correction.bypass_loss=reinforce': config key 'correction.bypass_loss': reinforce has "
        "no ratio: it assumes samples from the current policy, and rollout.mode=one_step_off samples from "
        "an older one; use correction.bypass_loss=ppo_clip or correction.mode=decoupled",
        *SPLIT,
        "rollout.mode=one_step_off",
        "correction.mode=bypass",
        "correction.bypass_loss=reinforce",
    )
    _fails(
        tmp_path,
        "override 'parallel.offload_during_rollout=true': config key 'parallel.offload_during_rollout': "
        "frees the device for a colocated engine; with parallel.rollout_ranks the learner ranks host none",
        *SPLIT,
        "parallel.offload_during_rollout=true",
    )
    _fails(
        tmp_path,
        "override 'log.val_every=2': config key 'log.val_every': validation runs on a colocated engine; "
        "with parallel.rollout_ranks set log.val_every=0",
        *SPLIT,
        "log.val_every=2",
        "task.val_dataset=val.jsonl",
    )
