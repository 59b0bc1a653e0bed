"""moe_rl/rollout/vllm/transfer.py: the weight sync's names and order, and vLLM's weight-transfer
API (vllm 0.33.0: vllm/entrypoints/rl/offline.py, vllm/distributed/weight_transfer/{base,ipc_engine}.py,
vllm/v1/worker/gpu_worker.py) driven through ``FakeTransferLLM`` into our receiver."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.rollout.vllm.env import VLLM_IGNORES_TIE
from moe_rl.rollout.vllm.transfer import (
    WeightVersions,
    layer_groups,
    received_weights,
    sync_chunks,
    sync_items,
    transfer_chunks,
    untied,
    update_info,
)
from moe_rl.weights.canonical import canonical_param_shapes
from tests.rollout.vllm.fakes import FakeTransferLLM


@pytest.mark.unit
def test_sync_items_are_the_hf_names_in_model_order(cfg, weights):
    expected = list(canonical_param_shapes(cfg))
    items = sync_items(dict(reversed(list(weights.items()))), expected)
    assert [k for k, _ in items] == expected
    assert all(t is weights[k] or torch.equal(t, weights[k]) for k, t in items)
    with pytest.raises(KeyError, match="missing"):
        sync_items({k: v for k, v in weights.items() if "lm_head" not in k}, expected)


def _many_layer_names(num_layers: int, num_experts: int) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.mlp.gate.weight"]
        names += [
            f"model.layers.{i}.mlp.experts.{e}.{p}.weight"
            for e in range(num_experts)
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
    return names + ["model.norm.weight", "lm_head.weight"]


@pytest.mark.unit
def test_layer_groups_every_tensor_once_experts_of_a_layer_together(cfg):
    names = list(canonical_param_shapes(cfg))
    groups = layer_groups(names)
    assert sorted(n for g in groups for n in g) == sorted(names) and sum(map(len, groups)) == len(names)
    assert groups[0] == ["model.embed_tokens.weight"] and groups[-1] == [
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert len(groups) == cfg.num_layers + 2
    for i, g in enumerate(groups[1:-1]):
        assert all(n.startswith(f"model.layers.{i}.") for n in g)
        assert g == [n for n in names if n.startswith(f"model.layers.{i}.")]  # model order kept
    for layer in cfg.moe_layers:
        experts = [n for n in names if n.startswith(f"model.layers.{layer}.mlp.experts.")]
        assert len(experts) == 3 * cfg.num_experts
        assert (
            sum(all(e in g for e in experts) and f"model.layers.{layer}.mlp.gate.weight" in g for g in groups)
            == 1
        )
    assert layer_groups(names) == groups  # deterministic


@pytest.mark.unit
def test_layer_groups_sort_layers_numerically_whatever_the_input_order():
    names = _many_layer_names(12, 3)
    expected = layer_groups(names)
    assert [g[0] for g in expected[1:-1]] == [f"model.layers.{i}.input_layernorm.weight" for i in range(12)]
    shuffled = (
        names[:1]
        + [
            n
            for i in (11, 2, 10, 0, 1, 3, 4, 5, 6, 7, 8, 9)
            for n in names
            if n.startswith(f"model.layers.{i}.")
        ]
        + names[-2:]
    )
    assert layer_groups(shuffled) == expected
    with pytest.raises(ValueError, match="duplicate"):
        layer_groups(names + ["model.layers.3.mlp.gate.weight"])


@pytest.mark.unit
def test_update_info_metadata_as_vllm_spells_it(cfg, weights):
    items = sync_items(weights, list(canonical_param_shapes(cfg)))
    items = [(k, t.to(torch.bfloat16) if i % 2 else t) for i, (k, t) in enumerate(items)]
    info = update_info(items)
    assert set(info) == {"names", "dtype_names", "shapes", "tensors"}  # IPC's metadata fields + the tensors
    assert info["names"] == [k for k, _ in items]
    assert info["dtype_names"][:2] == ["float32", "bfloat16"]
    assert all(
        getattr(torch, d) is t.dtype for d, (_, t) in zip(info["dtype_names"], items)
    )  # the receiver's mapping
    assert all(
        s == list(t.shape) and all(type(x) is int for x in s) for s, (_, t) in zip(info["shapes"], items)
    )
    assert all(a is b for a, (_, b) in zip(info["tensors"], items))  # by reference, no copy
    got = received_weights(info["names"], info["dtype_names"], info["shapes"], info["tensors"])
    assert [(k, id(t)) for k, t in got] == [(k, id(t)) for k, t in items]
    bad = dict(info, shapes=[[1]] + info["shapes"][1:])
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is float32"):
        received_weights(bad["names"], bad["dtype_names"], bad["shapes"], bad["tensors"])
    with pytest.raises(ValueError, match="dtype_names"):
        received_weights(info["names"], info["dtype_names"][:-1], info["shapes"], info["tensors"])


@pytest.mark.unit
def test_transfer_chunks_one_session_per_sync_a_layer_per_update(cfg, weights):
    expected = list(canonical_param_shapes(cfg))
    items = sync_items(weights, expected)
    llm, versions = FakeTransferLLM(), WeightVersions()
    assert versions.current is None
    transfer_chunks(llm, [items], versions)
    groups = layer_groups(expected)
    assert llm.calls == ["start"] + ["update"] * len(groups) + ["finish"]
    assert [u["names"] for u in llm.updates] == groups
    assert llm.loaded.keys() == weights.keys()
    assert all(llm.loaded[k].data_ptr() == weights[k].data_ptr() for k in weights)  # no copy on the way
    assert (versions.current, llm.get_weight_version()) == ("0", "0")
    transfer_chunks(llm, [items], versions)
    assert (versions.current, llm.get_weight_version(), versions.num_synced) == ("1", "1", 2)


@pytest.mark.unit
def test_a_failed_sync_leaves_no_trusted_version_and_the_next_one_retries_it(cfg, weights):
    items = sync_items(weights, list(canonical_param_shapes(cfg)))
    versions = WeightVersions()
    transfer_chunks(FakeTransferLLM(), [items], versions)
    with pytest.raises(RuntimeError, match="worker failed"):
        transfer_chunks(FakeTransferLLM(fail_on_update=1), [items], versions)
    assert (versions.current, versions.pending, versions.num_synced) == (None, None, 1)
    llm = FakeTransferLLM()
    transfer_chunks(llm, [items], versions)
    assert versions.current == llm.get_weight_version() == "1"
    with pytest.raises(RuntimeError, match="reports weight version 'default', expected '0'"):
        transfer_chunks(FakeTransferLLM(ignore_version=True), [items], WeightVersions())


@pytest.mark.unit
def test_weight_versions_bookkeeping():
    v = WeightVersions()
    with pytest.raises(RuntimeError, match="finish without begin"):
        v.finish("0")
    assert v.begin() == "0"
    with pytest.raises(RuntimeError, match="did not finish"):
        v.begin()
    v.finish("0")
    assert (v.current, v.begin()) == ("0", "1")
    assert v.current is None  # mid-sync: the engine serves a mix of old and new layers
    v.abort()
    assert v.begin() == "1"


@pytest.mark.unit
def test_weight_sync_uses_the_model_familys_own_names():
    from moe_rl.config import ModelConfig
    from moe_rl.weights.canonical import canonical_param_shapes, random_canonical_weights
    from moe_rl.weights.hf import hf_names

    cfg = dataclasses.replace(ModelConfig(vocab_size=50), hf_family="mixtral", qk_layernorm=False)
    weights = random_canonical_weights(cfg, seed=0)
    items = sync_items(weights, list(canonical_param_shapes(cfg)), hf_names(cfg))
    names = [k for k, _ in items]
    assert "model.layers.1.block_sparse_moe.experts.5.w3.weight" in names  # up_proj, Mixtral-style
    assert "model.layers.1.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names) and len(names) == len(weights)
    got = dict(items)
    assert torch.equal(
        got["model.layers.1.block_sparse_moe.experts.5.w1.weight"],
        weights["model.layers.1.mlp.experts.5.gate_proj.weight"],
    )


@pytest.mark.unit
def test_a_tied_model_streams_an_untied_copy_to_the_vllm_classes_that_never_tie():
    """vLLM 0.30's glm4_moe / deepseek_v2 classes load their own lm_head: a tied model's stream gains
    ``lm_head.weight`` (the embedding itself, no copy) in the chunk holding the embedding, and the
    stream is then complete for the untied names; other families and untied models pass unchanged."""
    from tests.models import glm4_moe_tiny

    tied = glm4_moe_tiny()
    assert tied.tie_word_embeddings and tied.hf_family in VLLM_IGNORES_TIE
    names = list(canonical_param_shapes(dataclasses.replace(tied, tie_word_embeddings=False)))
    assert "lm_head.weight" not in canonical_param_shapes(tied) and "lm_head.weight" in names
    embed = torch.randn(tied.vocab_size, tied.hidden_size)
    chunks = [
        {"model.embed_tokens.weight": embed},
        {k: torch.zeros(1) for k in names[1:] if k != "lm_head.weight"},
    ]
    streamed = [untied(c, True) for c in chunks]
    assert streamed[0]["lm_head.weight"] is embed and "lm_head.weight" not in streamed[1]
    sent = [name for chunk in sync_chunks(streamed, names) for name, _ in chunk]
    assert sorted(sent) == sorted(names)
    assert untied(chunks[0], False) is chunks[0]  # qwen2_moe / qwen3_moe / mixtral tie in vLLM
    with pytest.raises(KeyError, match="missing"):  # without the copy the sync would leave lm_head stale
        list(sync_chunks(chunks, names))
