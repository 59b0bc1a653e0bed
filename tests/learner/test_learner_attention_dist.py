"""dist tier: the megatron learner's attention variants (issue 25) over 2 gloo ranks, against the
built-in engine (which tests/rollout/test_attention_variants.py pins to transformers) on the same
canonical weights: multi-latent attention with YaRN (DeepSeek-V3 shape, q_lora_rank > 0 and 0) and
GLM-4.5's partial rotary with q/k/v biases.

Checked per config: canonical -> megatron -> canonical bitwise (EP=2, and TP=2 where the shards of
every new tensor are really split); learner logits equal the engine's (fp32, 1e-5) at EP=2 and
TP=2; EP=2 log-probs and gradients equal EP=1's. One spawn of 2 ranks runs every check."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from moe_rl.types import TrainBatch
from tests.dist_harness import run_ranks
from tests.models import ODD_MLA_YARN, TINY_MOE_L3

LOGITS_TOL = 1e-5
GRAD_RTOL = 1e-5

CONFIGS = {
    "mla_yarn": dict(ODD_MLA_YARN, rope_original_max_position=8),
    "mla_direct_q": dict(
        kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12
    ),
    "glm_partial_bias": dict(partial_rotary_factor=0.5, attention_bias=True, qk_layernorm=False),
}


def _model(name: str):
    import dataclasses

    return dataclasses.replace(TINY_MOE_L3, norm_eps=1e-6, **CONFIGS[name])


def _data(rank: int, vocab: int):
    g = torch.Generator().manual_seed(300)  # the same on every rank: TP ranks must share their data
    lens_B = torch.tensor([14, 9, 12, 5])
    pos_S = torch.arange(14)
    valid_BS = pos_S[None] < lens_B[:, None]
    tokens_BS = torch.where(valid_BS, torch.randint(3, vocab, (4, 14), generator=g), 0)
    mask_BS = (pos_S[None] >= 3) & valid_BS
    return tokens_BS, lens_B, valid_BS, mask_BS


def _nll(mb, st, normalizer):
    return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}


def _check(name: str, learner, rank: int, weights, engine_logits) -> dict:
    """Round trip, logits vs the engine, log-probs and canonical gradients of this layout."""
    cfg = _model(name)
    exported = learner.export_canonical()
    tokens_BS, lens_B, valid_BS, mask_BS = _data(rank, cfg.vocab_size)
    with torch.no_grad():
        logits_BSV = learner.gpt(tokens_BS, torch.arange(14).expand_as(tokens_BS), None)
    if learner.dims.tp_size > 1:  # vocab-parallel output: gather the slices
        parts = [torch.empty_like(logits_BSV) for _ in range(learner.dims.tp_size)]
        torch.distributed.all_gather(parts, logits_BSV.contiguous(), group=learner.dims.tp_group)
        logits_BSV = torch.cat(parts, -1)
    logp_BS = learner.forward_logprobs(TrainBatch(tokens_BS, lens_B), 1.0, micro_batch_size=2).stats.logp_BS
    learner.forward_backward(TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS), _nll, 1.0, 2)
    return {
        "roundtrip_bitwise": sorted(exported) == sorted(weights)
        and all(torch.equal(exported[k], weights[k]) for k in weights),
        "engine_logits_diff": float((logits_BSV - engine_logits)[valid_BS].abs().max()),
        "logits_scale": float(engine_logits[valid_BS].abs().max()),
        "logp": logp_BS,
        "grads": learner.canonical_grads(),
    }


def _worker(rank: int):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.rollout.builtin_model import BuiltinMoEModel
    from moe_rl.weights.canonical import random_canonical_weights

    weights, engine_logits = {}, {}
    for name in CONFIGS:
        cfg = _model(name)
        weights[name] = random_canonical_weights(cfg, seed=11)
        model = BuiltinMoEModel(cfg, dtype=torch.float32)
        model.load_canonical(weights[name])
        tokens_BS, _, valid_BS, _ = _data(rank, cfg.vocab_size)
        engine_logits[name] = model.forward(tokens_BS, torch.arange(14).expand_as(tokens_BS), valid_BS).logits

    layouts = {
        "ep2": ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=False),
        "ep1": ParallelConfig(nproc=2, expert_parallel=1, distributed_optimizer=False),
        "tp2": ParallelConfig(nproc=2, tensor_parallel=2, expert_parallel=1, distributed_optimizer=False),
    }
    out: dict[str, dict] = {}
    ctx = dist.init_distributed(layouts["ep2"], seed=7)
    for layout, par in layouts.items():
        if layout != "ep2":
            ps.destroy_model_parallel()
            tp = par.tensor_parallel
            ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=par.expert_parallel)
            ctx = dist.ParallelDims.from_parallel_state()
        for name in CONFIGS:
            RouterReplay.clear_global_router_replay_instances()
            learner = Learner(_model(name), par, OptimConfig(lr=1e-2), ctx, weights[name])
            if layout == "tp2" and name == "mla_yarn":  # the new tensors really are split
                attn = learner.gpt.decoder.layers[1].self_attention
                out["tp2_shapes"] = {
                    "q_down": tuple(attn.linear_q_down_proj.weight.shape),
                    "kv_up": tuple(attn.linear_kv_up_proj.weight.shape),
                    "proj": tuple(attn.linear_proj.weight.shape),
                }
            if layout == "tp2" and name == "glm_partial_bias":
                out["tp2_qkv_bias"] = tuple(
                    learner.gpt.decoder.layers[1].self_attention.linear_qkv.bias.shape
                )
            out[f"{layout}/{name}"] = _check(name, learner, rank, weights[name], engine_logits[name])
    result = {"shapes": out.pop("tp2_shapes"), "qkv_bias": out.pop("tp2_qkv_bias")}
    for name in CONFIGS:
        ep2, ep1, tp2 = out[f"ep2/{name}"], out[f"ep1/{name}"], out[f"tp2/{name}"]
        result[name] = {
            "roundtrip": [ep2["roundtrip_bitwise"], tp2["roundtrip_bitwise"]],
            "engine_diff": [ep2["engine_logits_diff"], ep1["engine_logits_diff"], tp2["engine_logits_diff"]],
            "logits_scale": ep2["logits_scale"],
            "ep_logp_diff": float((ep2["logp"] - ep1["logp"]).abs().max()),
            "ep_grad_rel": max(
                float((ep2["grads"][k] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                for k, g in ep1["grads"].items()
            ),
            "attn_grad_keys": sorted(
                k for k in ep1["grads"] if ".self_attn." in k and k.startswith("model.layers.1.")
            ),
        }
    dist.shutdown()
    return result


@pytest.mark.dist
def test_attention_variants_learner_equals_engine_ep2_ep1_tp2():
    results = run_ranks(_worker, 2)
    for rank, r in enumerate(results):
        # TP=2 splits the column-parallel down/up projections and the row-parallel output
        assert r["shapes"] == {"q_down": (12, 64), "kv_up": (2 * 22, 20), "proj": (64, 2 * 10)}, r["shapes"]
        assert r["qkv_bias"] == ((4 + 2 * 2) * 16 // 2,), r["qkv_bias"]
        for name in CONFIGS:
            c = r[name]
            assert c["roundtrip"] == [True, True], (rank, name, c["roundtrip"])
            assert c["logits_scale"] > 0.5, (rank, name)
            assert max(c["engine_diff"]) < LOGITS_TOL, (rank, name, c["engine_diff"])
            assert c["ep_logp_diff"] < LOGITS_TOL, (rank, name, c["ep_logp_diff"])
            assert c["ep_grad_rel"] < GRAD_RTOL, (rank, name, c["ep_grad_rel"])
        mla = {
            f"model.layers.1.self_attn.{n}"
            for n in ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
        }
        assert mla <= set(r["mla_yarn"]["attn_grad_keys"]), r["mla_yarn"]["attn_grad_keys"]
        assert "model.layers.1.self_attn.q_proj.weight" in r["mla_direct_q"]["attn_grad_keys"]
        assert "model.layers.1.self_attn.k_proj.bias" in r["glm_partial_bias"]["attn_grad_keys"]
