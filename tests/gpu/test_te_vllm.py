"""GPU tier: Transformer Engine parity and vLLM rollouts with R3 routes (skipped without CUDA).

The pure parts they rely on (TE <-> local names, precision fields, vLLM request/output conversion)
are unit-tested on CPU in tests/learner/test_te_spec.py and tests/rollout/vllm/.
Run: pytest -m gpu tests/gpu (scripts/gpu_smoke.sh runs the training-loop version)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moe_rl.config import ParallelConfig, load_config
from tests.models import DEFAULT_WIDTH_L3

TINY = dataclasses.replace(DEFAULT_WIDTH_L3, vocab_size=64, num_experts=8)


@pytest.fixture(scope="module", autouse=True)
def torchrun_env():
    """Every test here runs as rank 0 of 1, as torchrun would start it: once a test has started
    torch.distributed, VllmEngine picks vLLM's external_launcher, whose executor reads RANK and
    LOCAL_RANK from the environment (vllm/v1/executor/uniproc_executor.py)."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def single_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    yield
    ps.destroy_model_parallel()


@pytest.mark.gpu
def test_te_bf16_forward_matches_local_spec(single_rank):
    pytest.importorskip("transformer_engine.pytorch")
    from moe_rl.learner import build
    from moe_rl.learner.te_spec import te_name_map

    par = ParallelConfig(nproc=1, expert_parallel=1, backend="nccl")
    local, _ = build.build_model(dataclasses.replace(TINY, precision="bf16"), par)
    te, tcfg = build.build_model(dataclasses.replace(TINY, transformer_impl="te", precision="bf16"), par)
    assert tcfg.moe_router_fusion is False and tcfg.transformer_impl == "transformer_engine"
    local_params = dict(local.named_parameters())
    with torch.no_grad():
        for te_name, local_name in te_name_map([n for n, _ in te.named_parameters()]).items():
            te.get_parameter(te_name).copy_(local_params[local_name])
    local.cuda().eval()
    te.cuda().eval()
    tokens = torch.randint(0, TINY.vocab_size, (4, 32), device="cuda")
    pos = torch.arange(32, device="cuda").expand_as(tokens)
    with torch.no_grad():
        a, b = local(tokens, pos, None).float(), te(tokens, pos, None).float()
    # bf16 kernels differ (fused norm+linear, grouped GEMM, flash attention): compare distributions
    kl = torch.nn.functional.kl_div(
        b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    assert kl.item() < 1e-2 and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
def test_vllm_generate_routes_pass_ingest(tmp_path):
    pytest.importorskip("vllm")
    from moe_rl.rollout.vllm.engine import VllmEngine
    from moe_rl.routing.record import RouteHeader
    from moe_rl.step.prepare import rollout_routes
    from moe_rl.types import SamplingParams
    from moe_rl.weights.canonical import random_canonical_weights

    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "routing.replay=r3",
            "parallel.nproc=1",
            "parallel.expert_parallel=1",
            "rollout.vllm.enforce_eager=true",
            "rollout.vllm.gpu_memory_utilization=0.3",
            f"rollout.vllm.model_dir={tmp_path}/m",
        ],
    )
    model = dataclasses.replace(cfg.model, vocab_size=TINY.vocab_size)
    weights = random_canonical_weights(model, seed=1)
    from moe_rl.weights.hf import write_hf_checkpoint

    write_hf_checkpoint(tmp_path / "m", weights, model, dtype=torch.bfloat16)
    engine = VllmEngine(dataclasses.replace(cfg, model=model), model, pad_id=0)
    engine.load_weights(weights)
    batch = engine.generate(
        [[5, 6, 7], [8, 9]], 4, SamplingParams(max_new_tokens=8, stop_token_ids=(3,)), seed=1
    )
    assert batch.num_seqs == 8 and torch.isfinite(batch.logprobs_BS).all()
    assert (batch.logprobs_BS[batch.response_mask_BS] <= 0).all()
    rollout_routes(batch, RouteHeader.for_model(model))  # strict ingest: shapes, ids, no all-zero layer
    engine.sleep()  # as the offload timeline's after_generate does; generate wakes what it needs
    again = engine.generate(
        [[5, 6, 7], [8, 9]], 4, SamplingParams(max_new_tokens=8, stop_token_ids=(3,)), seed=1
    )
    assert torch.equal(again.tokens_BS, batch.tokens_BS)  # seeded per sample, after sleep/wake


@pytest.mark.gpu
def test_vllm_weight_transfer_versions_and_changes_the_policy(tmp_path):
    """The weight-transfer API (the one sync): every sync is one versioned session of
    vLLM's weight-transfer API; new weights change the rollouts, the old ones bring them back."""
    pytest.importorskip("vllm")
    from moe_rl.rollout.vllm.engine import VllmEngine
    from moe_rl.types import SamplingParams
    from moe_rl.weights.canonical import random_canonical_weights
    from moe_rl.weights.hf import write_hf_checkpoint

    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "routing.replay=r3",
            "parallel.nproc=1",
            "parallel.expert_parallel=1",
            "rollout.vllm.enforce_eager=true",
            "rollout.vllm.gpu_memory_utilization=0.3",
            f"rollout.vllm.model_dir={tmp_path}/m",
        ],
    )
    model = dataclasses.replace(cfg.model, vocab_size=TINY.vocab_size)
    w1, w2 = random_canonical_weights(model, seed=1), random_canonical_weights(model, seed=2)
    write_hf_checkpoint(tmp_path / "m", w2, model, dtype=torch.bfloat16)  # vLLM starts from w2
    w1, w2 = (
        {k: t.to("cuda", torch.bfloat16) for k, t in w.items()} for w in (w1, w2)
    )  # as the learner holds them
    engine = VllmEngine(dataclasses.replace(cfg, model=model), model, pad_id=0)
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=(3,))

    def roll():
        return engine.generate([[5, 6, 7], [8, 9]], 4, sp, seed=1)

    engine.load_weights(w1)
    assert engine.versions.current == engine.llm.get_weight_version() == "0"
    a = roll()
    engine.load_weights(w2)
    assert engine.llm.get_weight_version() == "1"
    b = roll()
    engine.load_weights(w1)
    assert engine.llm.get_weight_version() == "2"
    c = roll()
    assert torch.equal(a.tokens_BS, c.tokens_BS) and torch.allclose(a.logprobs_BS, c.logprobs_BS, atol=1e-3)
    same = a.logprobs_BS.shape == b.logprobs_BS.shape and torch.allclose(
        a.logprobs_BS, b.logprobs_BS, atol=1e-2
    )
    assert not same  # the sync reached the model


@pytest.mark.gpu
@pytest.mark.parametrize("rule, threshold", [("relative", 0.05), ("top_p", 0.9)])
def test_vllm_dvp_safe_sets_match_the_learner_recomputation(tmp_path, rule, threshold):
    """DVP through vLLM's logits processor: every sampled token lies in its reported safe set,
    the reported log-prob is the safe-set log-prob the learner computes over that set
    (``restricted_logprobs``, fp32 recomputation of the same weights), and the learner's own safe
    set (``dvp_safe_mask`` on its logits) agrees with vLLM's at nearly every position (bf16 engine
    vs fp32 recomputation differ only at the cut)."""
    pytest.importorskip("vllm")
    from moe_rl.corrections.correction_specs import DvpSpec
    from moe_rl.corrections.dvp import restricted_logprobs
    from moe_rl.rollout.builtin_model import BuiltinMoEModel
    from moe_rl.rollout.vllm.dvp_processor import dvp_safe_mask
    from moe_rl.rollout.vllm.engine import VllmEngine
    from moe_rl.types import SamplingParams
    from moe_rl.weights.canonical import random_canonical_weights
    from moe_rl.weights.hf import write_hf_checkpoint

    T = 0.8
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "routing.replay=r3",
            "parallel.nproc=1",
            "parallel.expert_parallel=1",
            "rollout.vllm.enforce_eager=true",
            "rollout.vllm.gpu_memory_utilization=0.3",
            f"rollout.vllm.model_dir={tmp_path}/m",
            f"rollout.temperature={T}",
            f"correction.dvp_threshold={threshold}",
            f"correction.dvp_rule={rule}",
        ],
    )
    model = dataclasses.replace(cfg.model, vocab_size=TINY.vocab_size)
    weights = random_canonical_weights(model, seed=1)
    write_hf_checkpoint(tmp_path / "m", weights, model, dtype=torch.bfloat16)
    engine = VllmEngine(dataclasses.replace(cfg, model=model), model, pad_id=0)
    engine.load_weights(weights)
    sp = SamplingParams(
        max_new_tokens=8,
        temperature=T,
        stop_token_ids=(3,),
        dvp=DvpSpec(threshold, rule),
        return_dist=True,
    )
    batch = engine.generate([[5, 6, 7], [8, 9]], 4, sp, seed=1)
    mask_BS, safe_BSV = batch.response_mask_BS, batch.safe_BSV
    assert batch.logprob_support == sp.logprob_support and safe_BSV is not None
    assert safe_BSV.shape == (*batch.tokens_BS.shape, model.vocab_size) and not safe_BSV[~mask_BS].any()
    assert safe_BSV.gather(-1, batch.tokens_BS[..., None])[..., 0][mask_BS].all()  # sampled inside its set

    ref = BuiltinMoEModel(model, torch.float32, torch.device("cuda"))
    ref.load_canonical(weights)
    S = batch.tokens_BS.shape[1]
    tokens_BS = batch.tokens_BS.cuda()
    valid_BS = (
        torch.arange(S, device="cuda")[None] < (batch.prompt_lens_B + batch.response_lens_B).cuda()[:, None]
    )
    with torch.no_grad():
        logits_BSV = ref.forward(
            tokens_BS, torch.arange(S, device="cuda").expand_as(tokens_BS), valid_BS
        ).logits
    # position s predicts token s: the logits of s - 1
    pred_BSV = torch.cat([torch.zeros_like(logits_BSV[:, :1]), logits_BSV[:, :-1]], 1).float().cpu()
    learner = restricted_logprobs(pred_BSV / T, safe_BSV, batch.tokens_BS)
    torch.testing.assert_close(learner.logp_BS[mask_BS], batch.logprobs_BS[mask_BS], rtol=0, atol=0.1)
    mine_NV = dvp_safe_mask(pred_BSV[mask_BS], T, rule, threshold)
    same = (mine_NV == safe_BSV[mask_BS]).all(-1).float().mean().item()
    assert same >= 0.9, f"only {same:.2%} of positions have the same safe set in vLLM and the learner"
    assert (learner.log_safe_mass_BS[mask_BS] <= 1e-6).all()
