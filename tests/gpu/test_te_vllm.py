"""GPU tier: Transformer Engine parity and vLLM rollouts with R3 routes (skipped without CUDA).

The pure parts they rely on (TE <-> local names, precision fields, vLLM request/output conversion)
are unit-tested on CPU in tests/learner/test_te_spec.py and tests/rollout/test_vllm_engine.py.
Run: pytest -m gpu tests/gpu (scripts/gpu_smoke.sh runs the training-loop version)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moe_rl.config import ModelConfig, ParallelConfig, load_config

TINY = ModelConfig(vocab_size=64, hidden_size=128, num_layers=3, first_k_dense=1, num_experts=8,
                   moe_router_topk=2, max_seq_len=64)


@pytest.fixture(scope="module")
def single_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
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
    from moe_rl.learner import setup
    from moe_rl.learner.te_spec import te_name_map

    par = ParallelConfig(nproc=1, expert_parallel=1, backend="nccl")
    local, _ = setup.build_model(dataclasses.replace(TINY, precision="bf16"), par)
    te, tcfg = setup.build_model(dataclasses.replace(TINY, transformer_impl="te", precision="bf16"), par)
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
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl.item() < 1e-2 and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
def test_vllm_generate_routes_pass_ingest(tmp_path):
    pytest.importorskip("vllm")
    from moe_rl.rl import rollout_routes
    from moe_rl.rollout.builtin_model import random_canonical_weights
    from moe_rl.rollout.vllm_engine import VllmEngine
    from moe_rl.routing.record import RouteHeader
    from moe_rl.types import SamplingParams

    cfg = load_config(None, ["rollout.engine=vllm", "routing.replay=r3", "parallel.nproc=1",
                             "parallel.expert_parallel=1", "rollout.vllm.enforce_eager=true",
                             "rollout.vllm.gpu_memory_utilization=0.3", f"rollout.vllm.model_dir={tmp_path}/m"])
    model = dataclasses.replace(cfg.model, vocab_size=TINY.vocab_size)
    weights = random_canonical_weights(model, seed=1)
    from moe_rl.hf_checkpoint import write_hf_checkpoint

    write_hf_checkpoint(tmp_path / "m", weights, model, dtype=torch.bfloat16)
    engine = VllmEngine(dataclasses.replace(cfg, model=model), model, pad_id=0)
    engine.load_weights(weights)
    batch = engine.generate([[5, 6, 7], [8, 9]], 4, SamplingParams(max_new_tokens=8, stop_token_ids=(3,)), seed=1)
    assert batch.num_seqs == 8 and torch.isfinite(batch.logprobs_BS).all()
    assert (batch.logprobs_BS[batch.response_mask_BS] <= 0).all()
    rollout_routes(batch, RouteHeader.for_model(model))  # strict ingest: shapes, ids, no all-zero layer
    again = engine.generate([[5, 6, 7], [8, 9]], 4, SamplingParams(max_new_tokens=8, stop_token_ids=(3,)), seed=1)
    assert torch.equal(again.tokens_BS, batch.tokens_BS)  # seeded per sample, after sleep/wake


@pytest.mark.gpu
def test_vllm_weight_transfer_versions_and_changes_the_policy(tmp_path):
    """rollout.vllm.weight_sync=transfer (the default): every sync is one versioned session of
    vLLM's weight-transfer API; new weights change the rollouts, the old ones bring them back."""
    pytest.importorskip("vllm")
    from moe_rl.hf_checkpoint import write_hf_checkpoint
    from moe_rl.rollout.builtin_model import random_canonical_weights
    from moe_rl.rollout.vllm_engine import VllmEngine
    from moe_rl.types import SamplingParams

    cfg = load_config(None, ["rollout.engine=vllm", "routing.replay=r3", "parallel.nproc=1",
                             "parallel.expert_parallel=1", "rollout.vllm.enforce_eager=true",
                             "rollout.vllm.gpu_memory_utilization=0.3", f"rollout.vllm.model_dir={tmp_path}/m"])
    assert cfg.rollout.vllm.weight_sync == "transfer"
    model = dataclasses.replace(cfg.model, vocab_size=TINY.vocab_size)
    w1, w2 = random_canonical_weights(model, seed=1), random_canonical_weights(model, seed=2)
    write_hf_checkpoint(tmp_path / "m", w2, model, dtype=torch.bfloat16)  # vLLM starts from w2
    w1, w2 = ({k: t.to("cuda", torch.bfloat16) for k, t in w.items()} for w in (w1, w2))  # as the learner holds them
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
    same = a.logprobs_BS.shape == b.logprobs_BS.shape and torch.allclose(a.logprobs_BS, b.logprobs_BS, atol=1e-2)
    assert not same  # the sync reached the model
