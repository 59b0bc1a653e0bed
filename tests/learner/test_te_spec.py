"""Transformer Engine glue on CPU: precision -> megatron fields, environment refusals, TE <-> local
parameter names (lists written down from megatron-core 0.16.1's TE and local specs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from packaging.version import Version

from moe_rl.config import ConfigError, ModelConfig, load_config
from moe_rl.learner import te_spec
from moe_rl.preflight import check_launch
from moe_rl.weights.canonical import canonical_param_shapes
from moe_rl.weights.megatron_shards import megatron_to_canonical
from tests.models import DEFAULT_WIDTH_L3 as CFG

ATTENTION = ("linear_qkv.weight", "linear_proj.weight", "q_layernorm.weight", "k_layernorm.weight")


def _names(cfg: ModelConfig, layer: Callable[[int], list[str]]) -> list[str]:
    """The model's parameter names: embedding, final norm, output layer, then ``layer(i)``'s
    names under ``decoder.layers.{i}.`` for each layer."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(cfg.num_layers):
        names += [f"decoder.layers.{i}.{s}" for s in layer(i)]
    return names


def _local_names(cfg: ModelConfig) -> list[str]:
    """Parameter names of megatron's local-spec GPTModel (what weights/megatron_shards.py maps)."""

    def layer(i: int) -> list[str]:
        names = [
            "input_layernorm.weight",
            *(f"self_attention.{s}" for s in ATTENTION),
            "pre_mlp_layernorm.weight",
        ]
        if i < cfg.first_k_dense:
            return names + ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        experts = range(cfg.num_experts)
        return (
            names
            + ["mlp.router.weight"]
            + [f"mlp.experts.local_experts.{j}.linear_fc{k}.weight" for j in experts for k in (1, 2)]
        )

    return _names(cfg, layer)


def _te_names(cfg: ModelConfig) -> list[str]:
    """The same model on the TE spec with moe_grouped_gemm (TELayerNormColumnParallelLinear fuses
    the input norm into linear_qkv and, on dense layers, the pre-MLP norm into linear_fc1)."""

    def layer(i: int) -> list[str]:
        names = ["self_attention.linear_qkv.layer_norm_weight", *(f"self_attention.{s}" for s in ATTENTION)]
        if i < cfg.first_k_dense:
            return names + [
                "mlp.linear_fc1.layer_norm_weight",
                "mlp.linear_fc1.weight",
                "mlp.linear_fc2.weight",
            ]
        experts = range(cfg.num_experts)
        return (
            names
            + ["pre_mlp_layernorm.weight", "mlp.router.weight"]
            + [f"mlp.experts.linear_fc{k}.weight{j}" for j in experts for k in (1, 2)]
        )

    return _names(cfg, layer)


def _local_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, D, F, Fm = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size, cfg.moe_ffn_hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * D
    by_suffix = {
        "input_layernorm.weight": (H,),
        "self_attention.linear_qkv.weight": (qkv, H),
        "self_attention.linear_proj.weight": (H, cfg.num_attention_heads * D),
        "self_attention.q_layernorm.weight": (D,),
        "self_attention.k_layernorm.weight": (D,),
        "pre_mlp_layernorm.weight": (H,),
        "mlp.linear_fc1.weight": (2 * F, H),
        "mlp.linear_fc2.weight": (H, F),
        "mlp.router.weight": (cfg.num_experts, H),
    }
    out = {}
    for n in _local_names(cfg):
        if n.startswith(("embedding", "output")):
            out[n] = (cfg.vocab_size, H)
        elif n == "decoder.final_layernorm.weight":
            out[n] = (H,)
        elif "local_experts" in n:
            out[n] = (2 * Fm, H) if n.endswith("linear_fc1.weight") else (H, Fm)
        else:
            out[n] = by_suffix[n.split(".", 3)[3]]
    return out


@pytest.mark.unit
def test_te_names_map_one_to_one_onto_local_names():
    m = te_spec.te_name_map(_te_names(CFG))
    assert sorted(m.values()) == sorted(_local_names(CFG))
    assert (
        m["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] == "decoder.layers.0.pre_mlp_layernorm.weight"
    )
    assert (
        m["decoder.layers.2.mlp.experts.linear_fc2.weight3"]
        == "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    assert m["decoder.layers.1.pre_mlp_layernorm.weight"] == "decoder.layers.1.pre_mlp_layernorm.weight"


@pytest.mark.unit
def test_te_model_reaches_canonical_names_through_the_local_mapping():
    shapes = _local_shapes(CFG)
    inverse = {v: k for k, v in te_spec.te_name_map(_te_names(CFG)).items()}
    te_named = {inverse[n]: torch.zeros(s) for n, s in shapes.items()}
    canon = megatron_to_canonical(te_spec.rename_to_local(te_named), CFG, 0, 1)
    expect = canonical_param_shapes(CFG)
    assert {k: tuple(v.shape) for k, v in canon.items()} == expect


@pytest.mark.unit
@pytest.mark.parametrize(
    "name",
    ["decoder.layers.0.self_attention.linear_qkv.layer_norm_bias", "decoder.layers.1.mlp.experts.weight1"],
)
def test_unmappable_te_names_are_refused(name):
    with pytest.raises(KeyError, match="no local-spec counterpart"):
        te_spec.te_to_local_name(name)


@pytest.mark.unit
def test_precision_kwargs():
    local = te_spec.precision_kwargs(ModelConfig())
    assert local == {"moe_router_fusion": False}
    bf16 = te_spec.precision_kwargs(ModelConfig(transformer_impl="te", precision="bf16"))
    assert bf16["transformer_impl"] == "transformer_engine" and bf16["bf16"] and "fp8" not in bf16
    assert bf16["params_dtype"] == torch.bfloat16 and bf16["moe_grouped_gemm"]
    for recipe in ("delayed", "tensorwise", "blockwise"):
        kw = te_spec.precision_kwargs(ModelConfig(transformer_impl="te", precision="fp8", fp8_recipe=recipe))
        assert (kw["fp8"], kw["fp8_recipe"], kw["moe_router_fusion"]) == ("hybrid", recipe, False)


@pytest.mark.unit
def test_fp8_recipe_names_are_megatron_fp8recipe_values():
    from megatron.core.enums import Fp8Recipe

    assert set(te_spec.FP8_MIN_TE) <= {r.value for r in Fp8Recipe}


@pytest.mark.unit
def test_transformer_config_takes_the_precision_fields_and_never_fuses_the_router():
    from moe_rl.config import ParallelConfig
    from moe_rl.learner.build import transformer_config

    par = ParallelConfig(expert_parallel=1, nproc=1)
    tc = transformer_config(dataclasses.replace(CFG, precision="bf16"), par)
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.moe_router_fusion is False
    assert tc.fp8 is None and tc.moe_grouped_gemm is False
    tc32 = transformer_config(CFG, par)
    assert not tc32.bf16 and tc32.params_dtype == torch.float32 and tc32.moe_router_fusion is False


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.precision=fp8"], "model.transformer_impl=te"),
        (["model.fp8_recipe=mxfp8"], "'model.fp8_recipe'"),
        (["model.precision=fp16"], "'model.precision'"),
        (["model.transformer_impl=apex"], "'model.transformer_impl'"),
    ],
)
def test_static_precision_validation(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.transformer_impl=te", "model.precision=fp8"], "FP8 needs Hopper-class .* no CUDA device"),
        (["model.transformer_impl=te"], "'model.transformer_impl'.*no CUDA device"),
    ],
)
def test_launch_refuses_te_and_fp8_without_cuda(overrides, needle):
    cfg = load_config(None, overrides)  # loads (a GPU recipe must print anywhere) ...
    with pytest.raises(ConfigError, match=needle):
        check_launch(cfg)  # ... but does not start here
    check_launch(load_config(None, []))  # the CPU default passes


@pytest.mark.unit
def test_te_problems_on_a_gpu_machine():
    fp8 = ModelConfig(transformer_impl="te", precision="fp8", fp8_recipe="blockwise")
    ok = {
        "cuda": True,
        "capability": (9, 0),
        "cuda_version": "12.9",
        "te_ver": Version("2.9.0"),
        "te_error": None,
    }
    assert te_spec.te_problems(fp8, **ok) == []
    old = te_spec.te_problems(fp8, **{**ok, "te_ver": Version("2.2.0"), "cuda_version": "12.4"})
    assert any("Transformer Engine >= 2.3.0.dev0" in p for p in old) and any("CUDA >= 12.9" in p for p in old)
    ampere = te_spec.te_problems(fp8, **{**ok, "capability": (8, 0)})
    assert ampere and "compute capability" in ampere[0]
    broken = te_spec.te_problems(fp8, **{**ok, "te_error": "RuntimeError: empty meta package"})
    assert "does not import" in broken[0]


@pytest.mark.unit
def test_micro_batches_are_padded_to_the_fp8_token_multiple():
    from moe_rl.learner.te_spec import FP8_TOKEN_MULTIPLE
    from moe_rl.types import TrainBatch

    seq_lens_B = torch.tensor([5, 7, 3, 9, 2])
    tokens_BS = torch.arange(5 * 9).view(5, 9) + 1
    batch = TrainBatch(
        tokens_BS, seq_lens_B, loss_mask_BS=torch.ones(5, 9), safe_BSV=torch.ones(5, 9, 4, dtype=torch.bool)
    )
    plain = batch.micro_batches(2)
    padded = batch.micro_batches(2, FP8_TOKEN_MULTIPLE)
    assert [mb.tokens_BS.shape for mb in plain] == [(2, 7), (2, 9), (1, 2)]
    # B * S rounded up to a multiple of 16: 2 x 8, 2 x 16, 1 x 16
    assert [tuple(mb.tokens_BS.shape) for mb in padded] == [(2, 8), (2, 16), (1, 16)]
    for p, q in zip(plain, padded):
        s = p.tokens_BS.shape[1]
        assert torch.equal(q.tokens_BS[:, :s], p.tokens_BS) and q.tokens_BS[:, s:].eq(0).all()
        assert q.loss_mask_BS[:, s:].eq(0).all() and q.safe_BSV.shape[1] == q.tokens_BS.shape[1]
        assert torch.equal(q.seq_lens_B, p.seq_lens_B)
