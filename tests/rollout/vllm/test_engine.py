"""moe_rl/rollout/vllm/engine.py without vllm: ``VllmEngine.load_weights`` through the GPU path's
weight-transfer API (``FakeTransferLLM``, our receiver run for real), a stream chunk by chunk, and
a broken stream that leaves no trusted version."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.rollout.vllm.engine import VllmEngine
from moe_rl.rollout.vllm.transfer import WeightVersions, layer_groups
from moe_rl.types import SamplingParams
from moe_rl.weights.canonical import canonical_param_shapes
from tests.rollout.vllm.fakes import VLLM, FakeTransferLLM


def _fake_engine(cfg) -> VllmEngine:
    engine = object.__new__(VllmEngine)  # no CUDA: skip __init__'s environment check
    engine.cfg = load_config(None, VLLM)
    engine.expected, engine.llm, engine.asleep = list(canonical_param_shapes(cfg)), FakeTransferLLM(), False
    engine.versions, engine.model_cfg = WeightVersions(), cfg
    engine.version, engine.cache_stale = 0, False  # the weight version tokens carry
    engine.untie, engine.vllm_model_cfg = False, cfg
    engine.cpu = False  # the GPU path (vllm 0.33's weight-transfer API)
    return engine


@pytest.mark.unit
def test_engine_load_weights_goes_through_the_transfer_api(cfg, weights):
    engine = _fake_engine(cfg)
    engine.load_weights(weights)
    n = len(layer_groups(engine.expected))
    assert engine.llm.calls == ["start"] + ["update"] * n + ["finish", "reset_prefix_cache"]
    assert engine.llm.loaded.keys() == weights.keys()
    assert engine.versions.current == "0"


class _CopyingModel:
    """A model that owns its parameters (NaN until loaded) and copies what ``load_weights`` gets
    into them after checking name, dtype and shape, as vLLM's default weight loader does."""

    def __init__(self, shapes: dict[str, tuple[torch.dtype, list[int]]]) -> None:
        self.params = {k: torch.full(shape, float("nan"), dtype=dt) for k, (dt, shape) in shapes.items()}

    def load_weights(self, weights) -> None:
        for name, t in weights:
            p = self.params[name]
            assert (t.dtype, t.shape) == (p.dtype, p.shape), name
            p.copy_(t)


def _decode_update_info(info: dict) -> list[tuple[str, torch.dtype, list[int], torch.Tensor]]:
    """The test's own reading of one payload, from vLLM 0.33's IPC metadata as its
    ``trainer_send_weights`` writes it (ipc_engine.py): parallel lists ``names``, ``dtype_names``
    (``str(dtype)`` without ``torch.``), ``shapes`` (``list(tensor.shape)``), plus our tensors."""
    assert set(info) == {"names", "dtype_names", "shapes", "tensors"}
    n = len(info["names"])
    assert [len(info[k]) for k in ("dtype_names", "shapes", "tensors")] == [n, n, n]
    out = []
    for name, dt, shape, t in zip(info["names"], info["dtype_names"], info["shapes"], info["tensors"]):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dt]
        assert (t.dtype, list(t.shape)) == (dtype, shape), name
        out.append((name, dtype, shape, t))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.unit
def test_the_gpu_receiver_leaves_the_sent_weights_bitwise_in_the_model(cfg, weights):
    """The GPU path end to end on its receiving side: the engine's stream through the transfer
    API into our registered backend's ``receive_weights`` and a model that owns its tensors. The
    check decodes the payloads itself and compares the model's bytes with the sent tensors, so a
    receiver that drops, reorders, casts or skips a tensor fails it (NaN is never equal)."""
    sent = {k: (t.to(torch.bfloat16) if i % 3 == 1 else t) for i, (k, t) in enumerate(weights.items())}
    model = _CopyingModel({k: (t.dtype, list(t.shape)) for k, t in sent.items()})
    engine = _fake_engine(cfg)
    engine.llm = FakeTransferLLM(model=model)
    engine.load_weights(_streamed(sent, []))
    decoded = [d for info in engine.llm.updates for d in _decode_update_info(info)]
    assert sorted(name for name, *_ in decoded) == sorted(sent)
    assert all((dt, shape) == (sent[k].dtype, list(sent[k].shape)) for k, dt, shape, _ in decoded)
    assert all(torch.equal(_bits(t), _bits(sent[k])) for k, *_, t in decoded)  # the wire carries them
    for k, t in sent.items():  # and the model now holds them, bit for bit, in its own storage
        assert model.params[k].data_ptr() != t.data_ptr()
        assert torch.equal(_bits(model.params[k]), _bits(t)), k
    assert engine.versions.current == engine.llm.get_weight_version() == "0"


def _streamed(weights, calls: list[str], drop: str | None = None):
    """The learner's stream (embedding, a chunk per layer, final norm + lm_head) as a generator
    that logs when each chunk is built; ``drop`` leaves a tensor out."""
    for group in layer_groups(list(weights)):
        calls.append("gather")
        yield {k: weights[k] for k in group if k != drop}


@pytest.mark.unit
def test_engine_load_weights_sends_a_stream_chunk_by_chunk(cfg, weights):
    engine = _fake_engine(cfg)
    engine.load_weights(_streamed(weights, engine.llm.calls))
    n = len(layer_groups(engine.expected))
    assert n == cfg.num_layers + 2
    # each chunk is sent before the next one is gathered: one chunk alive at a time
    assert engine.llm.calls == ["start"] + ["gather", "update"] * n + ["finish", "reset_prefix_cache"]
    assert [u["names"] for u in engine.llm.updates] == layer_groups(engine.expected)
    assert engine.llm.loaded.keys() == weights.keys()
    assert all(engine.llm.loaded[k].data_ptr() == weights[k].data_ptr() for k in weights)  # by reference
    assert engine.versions.current == "0"


@pytest.mark.unit
def test_a_broken_stream_closes_the_update_untrusted_and_names_the_tensor(cfg, weights):
    engine = _fake_engine(cfg)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(KeyError, match=f"missing \\['{name}'\\]"):
        engine.load_weights(_streamed(weights, engine.llm.calls, drop=name))
    assert engine.llm.calls[-1] == "finish" and not engine.llm.active  # closed, no version set
    assert (engine.versions.current, engine.llm.get_weight_version()) == (None, "default")
    with pytest.raises(RuntimeError, match="no weights loaded"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2), seed=0)

    groups = layer_groups(engine.expected)
    first = groups[1][0]  # a tensor of layer 0, sent again with layer 1
    chunks = [{k: weights[k] for k in g} for g in groups]
    chunks[2][first] = weights[first]
    engine.llm.updates.clear()
    with pytest.raises(KeyError, match=f"given twice \\['{first}'\\]"):
        engine.load_weights(iter(chunks))
    assert [u["names"] for u in engine.llm.updates] == groups[:2]  # refused before the chunk went out
    assert not engine.llm.active and engine.versions.current is None

    engine.load_weights(iter([{k: weights[k] for k in g} for g in groups]))  # the next complete sync
    assert engine.versions.current == engine.llm.get_weight_version() == "0"


@pytest.mark.unit
def test_ranks_that_ask_the_same_call_share_it():
    """``unique_calls``: an engine group of 4 ranks where ranks 0 and 1 (one learner dp rank's TP
    ranks) ask the same prompts and seed, rank 2 the same prompts with another seed, rank 3 what rank
    0 asked: 2 distinct calls, in first-asked order, and each rank's index into them."""
    from moe_rl.rollout.vllm.requests import unique_calls

    a, b = [[5, 6, 7], [8, 9]], [[10, 11]]
    calls, of_rank = unique_calls([(a, 3), ([list(p) for p in a], 3), (a, 4), (a, 3)])
    assert calls == [(a, 3), (a, 4)] and of_rank == [0, 0, 1, 0]
    calls, of_rank = unique_calls([(b, 1), (a, 1)])
    assert calls == [(b, 1), (a, 1)] and of_rank == [0, 1]
    calls, of_rank = unique_calls([(a, 1)])
    assert calls == [(a, 1)] and of_rank == [0]
    calls, of_rank = unique_calls([(a, 1, 0), (a, 1, 4), (a, 1, 0)])  # two shares of one call
    assert calls == [(a, 1, 0), (a, 1, 4)] and of_rank == [0, 1, 0]


@pytest.mark.unit
def test_calls_several_engines_ask_are_shared_out_by_layout():
    """``engine_shares`` / ``rank_share`` on the recipes' layouts (megatron's rank order: TP
    innermost, PP outermost; engines of consecutive ranks). DeepSeek-V3-like (8 ranks: TP 2 x PP 4,
    DP 1, engines of 4): one call from both engines, halves; rank 4 sends engine 1's, rank 5 does
    not. Kimi-K2-like (TP 1, DP 2, PP 4, engines of 2, each one stage): each dp rank's call from all
    4 engines, quarters. Qwen3-like (learner TP 2 under engines of 8): every call one engine's."""
    from moe_rl.rollout.vllm.tp_routes import call_digest, engine_shares, rank_share

    x, y = call_digest([[5, 6]], 1), call_digest([[5, 6]], 2)
    assert x == call_digest([(5, 6)], 1) and x != y and x != call_digest([[5, 7]], 1)
    engine_R = [r // 4 for r in range(8)]
    shared = engine_shares([x] * 8, engine_R)
    assert shared == [(tuple(range(8)), [0, 1])]
    assert [rank_share(shared, engine_R, r)[1:] for r in (0, 3, 4, 5)] == [
        (0, 2, True),
        (0, 2, False),
        (1, 2, True),
        (1, 2, False),
    ]
    engine_R = [r // 2 for r in range(8)]
    shared = engine_shares([x, y] * 4, engine_R)  # rank = dp + 2 * pp
    assert shared == [((0, 2, 4, 6), [0, 1, 2, 3]), ((1, 3, 5, 7), [0, 1, 2, 3])]
    assert rank_share(shared, engine_R, 3) == ((1, 3, 5, 7), 1, 4, True)
    engine_R = [r // 8 for r in range(16)]
    digests = [call_digest([[d]], 0) for d in range(8) for _ in range(2)]  # DP 8 x TP 2
    assert engine_shares(digests, engine_R) == [] and rank_share([], engine_R, 5) is None


@pytest.mark.unit
def test_a_share_of_a_call_keeps_each_samples_seed():
    """``share_bounds`` cuts a call's prompts into contiguous shares differing by at most one;
    the requests of a share (``build_requests(..., first=)``) are the whole call's requests at
    those samples, seeds included."""
    from moe_rl.rollout.vllm.requests import build_requests, share_bounds

    assert [share_bounds(7, k, 3) for k in range(3)] == [(0, 2), (2, 4), (4, 7)]
    assert [share_bounds(2, k, 4) for k in range(4)] == [(0, 0), (0, 1), (1, 1), (1, 2)]
    prompts, n = [[5 + u, 6] for u in range(5)], 3
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=())
    whole = build_requests(prompts, n, sp, seed=11)
    parts = []
    for k in range(2):
        lo, hi = share_bounds(len(prompts), k, 2)
        parts += build_requests(prompts[lo:hi], n, sp, seed=11, first=lo * n)
    assert parts == whole and len({kw["seed"] for _, kw in whole}) == len(prompts) * n
