"""The built-in engine's model: KV-cache decoding vs no-cache forward, vectorized MoE vs a per-token
reference, and strict weight ingest."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from moe_rl.config import ModelConfig
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.rollout.builtin_model import BuiltinMoEModel, KVCache, moe_forward
from moe_rl.types import SamplingParams
from moe_rl.weights.canonical import canonical_param_shapes, random_canonical_weights

PAD_ID = 0


def _left_padded_batch(
    seed: int, prompt_lens: list[int], num_decode: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """tokens_BS / valid_BS with prompts right-aligned at slot P, then num_decode shared slots."""
    gen = torch.Generator().manual_seed(seed)
    P = max(prompt_lens)
    seqs = [torch.randint(1, vocab, (p + num_decode,), generator=gen) for p in prompt_lens]
    tokens_BS = torch.full((len(seqs), P + num_decode), PAD_ID, dtype=torch.long)
    valid_BS = torch.zeros_like(tokens_BS, dtype=torch.bool)
    for b, (p, s) in enumerate(zip(prompt_lens, seqs)):
        tokens_BS[b, P - p :] = s
        valid_BS[b, P - p :] = True
    return tokens_BS, valid_BS, seqs


@pytest.mark.unit
def test_kv_cache_decode_matches_no_cache_forward(fp32_model: BuiltinMoEModel, cfg: ModelConfig) -> None:
    prompt_lens, num_decode = [5, 2, 7], 6
    tokens_BS, valid_BS, seqs = _left_padded_batch(0, prompt_lens, num_decode, cfg.vocab_size)
    B, S = tokens_BS.shape
    P = S - num_decode
    positions_BS = (valid_BS.long().cumsum(1) - 1).clamp(min=0)

    cache = KVCache.allocate(cfg, B, S, torch.float32, "cpu")
    pre = fp32_model.forward(tokens_BS[:, :P], positions_BS[:, :P], valid_BS[:, :P], cache)
    logits_parts, ids_parts = [pre.logits], [pre.expert_ids_BTLK]
    for j in range(P, S):
        out = fp32_model.forward(
            tokens_BS[:, j : j + 1], positions_BS[:, j : j + 1], valid_BS[:, : j + 1], cache
        )
        logits_parts.append(out.logits)
        ids_parts.append(out.expert_ids_BTLK)
    cached_logits_BSV = torch.cat(logits_parts, 1)
    cached_ids_BSLK = torch.cat(ids_parts, 1)
    assert cache.length == S

    # Same left-padded batch without a cache.
    full = fp32_model.forward(tokens_BS, positions_BS, valid_BS)
    torch.testing.assert_close(cached_logits_BSV[valid_BS], full.logits[valid_BS], atol=1e-5, rtol=0)
    assert torch.equal(cached_ids_BSLK[valid_BS], full.expert_ids_BTLK[valid_BS])

    # And every sequence alone, unpadded (what the learner sees).
    for b, seq in enumerate(seqs):
        T = seq.shape[0]
        alone = fp32_model.forward(seq[None], torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool))
        torch.testing.assert_close(cached_logits_BSV[b][valid_BS[b]], alone.logits[0], atol=1e-5, rtol=0)
        assert torch.equal(cached_ids_BSLK[b][valid_BS[b]], alone.expert_ids_BTLK[0])


@pytest.mark.unit
def test_right_padded_no_cache_forward_ignores_pads(fp32_model: BuiltinMoEModel, cfg: ModelConfig) -> None:
    """The learner's layout (right padding) gives the same logits on real tokens."""
    gen = torch.Generator().manual_seed(1)
    lens = [9, 4, 12]
    S = max(lens)
    tokens_BS = torch.randint(1, cfg.vocab_size, (3, S), generator=gen)
    valid_BS = torch.arange(S)[None] < torch.tensor(lens)[:, None]
    tokens_BS[~valid_BS] = PAD_ID
    out = fp32_model.forward(tokens_BS, torch.arange(S).expand(3, S), valid_BS)
    for b, T in enumerate(lens):
        alone = fp32_model.forward(
            tokens_BS[b : b + 1, :T], torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool)
        )
        torch.testing.assert_close(out.logits[b, :T], alone.logits[0], atol=1e-5, rtol=0)
        assert torch.equal(out.expert_ids_BTLK[b, :T], alone.expert_ids_BTLK[0])


def _moe_reference(
    x_TH: torch.Tensor,
    router_EH: torch.Tensor,
    w_gate_EFH: torch.Tensor,
    w_up_EFH: torch.Tensor,
    w_down_EHF: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loop: top-k over logits, softmax over the k logits, weighted expert sum."""
    ys, ids = [], []
    for x_H in x_TH:
        logits_E = router_EH @ x_H
        vals_K, ids_K = torch.topk(logits_E, top_k)
        w_K = torch.softmax(vals_K, -1)
        y = sum(
            w * (w_down_EHF[e] @ (F.silu(w_gate_EFH[e] @ x_H) * (w_up_EFH[e] @ x_H)))
            for w, e in zip(w_K, ids_K.tolist())
        )
        ys.append(y)
        ids.append(ids_K)
    return torch.stack(ys), torch.stack(ids)


@pytest.mark.unit
def test_vectorized_moe_matches_per_token_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    T, H, Fm, E, K = 37, 16, 8, 6, 3
    x_TH = torch.randn(T, H, generator=gen)
    router = torch.randn(E, H, generator=gen)
    wg, wu = torch.randn(E, Fm, H, generator=gen), torch.randn(E, Fm, H, generator=gen)
    wd = torch.randn(E, H, Fm, generator=gen)
    y_TH, ids_TK = moe_forward(x_TH, router, wg, wu, wd, K)
    y_ref, ids_ref = _moe_reference(x_TH, router, wg, wu, wd, K)
    assert torch.equal(ids_TK, ids_ref)
    torch.testing.assert_close(y_TH, y_ref, atol=1e-4, rtol=1e-5)


@pytest.mark.unit
def test_canonical_shapes_follow_config(make_cfg: Callable[..., ModelConfig]) -> None:
    cfg = make_cfg(qk_layernorm=False, first_k_dense=0, num_layers=2)
    shapes = canonical_param_shapes(cfg)
    assert not any("q_norm" in k or "k_norm" in k for k in shapes)
    assert shapes["model.layers.0.mlp.gate.weight"] == (8, 64)
    assert shapes["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert len(shapes) == 3 + 2 * (6 + 1 + 3 * 8)  # embed, norm, lm_head; attn+norms, router, experts
    with pytest.raises(ValueError, match="vocab_size"):
        canonical_param_shapes(make_cfg(vocab_size=0))


@pytest.mark.unit
def test_qk_layernorm_off_runs(cfg: ModelConfig, make_cfg: Callable[..., ModelConfig]) -> None:
    cfg_off = make_cfg(qk_layernorm=False)
    model = BuiltinMoEModel(cfg_off, torch.float32)
    model.load_canonical(random_canonical_weights(cfg_off, seed=3))
    out = model.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], torch.ones(1, 3, dtype=torch.bool))
    assert out.logits.shape == (1, 3, cfg.vocab_size) and torch.isfinite(out.logits).all()


@pytest.mark.unit
def test_load_weights_rejects_missing_unexpected_and_misshaped(
    cfg: ModelConfig, weights: dict[str, torch.Tensor]
) -> None:
    engine = BuiltinEngine(cfg, dtype="fp32", pad_id=PAD_ID)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"

    missing = {k: v for k, v in weights.items() if k != name}
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        engine.load_weights(missing)

    extra = dict(weights, **{"model.layers.0.mlp.gate.weight": torch.zeros(8, 64)})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.gate.weight'"):
        engine.load_weights(extra)

    bad_name = "model.layers.1.self_attn.k_proj.weight"
    misshaped = dict(weights, **{bad_name: torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=rf"'{bad_name}' has shape \(64, 64\), expected \(32, 64\)"):
        engine.load_weights(misshaped)

    # Nothing was half-loaded by the failed attempts.
    assert not engine.model.loaded
    with pytest.raises(RuntimeError, match="no weights loaded"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2), seed=0)


def _layer_chunks(weights: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The learner's stream layout: the embedding, one chunk per decoder layer, then the rest."""

    def chunk_of(name: str) -> int:
        return (
            int(name.split(".")[2]) + 1
            if name.startswith("model.layers.")
            else (0 if "embed" in name else 10**6)
        )

    chunks: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in weights.items():
        chunks.setdefault(chunk_of(name), {})[name] = t
    return [chunks[k] for k in sorted(chunks)]


@pytest.mark.unit
def test_load_weights_streams_chunks_into_the_engine_tensors_in_place(
    cfg: ModelConfig, weights: dict[str, torch.Tensor]
) -> None:
    engine = BuiltinEngine(cfg, dtype="fp32", pad_id=PAD_ID)
    engine.load_weights(random_canonical_weights(cfg, seed=5))
    ptrs = {k: t.data_ptr() for k, t in engine.model.w.items()}
    pulled: list[int] = []

    def stream():  # a generator, as the learner's: each chunk is built only when asked for
        for i, chunk in enumerate(_layer_chunks(weights)):
            pulled.append(i)
            yield chunk

    engine.load_weights(stream())
    assert pulled == list(range(cfg.num_layers + 2)) and engine.model.loaded
    assert {k: t.data_ptr() for k, t in engine.model.w.items()} == ptrs  # copied in place
    assert all(torch.equal(engine.model._slots[k], weights[k]) for k in weights)
    p = "model.layers.2.mlp.experts."
    assert torch.equal(engine.model.w[p + "down_proj"][5], weights[p + "5.down_proj.weight"])
    # the same engine fed one dict and fed the stream generates the same tokens
    ref = BuiltinEngine(cfg, dtype="fp32", pad_id=PAD_ID)
    ref.load_weights(weights)
    sampling = SamplingParams(max_new_tokens=5)
    a, b = (e.generate([[1, 2, 3]], 2, sampling, seed=3) for e in (engine, ref))
    assert torch.equal(a.tokens_BS, b.tokens_BS) and torch.equal(a.logprobs_BS, b.logprobs_BS)


@pytest.mark.unit
def test_a_streamed_load_is_strict_across_chunks(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    engine = BuiltinEngine(cfg, dtype="fp32", pad_id=PAD_ID)
    chunks = _layer_chunks(weights)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    missing = [{k: v for k, v in c.items() if k != name} for c in chunks]
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        engine.load_weights(iter(missing))
    assert not engine.model.loaded  # copying had begun: no half-synced weights are served
    with pytest.raises(RuntimeError, match="no weights loaded"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2), seed=0)
    twice = [*chunks[:3], {name: weights[name]}, *chunks[3:]]
    with pytest.raises(ValueError, match=f"tensor '{name}' given twice"):
        engine.load_weights(iter(twice))
    bad = "model.layers.1.self_attn.k_proj.weight"
    misshaped = [dict(c, **{bad: torch.zeros(64, 64)}) if bad in c else c for c in chunks]
    with pytest.raises(ValueError, match=rf"'{bad}' has shape \(64, 64\), expected \(32, 64\)"):
        engine.load_weights(iter(misshaped))
    engine.load_weights(iter(chunks))  # a complete stream afterwards makes it usable again
    assert engine.model.loaded and all(torch.equal(engine.model._slots[k], weights[k]) for k in weights)
