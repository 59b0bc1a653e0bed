"""moe_rl/rollout/vllm/sync_sums.py (the learner's side of the checked sync on vLLM, in vLLM's
layout; colocated TP ranks on the on-policy sliced stream and on ``rollout.staleness``'s whole
kept weight sets) and requests.route_provenance (the route rows' provenance from vLLM's outputs). The real
vLLM worker's side: tests/vllm/test_vllm_cpu_turns.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from moe_rl.rollout.vllm.requests import route_provenance
from moe_rl.rollout.vllm.sync_sums import VOCAB_PAD, VllmLayout, engine_name
from moe_rl.routing.provenance import COMPUTED, PREFIX_HIT
from moe_rl.weights.canonical import random_canonical_weights
from moe_rl.weights.checksum import as_ints, checksums
from moe_rl.weights.hf import hf_names
from tests.models import HF_FAMILY_TINY, hf_tiny

pytestmark = pytest.mark.unit

FAMILIES = {
    "qwen3_moe": lambda: hf_tiny(),
    "mixtral": lambda: hf_tiny(first_k_dense=0, qk_layernorm=False, hf_family="mixtral"),
    **HF_FAMILY_TINY,
}


def _chunks(w: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The learner's stream shape: one chunk per decoder layer, its experts split over two chunks."""
    by_layer: dict[str, list[dict]] = {}
    for k, t in w.items():
        layer = k.split(".")[2] if k.startswith("model.layers.") else k
        parts = by_layer.setdefault(layer, [{}, {}])
        parts[int(".experts.1." in k or ".experts.3." in k)][k] = t
    return [c for parts in by_layer.values() for c in parts if c]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_layout_fuses_every_tensor_once_as_vllm_loads_it(family):
    """Every canonical tensor lands in exactly one engine tensor (numels add up, the vocabulary
    padded to a multiple of 64 with zeros), whatever chunk its parts came in; fused q/k/v,
    gate/up and stacked experts hold their parts in vLLM's order."""
    cfg = FAMILIES[family]()
    w = random_canonical_weights(cfg, seed=2)
    conv = VllmLayout(cfg, torch.bfloat16)
    out: dict[str, torch.Tensor] = {}
    for c in _chunks(w):
        got = conv.feed(c)
        assert not set(got) & set(out)
        out.update(got)
    conv.finish()
    pad = sum(
        (-w[k].shape[0] % VOCAB_PAD) * w[k].shape[1]
        for k in ("model.embed_tokens.weight", "lm_head.weight")
        if k in w
    )
    assert sum(t.numel() for t in out.values()) == sum(t.numel() for t in w.values()) + pad
    assert all(
        t.dtype == (torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16)
        for n, t in out.items()
    )
    hf = {hf_names(cfg)[k]: t.to(torch.bfloat16) for k, t in w.items()}
    fused = [n for n in out if n.endswith("w13_weight")]
    assert len(fused) == sum(
        1 for k in hf if k.endswith(("experts.0.gate_proj.weight", "experts.0.w1.weight"))
    )
    for n in fused:
        p = n.removesuffix(".w13_weight")
        gate, up = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")
        for e in (0, cfg.num_experts - 1):
            assert torch.equal(
                out[n][e], torch.cat([hf[f"{p}.{e}.{gate}.weight"], hf[f"{p}.{e}.{up}.weight"]])
            )
    if not cfg.mla:
        q = "model.layers.0.self_attn."
        qkv = torch.cat([hf[q + "q_proj.weight"], hf[q + "k_proj.weight"], hf[q + "v_proj.weight"]])
        assert torch.equal(out[q + "qkv_proj.weight"], qkv)
    embed = out["model.embed_tokens.weight"]
    assert embed.shape[0] % VOCAB_PAD == 0 and not embed[cfg.vocab_size :].any()


def test_a_fused_tensor_missing_parts_is_named_and_worker_names_drop_routed_experts():
    cfg = hf_tiny()
    w = random_canonical_weights(cfg, seed=2)
    conv = VllmLayout(cfg, torch.bfloat16)
    conv.feed({k: t for k, t in w.items() if "layers.1.mlp.experts.2." not in k})
    with pytest.raises(
        KeyError, match=r"'model\.layers\.1\.mlp\.experts\.w13_weight' got 14 of its 16 parts"
    ):
        conv.finish()
    assert (
        engine_name("model.layers.3.mlp.experts.routed_experts.w2_weight")
        == "model.layers.3.mlp.experts.w2_weight"
    )
    untied = VllmLayout(dataclasses.replace(cfg, tie_word_embeddings=False), torch.float32, untie=True)
    got = untied.feed({"model.embed_tokens.weight": w["model.embed_tokens.weight"]})
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])


def test_a_tp_ranks_layout_is_its_slices_fused_as_its_vllm_parameters_hold_them():
    """TP=2 (vLLM on rollout ranks, each worker one shard): rank r's ``qkv_proj`` is its q, k and v
    slices (4 heads, 2 KV groups: one each), its ``w13_weight`` each expert's gate then up slice
    [E, 2F/2, H], ``o_proj`` and ``w2_weight`` the input-dim halves (the two ranks' side by side are
    the whole), norms and router whole on both; the vocabulary (40, padded to 64) splits 32 + 32:
    rank 1 holds rows 32-39 then 24 zero rows. Both ranks hold the same names."""
    from moe_rl.weights.engine_shard import EngineShard

    cfg = hf_tiny()
    w = random_canonical_weights(cfg, seed=2)
    out = []
    for r in (0, 1):
        conv = VllmLayout(cfg, torch.float32, shard=EngineShard(tp_size=2, tp_rank=r))
        out.append({k: t for c in _chunks(w) for k, t in conv.feed(c).items()})
        conv.finish()
    assert sorted(out[0]) == sorted(out[1]) == sorted(VllmLayout(cfg, torch.float32).feed(w))
    a = "model.layers.1.self_attn."
    q, k, v = (w[a + f"{x}_proj.weight"] for x in "qkv")
    for r in (0, 1):
        half = slice(r * q.shape[0] // 2, (r + 1) * q.shape[0] // 2)
        kv = slice(r * k.shape[0] // 2, (r + 1) * k.shape[0] // 2)
        assert torch.equal(out[r][a + "qkv_proj.weight"], torch.cat([q[half], k[kv], v[kv]]))
        m = "model.layers.1.mlp."
        F = w[m + "experts.3.gate_proj.weight"].shape[0] // 2
        f = slice(r * F, (r + 1) * F)
        gate, up = w[m + "experts.3.gate_proj.weight"], w[m + "experts.3.up_proj.weight"]
        assert torch.equal(out[r][m + "experts.w13_weight"][3], torch.cat([gate[f], up[f]]))
        assert torch.equal(out[r][m + "gate.weight"], w[m + "gate.weight"])
    for name in (a + "o_proj.weight", "model.layers.1.mlp.experts.w2_weight"):
        whole = VllmLayout(cfg, torch.float32).feed(w)[name]
        assert torch.equal(torch.cat([out[0][name], out[1][name]], dim=-1), whole)
    embed = [out[r]["model.embed_tokens.weight"] for r in (0, 1)]
    assert embed[0].shape[0] == embed[1].shape[0] == 32
    assert torch.equal(embed[1][:8], w["model.embed_tokens.weight"][32:]) and not embed[1][8:].any()


def test_a_colocated_tp_rank_sums_the_slices_it_hands_its_worker_as_the_split_root_sums_its_row():
    """Colocated vLLM TP=2 (``sync_check_for``, split False): rank r sums what ``load_slices`` hands
    its own worker (its slices ``placed`` in full-shape zero tensors) in TP rank r's layout, the
    same sums the split root computes for TP rank r's row from whole tensors; the two rows differ.
    A worker holding one tensor other than sent fails the check naming it and the shard."""
    from moe_rl.config import load_config
    from moe_rl.pipeline.sync_check import SyncCheckError
    from moe_rl.pipeline.weight_sync import sync_check_for
    from moe_rl.weights.engine_shard import engine_shard, engine_slice, placed

    keys = [
        "rollout.engine=vllm",
        "parallel.nproc=2",
        "rollout.vllm.tensor_parallel=2",
        "rollout.sync_check=true",
    ]
    cfg = load_config(None, [*keys, "rollout.dtype=fp32"])
    cfg = dataclasses.replace(cfg, model=hf_tiny())
    w = random_canonical_weights(cfg.model, seed=4)
    root = sync_check_for(cfg, True, 0)
    list(root.wrap(iter(_chunks(w))))
    rows = [root.sent_ints(r) for r in (0, 1)]
    assert sorted(rows[0]) == sorted(rows[1]) and rows[0] != rows[1]
    for r in (0, 1):
        check, shard = sync_check_for(cfg, False, r), engine_shard(cfg, r)
        list(check.wrap(placed(engine_slice(c, shard, cfg.model), shard, cfg.model) for c in _chunks(w)))
        assert check.sent_ints() == rows[r]
    held = dict(rows[1], **{"model.layers.1.self_attn.o_proj.weight": 7})
    with pytest.raises(SyncCheckError) as e:
        check.verify(SimpleNamespace(held_checksums=lambda: held), 3)
    assert str(e.value).startswith(
        "weight sync check failed at sync 3: engine tensor 'model.layers.1.self_attn.o_proj.weight' "
        f"(TP rank 1 of 2): checksum 7 != sent {rows[1]['model.layers.1.self_attn.o_proj.weight']} "
    )


def test_route_provenance_marks_cached_prompt_rows_and_stamps_each_rows_forward():
    """Prompt 6 tokens, 3 generated, 4 of the prompt a prefix-cache hit, rows from position 2 asked:
    rows 2-3 hits at the call's start version, rows 4-5 the prefill's (the first generated
    token's version), rows 6-7 generated tokens 7-8's; without versions, all at the start version."""
    out = SimpleNamespace(
        prompt_token_ids=[1, 2, 3, 4, 5, 6],
        num_cached_tokens=4,
        outputs=[SimpleNamespace(token_ids=[7, 8, 9], finish_reason="stop")],
    )
    version_BS = torch.tensor([[0, 0, 0, 0, 0, 0, 5, 6, 7]], dtype=torch.int32)
    (p,) = route_provenance([out], [2], version_BS, 4)
    assert p.source_N.tolist() == [PREFIX_HIT, PREFIX_HIT, COMPUTED, COMPUTED, COMPUTED, COMPUTED]
    assert p.version_N.tolist() == [4, 4, 5, 5, 6, 7] and p.turn_N.tolist() == [0] * 6
    (q,) = route_provenance([out], [5], None, 3)
    assert q.source_N.tolist() == [COMPUTED] * 3 and q.version_N.tolist() == [3, 3, 3]


def _tp_worker(w: dict[str, torch.Tensor], r: int, wrong: str = "") -> dict[str, torch.Tensor]:
    """What vLLM's TP rank ``r`` of 2 holds of the whole canonical tensors ``w`` (hf_tiny: q/k/v,
    gate/up split by rows, o_proj/down_proj by columns, the vocabulary padded to 64 and split by
    rows, the rest whole), in bf16, written out here from vLLM's loaders (not ``engine_slice`` or
    ``VllmLayout``); ``wrong``: a tensor narrowed to the other rank's columns (a loader's bug)."""
    w = {n: t.to(torch.bfloat16) for n, t in w.items()}
    rows = lambda n: w.pop(n).chunk(2, dim=0)[r]  # noqa: E731
    cols = lambda n: w.pop(n).chunk(2, dim=1)[1 - r if n == wrong else r]  # noqa: E731
    out = {}
    for v in ("model.embed_tokens.weight", "lm_head.weight"):
        t = w.pop(v)
        out[v] = torch.cat([t, t.new_zeros(VOCAB_PAD - t.shape[0], t.shape[1])]).chunk(2)[r]
    for L in range(3):
        a, m = f"model.layers.{L}.self_attn.", f"model.layers.{L}.mlp."
        out[a + "qkv_proj.weight"] = torch.cat([rows(a + f"{x}_proj.weight") for x in "qkv"])
        out[a + "o_proj.weight"] = cols(a + "o_proj.weight")
        if L == 0:  # the dense layer
            out[m + "gate_up_proj.weight"] = torch.cat(
                [rows(m + "gate_proj.weight"), rows(m + "up_proj.weight")]
            )
            out[m + "down_proj.weight"] = cols(m + "down_proj.weight")
            continue
        e = range(8)
        gate_up = [
            torch.cat([rows(f"{m}experts.{i}.gate_proj.weight"), rows(f"{m}experts.{i}.up_proj.weight")])
            for i in e
        ]
        out[m + "experts.w13_weight"] = torch.stack(gate_up)
        out[m + "experts.w2_weight"] = torch.stack([cols(f"{m}experts.{i}.down_proj.weight") for i in e])
    return {**out, **w}  # norms and routers whole


class _StaleLearner:
    """``export_canonical`` hands out whole tensors (W_u, the learner's weights after update u);
    the layer stream is the on-policy path, which ``rollout.staleness`` must not take."""

    def __init__(self) -> None:
        self.u = 0

    def export_canonical(self) -> dict[str, torch.Tensor]:
        return random_canonical_weights(hf_tiny(), seed=10 + self.u)

    def iter_canonical_layers(self, engines=None):
        raise AssertionError("rollout.staleness=k syncs the kept whole weight sets, not the layer stream")


class _TpWorker:
    """A colocated TP rank's engine: loads whole tensors (as vLLM's loaders, which narrow them to
    its shard, ``_tp_worker``) and reports its held checksums."""

    def __init__(self, r: int, wrong: str = "") -> None:
        self.r, self.wrong, self.got = r, wrong, {}

    def load_weights(self, weights) -> None:
        self.got = dict(weights)
        self.held = as_ints(checksums(_tp_worker(self.got, self.r, self.wrong)))

    def held_checksums(self) -> dict[str, int]:
        return self.held


def _stale_sync(r: int, engine) -> tuple:
    """Rank ``r`` of colocated vLLM TP=2 with ``rollout.staleness=1`` and the check on: its
    ``WeightSync`` as the trainer builds it (the ``SyncCheck`` from ``sync_check_for``), the learner
    (set ``u`` before each sync) and the check."""
    from moe_rl.config import load_config
    from moe_rl.config.schedule import Schedule
    from moe_rl.pipeline.simulated_staleness import SimulatedStaleness
    from moe_rl.pipeline.weight_sync import WeightSync, colocated_slices, sync_check_for

    keys = ["rollout.engine=vllm", "parallel.nproc=2", "rollout.vllm.tensor_parallel=2"]
    cfg = load_config(None, [*keys, "rollout.sync_check=true", "rollout.staleness=1"])
    cfg = dataclasses.replace(cfg, model=hf_tiny())
    learner, stale = _StaleLearner(), SimulatedStaleness(cfg.rollout.staleness)
    check = sync_check_for(cfg, False, r)
    sync = WeightSync(
        Schedule.from_config(cfg),
        engine,
        learner,
        stale,
        engines=colocated_slices(cfg),
        model=cfg.model,
        check=check,
    )
    return sync, learner, check


def test_colocated_tp_ranks_with_staleness_check_their_shard_of_the_whole_kept_weights():
    """Colocated vLLM TP=2 with ``rollout.staleness=1`` syncs the kept whole weight sets (not the
    sliced layer stream: each TP worker's loaders narrow them): each rank's check sums exactly the
    shard its worker holds of the set handed (W_0, W_0, W_1: one update stale), computed here from
    the whole tensors by vLLM's rules (``_tp_worker``), on all 29 tensors; the two ranks' sums
    differ on every split tensor and agree on the whole ones."""
    rows = []
    for r in (0, 1):
        engine = _TpWorker(r)
        sync, learner, check = _stale_sync(r, engine)
        for u, held_u in ((0, 0), (1, 0), (2, 1)):
            learner.u = u
            m = sync.sync()
            whole = random_canonical_weights(hf_tiny(), seed=10 + held_u)
            assert sorted(engine.got) == sorted(whole)
            assert all(torch.equal(engine.got[n], t) for n, t in whole.items()), f"rank {r}, sync {u + 1}"
            expected = as_ints(checksums(_tp_worker(whole, r)))
            assert check.sent_ints() == expected, f"rank {r}, sync {u + 1}"
            assert m["sync/check_tensors"].value.item() == len(expected) == 29
        rows.append(check.sent_ints())
    split = {n for n in rows[0] if rows[0][n] != rows[1][n]}
    assert sorted(rows[0]) == sorted(rows[1]) and len(split) == 3 * 2 + 2 + 2 * 2 + 2
    assert all(
        n.endswith(("proj.weight", "w13_weight", "w2_weight", "embed_tokens.weight", "lm_head.weight"))
        for n in split
    )


def test_a_colocated_tp_worker_holding_the_wrong_slice_of_a_stale_set_fails_naming_it_and_its_shard():
    """The same path, TP rank 1's loader narrowing layer 1's ``o_proj`` to rank 0's columns: the
    first sync fails with one line naming the tensor and the shard, its sums and the sent ones."""
    from moe_rl.pipeline.sync_check import SyncCheckError

    name = "model.layers.1.self_attn.o_proj.weight"
    engine = _TpWorker(1, wrong=name)
    sync, _, check = _stale_sync(1, engine)
    with pytest.raises(SyncCheckError) as e:
        sync.sync()
    held, sent = engine.held[name], check.sent_ints()[name]
    assert held != sent
    assert str(e.value) == (
        f"weight sync check failed at sync 1: engine tensor {name!r} (TP rank 1 of 2): checksum {held} "
        f"!= sent {sent} (a wrong layout, a dropped chunk or a stale tensor)"
    )
