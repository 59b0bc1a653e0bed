"""unit tier: the box arithmetic of the colocated sliced sync (moe_rl/weights/slice_stream.py) on
one process. For each tensor kind of a tiny model and each layout (learner TP x expert-TP x EP,
engine TP, an engine EP shard too), every learner rank's held box is cut from the full tensor and
the parts ``routes`` sends each engine rank are put together by ``placed_parts``: the result must
equal, bit for bit, what ``engine_slice`` narrows the full tensor to. The collective itself
(``exchange``) is tested on ranks in test_weight_stream.py."""

from __future__ import annotations

import pytest
import torch

from moe_rl.weights.canonical import canonical_param_shapes
from moe_rl.weights.engine_shard import EngineShard, engine_slice
from moe_rl.weights.slice_stream import (
    box_numel,
    held_box,
    needed_box,
    placed_parts,
    routes,
    within,
)
from moe_rl.weights.stream import EXPERT_SLOT, Kind
from tests.models import TINY_MOE_L3 as MODEL

E = MODEL.num_experts


def _kinds() -> list[Kind]:
    """Layer 1's tensors, the embedding and lm_head, one stacked kind per expert projection."""
    shapes = canonical_param_shapes(MODEL)
    out = [
        Kind(n, s, torch.float32)
        for n, s in shapes.items()
        if ".experts." not in n and (n.startswith("model.layers.1.") or "layers" not in n)
    ]
    for p in ("gate_proj", "up_proj", "down_proj"):
        one = shapes[f"model.layers.1.mlp.experts.0.{p}.weight"]
        out.append(Kind(f"model.layers.1.mlp.experts.{EXPERT_SLOT}.{p}.weight", (E, *one), torch.float32))
    return out


def _assembled(kind: Kind, full: torch.Tensor, holders: list, shards: list[EngineShard]) -> list:
    """``holders``: per rank of the group (TP x PP, or expert-TP x EP x PP) its (TP, EP) pieces
    held, None on a rank of another stage."""
    ids = list(range(E)) if kind.stacked else []
    held = [held_box(kind, *h) if h is not None else None for h in holders]
    needed = [needed_box(kind, ids, s, MODEL) for s in shards]
    route, whole = routes(tuple(held), tuple(needed)), tuple((0, d) for d in kind.shape)
    local = [within(full, h, whole).clone() if h is not None else None for h in held]
    out = []
    for k, box in enumerate(needed):
        parts = [
            (route[j][k], within(local[j], route[j][k], held[j])) for j in range(len(held)) if route[j][k]
        ]
        assert sum(box_numel(b) for b, _ in parts) == (box_numel(box) if box else 0)  # tiled: disjoint
        out.append(None if box is None else (box, placed_parts(box, parts, full)))
    return out, route


def _want(kind: Kind, full: torch.Tensor, shard: EngineShard) -> torch.Tensor | None:
    if not kind.stacked:
        return engine_slice({kind.name: full}, shard, MODEL)[kind.name]
    got = engine_slice({kind.name.format(e): full[e] for e in range(E)}, shard, MODEL)
    rows = [got[kind.name.format(e)] for e in range(E) if kind.name.format(e) in got]
    return torch.stack(rows) if rows else None


LAYOUTS = [  # (learner TP = expert-TP, EP, PP, engine TP, engine EP)
    (2, 2, 1, 2, 1),  # engine TP = learner TP: each rank holds its TP slice already (experts: EP)
    (2, 2, 1, 4, 1),  # engine TP 4: KV heads replicated, the vocabulary 16 / 16 / 16 / 2 rows
    (1, 2, 1, 2, 1),  # learner TP 1, engine TP 2: slices of whole tensors
    (2, 1, 1, 1, 1),  # an engine rank holding everything: whole tensors from TP pieces
    (2, 2, 1, 2, 2),  # an engine of TP 2 x EP 2: its experts only, whole
    (2, 2, 2, 2, 1),  # PP 2: the other stage's ranks hold nothing of the piece
    (1, 2, 2, 4, 1),  # PP 2, engine TP 4: a pipeline peer hosts another slice than its peer
]


@pytest.mark.unit
@pytest.mark.parametrize("tp,ep,pp,engine_tp,engine_ep", LAYOUTS)
def test_routed_parts_tile_each_engine_slice_exactly(tp, ep, pp, engine_tp, engine_ep):
    gen = torch.Generator().manual_seed(0)
    stage = [((t, tp), (0, 1)) for t in range(tp)]
    stage_ex = [((t, tp), (r, ep)) for r in range(ep) for t in range(tp)]  # expert-TP fastest
    holders_tp = stage + [None] * len(stage) * (pp - 1)  # group ranks: stage 0 (the owner) first
    holders_ex = stage_ex + [None] * len(stage_ex) * (pp - 1)
    n = max(len(holders_ex), engine_tp * engine_ep)
    engine = [EngineShard(engine_tp, r % engine_tp, engine_ep, r // engine_tp % engine_ep) for r in range(n)]
    for kind in _kinds():
        full = torch.randn(kind.shape, generator=gen)
        holders = holders_ex if kind.stacked else holders_tp
        shards = engine[: len(holders)]
        got, route = _assembled(kind, full, holders, shards)
        for shard, g in zip(shards, got):
            want = _want(kind, full, shard)
            if want is None:
                assert g is None, (kind.name, shard)
                continue
            assert g is not None and torch.equal(g[1], want), (kind.name, shard)
        remote = any(route[j][k] for j in range(len(holders)) for k in range(len(holders)) if j != k)
        if (tp, ep, pp, engine_tp, engine_ep) == (2, 2, 1, 2, 1):  # engine TP = learner TP: no wire but
            assert remote == (kind.stacked or kind.name in ("model.embed_tokens.weight", "lm_head.weight")), (
                kind
            )
        if engine_tp == 1:  # whole: a gather of every split kind, nothing for a replicated one
            assert remote == (kind.stacked or held_box(kind, (0, tp)) != tuple((0, d) for d in kind.shape))


@pytest.mark.unit
def test_expert_rows_of_an_engine_ep_shard_are_its_experts():
    kind = Kind(f"model.layers.1.mlp.experts.{EXPERT_SLOT}.up_proj.weight", (E, 48, 64), torch.float32)
    ids = [0, 2, 1, 3]  # a piece of local expert j of each EP rank: experts 0, 2 then 1, 3
    with pytest.raises(ValueError, match="not one run"):
        needed_box(kind, ids, EngineShard(2, 0, 2, 0), MODEL)
    assert needed_box(kind, [0, 1, 2, 3], EngineShard(2, 1, 2, 1), MODEL) == ((2, 4), (0, 48), (0, 64))
    assert needed_box(kind, [0, 1], EngineShard(2, 1, 2, 1), MODEL) is None
    assert needed_box(kind, [0, 1, 2, 3], EngineShard(2, 1), MODEL) == ((0, 4), (24, 48), (0, 64))
