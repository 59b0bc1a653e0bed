"""The vLLM engine's pure parts on CPU, against fakes in vLLM 0.33's documented output format
(gpu_stack.md 1.2-1.4): RequestOutput / CompletionOutput / Logprob with the documented attribute
names, routed_experts [P + G - 1, all decoder layers, K] uint8 with dense-layer rows zero.

The strongest check: a real built-in engine rollout, re-encoded the way vLLM would return it, comes
back through ``to_rollout_batch`` identical (tokens, masks, log-probs, route records)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl.rollout import vllm_engine as ve
from moe_rl.rollout.builtin_model import canonical_param_shapes
from moe_rl.routing.record import RouteError, RouteHeader
from moe_rl.types import SamplingParams

PAD_ID = 0


@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput (fields used + the documented neighbours)
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: np.ndarray | None = None


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool = True


def as_vllm(batch, cfg, b: int) -> RequestOutput:
    """Sample b of a RolloutBatch as vLLM returns it: routes over ALL decoder layers (dense rows
    zero), uint8 since E <= 256; the sampled token's log-prob in a one-entry dict per position."""
    P, G = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
    toks = batch.tokens_BS[b, :P + G].tolist()
    routes_TLK = batch.routes[b].numpy()
    all_TAK = np.zeros((P + G - 1, cfg.num_layers, cfg.moe_router_topk), dtype=np.uint8)
    all_TAK[:, cfg.moe_layers, :] = routes_TLK
    lps = [{toks[P + g]: Logprob(float(batch.logprobs_BS[b, P + g]), rank=1)} for g in range(G)]
    done = bool(batch.finished_B[b])
    return RequestOutput(str(b), None, toks[:P], None, [CompletionOutput(
        0, "", toks[P:], None, lps, "stop" if done else "length", toks[-1] if done else None, all_TAK)])


@pytest.fixture(scope="module")
def rollout(fp32_engine):
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(3,))
    return fp32_engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], 3, sp, seed=7)


@pytest.mark.unit
def test_vllm_outputs_round_trip_to_the_builtin_batch(rollout, cfg):
    outs = [as_vllm(rollout, cfg, b) for b in range(rollout.num_seqs)]
    got = ve.to_rollout_batch(outs, 3, PAD_ID, RouteHeader.for_model(cfg))
    for f in ("tokens_BS", "prompt_lens_B", "response_lens_B", "response_mask_BS", "logprobs_BS",
              "group_B", "finished_B"):
        assert torch.equal(getattr(got, f), getattr(rollout, f)), f
    assert all(torch.equal(a, b) and a.dtype == torch.uint8 for a, b in zip(got.routes, rollout.routes))
    assert got.logprob_support == "full"


@pytest.mark.unit
def test_missing_routes_or_logprobs_name_the_sample(rollout, cfg):
    header = RouteHeader.for_model(cfg)
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[1].outputs[0].routed_experts = None
    with pytest.raises(RouteError, match="sample 1: vLLM returned no routed_experts"):
        ve.to_rollout_batch(outs, 3, PAD_ID, header)
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[2].outputs[0].routed_experts = outs[2].outputs[0].routed_experts[:-1]  # one row short
    with pytest.raises(RouteError, match="sample 2"):
        ve.to_rollout_batch(outs, 3, PAD_ID, header)
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[0].outputs[0].logprobs[1] = {99: Logprob(-1.0)}
    with pytest.raises(RouteError, match="sample 0, generated token 1"):
        ve.to_rollout_batch(outs, 3, PAD_ID, header)


@pytest.mark.unit
def test_build_requests_one_seeded_request_per_sample():
    sp = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=0, top_p=1.0, stop_token_ids=(2,))
    reqs = ve.build_requests([[4, 5], [6]], 3, sp, seed=11)
    assert [r[0]["prompt_token_ids"] for r in reqs] == [[4, 5]] * 3 + [[6]] * 3
    kws = [r[1] for r in reqs]
    assert all(k["n"] == 1 and k["logprobs"] == 0 and k["max_tokens"] == 5 and k["stop_token_ids"] == [2]
               for k in kws)
    assert "top_k" not in kws[0] and "top_p" not in kws[0]  # vLLM's defaults mean off
    assert len({k["seed"] for k in kws}) == 6
    assert [k["seed"] for k in kws] == [k["seed"] for _, k in ve.build_requests([[4, 5], [6]], 3, sp, 11)]
    with pytest.raises(ValueError, match="DVP"):
        ve.build_requests([[4]], 1, dataclasses.replace(sp, dvp_threshold=0.1), 0)


@pytest.mark.unit
@pytest.mark.parametrize("t, k, p, mode", [(0.7, 0, 1.0, "processed_logprobs"), (1.0, 0, 1.0, "processed_logprobs"),
                                           (1.0, 5, 0.9, "raw_logprobs"), (0.7, 5, 1.0, None)])
def test_logprobs_mode_matches_the_learner_support(t, k, p, mode):
    if mode is None:
        with pytest.raises(ValueError, match="vllm#42259"):
            ve.logprobs_mode(t, k, p)
    else:
        assert ve.logprobs_mode(t, k, p) == mode


VLLM = ["rollout.engine=vllm"]


@pytest.mark.unit
@pytest.mark.parametrize("overrides, needle", [
    (VLLM + ["rollout.temperature=0.8", "rollout.top_p=0.9"], "'rollout.top_p'"),
    (VLLM + ["rollout.router_noise=0.1"], "'rollout.router_noise'"),
    (VLLM + ["correction.dvp_threshold=0.01"], "'correction.dvp_threshold'"),
    (VLLM + ["correction.trm_max=0.05", "correction.trm_kl=exact"], "'correction.trm_kl'"),
    (VLLM + ["rollout.vllm.tensor_parallel=4"], "'rollout.vllm.tensor_parallel'"),
    (VLLM + ["rollout.vllm.gpu_memory_utilization=1.5"], "'rollout.vllm.gpu_memory_utilization'"),
    (["rollout.engine=sglang"], "'rollout.engine'"),
])
def test_vllm_config_refusals_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_vllm_refused_at_launch_without_cuda():
    from moe_rl.config import check_launch

    cfg = load_config(None, VLLM + ["routing.replay=r3"])  # loads anywhere
    with pytest.raises(ConfigError, match="vllm needs a CUDA GPU"):
        check_launch(cfg)


@pytest.mark.unit
def test_engine_kwargs(cfg):
    run = load_config(None, VLLM + ["rollout.vllm.sleep_level=2", "rollout.dtype=bf16"])
    kw = ve.engine_kwargs(run, "/m", external=True)
    assert kw["enable_return_routed_experts"] and kw["enable_prefix_caching"] and kw["enable_sleep_mode"]
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["skip_tokenizer_init"]
    assert (kw["dtype"], kw["logprobs_mode"], kw["max_model_len"]) == ("bfloat16", "processed_logprobs", 64)
    assert "distributed_executor_backend" not in ve.engine_kwargs(run, "/m", external=False)


@pytest.mark.unit
def test_sync_items_are_the_hf_names_in_model_order(cfg, weights):
    expected = list(canonical_param_shapes(cfg))
    items = ve.sync_items(dict(reversed(list(weights.items()))), expected)
    assert [k for k, _ in items] == expected
    assert all(t is weights[k] or torch.equal(t, weights[k]) for k, t in items)
    with pytest.raises(KeyError, match="missing"):
        ve.sync_items({k: v for k, v in weights.items() if "lm_head" not in k}, expected)
