"""unit tier: the route record, its strict ingest, serialisation, the vLLM adapter and the layout."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moe_rl.config import ModelConfig
from moe_rl.routing.record import (
    RouteBatch,
    RouteError,
    RouteHeader,
    RouteRecord,
    from_vllm,
    load_records,
    missing_id,
    model_fingerprint,
    route_dtype,
    save_records,
    validate,
)
from moe_rl.routing.row_layout import layout, pad_routes, token_rows, unlayout
from moe_rl.routing.topk_overlap import topk_agreement
from tests.routing.route_helpers import CFG, HEADER
from tests.routing.route_helpers import random_routes as _random_routes


@pytest.mark.unit
def test_dtype_and_header():
    assert route_dtype(8) == torch.uint8 and route_dtype(255) == torch.uint8
    assert route_dtype(256) == torch.uint16  # uint8 would leave no room for MISSING
    assert missing_id(torch.uint8) == 255
    assert HEADER.layer_ids == (1, 2, 3) and HEADER.num_experts == 8 and HEADER.top_k == 2
    other = ModelConfig(vocab_size=50, num_layers=4, first_k_dense=1, num_experts=8, moe_router_topk=1)
    assert model_fingerprint(other) != HEADER.fingerprint


@pytest.mark.unit
def test_valid_batch_passes_and_select_matches_records():
    routes = _random_routes([5, 3, 7])
    validate(routes, torch.tensor([5, 3, 7]), HEADER)
    sub = routes.select(torch.tensor([2, 0]))
    recs = routes.records()
    assert torch.equal(sub.ids_NLK, torch.cat([recs[2].ids_TLK, recs[0].ids_TLK]))
    assert sub.rows_B.tolist() == [6, 4]


@pytest.mark.unit
@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda ids: ids.__setitem__((5, 1, 0), 9), "sample 1, layer 2, row 1: expert id 9 outside [0, 8)"),
        (
            lambda ids: ids.__setitem__((6, 0), torch.tensor([3, 3], dtype=torch.uint8)),
            "sample 2, layer 1, row 0: repeated expert ids [3, 3]",
        ),
        (lambda ids: ids.__setitem__((2, 2, 1), 255), "sample 0, layer 3, row 2: row mixes MISSING"),
    ],
)
def test_ingest_names_sample_layer_row(mutate, needle):
    routes = _random_routes([5, 3, 7])
    mutate(routes.ids_NLK)
    with pytest.raises(RouteError, match=re.escape(needle)):
        validate(routes, torch.tensor([5, 3, 7]), HEADER)


@pytest.mark.unit
def test_ingest_rejects_all_zero_layer_count_dtype_and_fingerprint():
    routes = _random_routes([5, 4], seed=1)
    routes.ids_NLK[4:, 1] = torch.tensor([0, 1], dtype=torch.uint8)  # fine: distinct
    validate(routes, torch.tensor([5, 4]), HEADER)
    k1 = RouteHeader((1, 2, 3), 8, 1, HEADER.fingerprint)
    zero = RouteBatch(
        torch.zeros(3, 3, 1, dtype=torch.uint8), torch.tensor([3]), torch.tensor([0]), torch.tensor([2]), k1
    )
    with pytest.raises(RouteError, match="sample 0, layer 1: every row routes to expert 0"):
        validate(zero, torch.tensor([4]), k1)
    with pytest.raises(RouteError, match="sample 1: 3 route rows for 5 tokens from position 0; expected 4"):
        validate(routes, torch.tensor([5, 5]), HEADER)
    wide = RouteBatch(
        routes.ids_NLK.to(torch.int32), routes.rows_B, routes.start_B, routes.prompt_len_B, HEADER
    )
    with pytest.raises(RouteError, match="route dtype torch.int32, expected torch.uint8"):
        validate(wide, torch.tensor([5, 4]), HEADER)
    alien = RouteHeader(HEADER.layer_ids, 8, 2, "0123456789abcdef")
    with pytest.raises(RouteError, match="fingerprint 0123456789abcdef is not the learner model's"):
        validate(
            RouteBatch(routes.ids_NLK, routes.rows_B, routes.start_B, routes.prompt_len_B, alien),
            torch.tensor([5, 4]),
            HEADER,
        )


@pytest.mark.unit
def test_serialisation_round_trip_and_bytes_per_token():
    routes = _random_routes([5, 3, 7])
    back = RouteBatch.from_records(load_records(save_records(routes.records())))
    assert torch.equal(back.ids_NLK, routes.ids_NLK) and back.header == HEADER
    assert back.rows_B.tolist() == [4, 2, 6]
    assert routes.ids_NLK.element_size() * 3 * 2 == 6  # L_moe x K x 1 byte per token


@pytest.mark.unit
def test_vllm_adapter_selects_moe_layers_by_global_number():
    # vLLM: [T - 1 - prompt_start, all decoder layers, K], dense layer 0 rows left at zero
    T, start = 9, 2
    arr = np.zeros((T - 1 - start, 4, 2), dtype=np.uint8)
    arr[:, 1:, 0] = np.arange(6)[:, None] % 8
    arr[:, 1:, 1] = (np.arange(6)[:, None] + 3) % 8
    rec = from_vllm(arr, num_tokens=T, prompt_len=5, header=HEADER, prompt_start=start)
    assert rec.ids_TLK.shape == (6, 3, 2) and rec.ids_TLK.dtype == torch.uint8 and rec.start == 2
    assert rec.ids_TLK[:, 0, 1].tolist() == [3, 4, 5, 6, 7, 0]
    validate(RouteBatch.from_records([rec]), torch.tensor([T]), HEADER)
    with pytest.raises(RouteError, match="sample 4: vLLM returned 6 route rows for 10 tokens"):
        from_vllm(arr, num_tokens=10, prompt_len=5, header=HEADER, prompt_start=start, sample=4)
    with pytest.raises(RouteError, match="K=2, model top-k is 1"):
        from_vllm(arr, num_tokens=T, prompt_len=5, header=RouteHeader((1, 2, 3), 8, 1, "x"), prompt_start=2)
    big = RouteHeader((1, 2, 3), 256, 2, "x")  # vLLM sends uint8 for 256 experts; we widen
    assert (
        from_vllm(arr, num_tokens=T, prompt_len=5, header=big, prompt_start=2).ids_TLK.dtype == torch.uint16
    )


@pytest.mark.unit
def test_vllm_adapter_widens_256_experts_and_refuses_ids_outside_the_experts():
    """vLLM's dtype (uint8 up to 256 experts, else uint16) is required as is; every MoE-layer id
    must be < E before the move to our dtype (nothing wraps, nothing becomes MISSING)."""
    arr = np.zeros((4, 2, 2), dtype=np.uint8)
    arr[:, 1] = [[255, 0], [254, 1], [3, 2], [7, 128]]
    rec = from_vllm(arr, num_tokens=5, prompt_len=3, header=RouteHeader((1,), 256, 2, "x"), num_layers=2)
    assert rec.ids_TLK.dtype == torch.uint16 and rec.ids_TLK[:, 0].tolist() == [
        [255, 0],
        [254, 1],
        [3, 2],
        [7, 128],
    ]
    with pytest.raises(RouteError) as e:
        from_vllm(arr, num_tokens=5, prompt_len=3, header=RouteHeader((1,), 200, 2, "x"), sample=3)
    assert str(e.value) == "sample 3, layer 1, row 0: vLLM expert id 255 outside [0, 200)"
    wide = arr.astype(np.uint16)
    wide[2, 1, 0] = 300
    with pytest.raises(RouteError) as e:
        from_vllm(wide, num_tokens=7, prompt_len=3, header=RouteHeader((1,), 300, 2, "x"), prompt_start=2)
    assert str(e.value) == "sample 0, layer 1, row 4: vLLM expert id 300 outside [0, 300)"
    wide[2, 1, 0] = 299
    rec = from_vllm(wide, num_tokens=7, prompt_len=3, header=RouteHeader((1,), 300, 2, "x"), prompt_start=2)
    assert rec.ids_TLK.dtype == torch.uint16 and rec.ids_TLK[:, 0, 0].tolist() == [255, 254, 299, 7]
    with pytest.raises(RouteError) as e:
        from_vllm(arr, num_tokens=5, prompt_len=3, header=RouteHeader((1,), 300, 2, "x"))
    assert str(e.value) == (
        "sample 0: vLLM routed_experts dtype is uint8, expected uint16 for 300 experts "
        "(vLLM 0.33: uint8 up to 256 experts, else uint16)"
    )


@pytest.mark.unit
def test_pad_routes_distinct_and_balanced_over_ep_ranks():
    pads = pad_routes(64, 2, 8, 2)
    assert (pads[:, 0] != pads[:, 1]).all()
    rank = pads // 4
    assert (rank[:, 0] != rank[:, 1]).all()  # each pad token touches both EP ranks
    counts = torch.bincount(pads.flatten(), minlength=8)
    assert counts.tolist() == [16] * 8  # every expert gets the same share, none is a hot spot


@pytest.mark.unit
def test_layout_is_sequence_major_with_native_last_row_and_pads():
    routes = _random_routes([4, 2], seed=3)
    seq_lens_B = torch.tensor([4, 2])
    targets_NLK, recorded_N, counts = layout(routes, seq_lens_B, 5, ep_size=2)
    B = 2
    recs = routes.records()
    for b, rec in enumerate(recs):
        for t in range(rec.num_rows):
            assert torch.equal(targets_NLK[t * B + b], rec.ids_TLK[t].long())
        assert (targets_NLK[(seq_lens_B[b] - 1) * B + b] == -1).all()  # last token routes natively
    pad_rows = [s * B + b for b in range(B) for s in range(int(seq_lens_B[b]), 5)]
    assert (targets_NLK[pad_rows] >= 0).all() and recorded_N[pad_rows].sum() == 0
    assert int(recorded_N.sum()) == 3 + 1
    assert float(counts["rows_missing"]) == 0.0 and float(counts["rows_expected"]) == 4.0
    back = unlayout(torch.where(targets_NLK < 0, 0, targets_NLK), seq_lens_B, routes.prompt_len_B, HEADER)
    assert torch.equal(back.ids_NLK, routes.ids_NLK)
    # a per-token tensor laid out as rows lines up with the targets (the route rows' lags use it)
    marker_BS = torch.full((B, 5), -7, dtype=torch.int64)
    for b, rec in enumerate(recs):
        marker_BS[b, : rec.num_rows] = rec.ids_TLK[:, 0, 0].long()
    rows_N = token_rows(marker_BS)
    assert torch.equal(rows_N[recorded_N], targets_NLK[recorded_N, 0, 0])


@pytest.mark.unit
def test_layout_counts_missing_rows():
    routes = _random_routes([4], seed=4)
    routes.ids_NLK[1] = missing_id(torch.uint8)
    targets_NLK, recorded_N, counts = layout(routes, torch.tensor([4]), 4, ep_size=1)
    assert (targets_NLK[1] == -1).all() and not recorded_N[1]
    assert float(counts["rows_missing"]) == 1.0 and float(counts["rows_expected"]) == 3.0


@pytest.mark.unit
def test_topk_agreement_ignores_order():
    a = torch.tensor([[0, 1], [2, 3], [4, 5]])
    b = torch.tensor([[1, 0], [2, 7], [6, 7]])
    differs, overlap = topk_agreement(a, b)
    assert differs.tolist() == [False, True, True]
    assert overlap.tolist() == [1.0, 0.5, 0.0]


# ---------------------------------------------- ingest never repairs (issue 14 point 4)


@pytest.mark.unit
def test_from_records_refuses_other_dtypes_and_layer_counts_naming_the_sample():
    good = _random_routes([5, 4]).records()
    wide = RouteRecord(good[1].ids_TLK.to(torch.int64), 2, 0, HEADER)
    with pytest.raises(RouteError) as e:
        RouteBatch.from_records([good[0], wide])
    assert (
        str(e.value)
        == "sample 1: route dtype torch.int64, expected torch.uint8 for 8 experts (nothing is cast)"
    )
    more = RouteRecord(torch.zeros(3, 4, 2, dtype=torch.uint8), 2, 0, HEADER)  # 4 layers, the model has 3 MoE
    with pytest.raises(RouteError) as e:
        RouteBatch.from_records([good[0], good[1], more])
    assert (
        str(e.value)
        == "sample 2: route shape (3, 4, 2), expected [rows, 3 MoE layers, 2] (MoE layers [1, 2, 3])"
    )


@pytest.mark.unit
def test_vllm_array_with_more_layers_than_the_model_is_refused():
    arr = np.zeros((4, 5, 2), dtype=np.uint8)  # 5 decoder layers; the model has 4
    arr[:, :, 1] = 1
    with pytest.raises(RouteError) as e:
        from_vllm(arr, num_tokens=5, prompt_len=3, header=HEADER, sample=6)
    assert str(e.value) == "sample 6: vLLM routed_experts has 5 layers, the model has 4 decoder layers"


@pytest.mark.unit
def test_load_records_refuses_cut_or_foreign_blobs():
    blob = save_records(_random_routes([5, 4]).records())
    assert [r.num_rows for r in load_records(blob)] == [4, 3]
    with pytest.raises(RouteError) as e:
        load_records(blob[:-7], name="routes.st")
    assert str(e.value).startswith("routes.st: not a complete route-record blob (SafetensorError: ")
    with pytest.raises(RouteError) as e:
        load_records(b"not a blob at all")
    assert str(e.value).startswith("route records: not a complete route-record blob (")
    import dataclasses
    import json

    from safetensors.torch import save as st_save

    ids = torch.zeros(5, 3, 2, dtype=torch.uint8)
    lying = st_save(
        {"ids": ids, "rows": torch.tensor([4, 3]), "meta": torch.zeros(2, 2, dtype=torch.int64)},
        metadata={"header": json.dumps(dataclasses.asdict(HEADER))},
    )
    with pytest.raises(RouteError) as e:
        load_records(lying, name="r.st")
    assert str(e.value) == "r.st: row counts [4, 3] (sum 7) do not match 5 id rows and meta (2, 2)"


@pytest.mark.unit
def test_builtin_engine_ids_outside_the_experts_are_refused_not_cast():
    from moe_rl.rollout.builtin import _to_route_dtype

    routes = torch.zeros(2, 6, 3, 2, dtype=torch.int32)
    routes[..., 1] = 1
    assert _to_route_dtype(routes, torch.tensor([0, 1]), CFG, torch.uint8).dtype == torch.uint8
    routes[1, 4, 2, 0] = 264  # 264 % 256 = 8, 264 would wrap to 8 in uint8
    with pytest.raises(RouteError) as e:
        _to_route_dtype(routes, torch.tensor([0, 1]), CFG, torch.uint8)
    assert str(e.value) == "sample 1, layer 3, row 3: built-in engine expert id 264 outside [0, 8)"
    routes[1, 4, 2, 0] = -1
    with pytest.raises(RouteError, match="expert id -1 outside"):
        _to_route_dtype(routes, torch.tensor([0, 1]), CFG, torch.uint8)
