"""unit tier: agreement metrics computed once per pass (routing/agreement.py), against counts
worked out by hand, and the route server's fail-closed checks (routing/server.py)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.routing.agreement import AgreementCollector, SeqShard
from moe_rl.routing.record import RouteHeader
from moe_rl.routing.server import ReplayError, RouteServer
from tests.models import MICRO_MOE as MODEL

HEADER = RouteHeader.for_model(MODEL)


def _nlk(layer0, layer1):
    return torch.stack([torch.tensor(layer0), torch.tensor(layer1)], 1)


def _mean(m):
    return float(m.sum) / float(m.count)


@pytest.mark.unit
def test_agreement_over_micro_batches_and_layers_matches_hand_counts():
    c = AgreementCollector(HEADER, [0, 1], SeqShard())
    c.begin_pass("routing/", keep_native=True)
    # micro-batch 1: one sequence of 3 tokens (rows 0, 1 recorded; the last token is not)
    native1 = _nlk([[0, 1], [2, 3], [0, 1]], [[0, 1], [0, 1], [2, 3]])
    target1 = _nlk([[1, 0], [2, 1], [3, 2]], [[0, 1], [2, 3], [0, 1]])
    c.add(native1, torch.tensor([3]), target=(target1, torch.tensor([True, True, False])))
    # micro-batch 2: one sequence of 2 tokens
    native2 = _nlk([[1, 2], [0, 3]], [[3, 2], [0, 1]])
    target2 = _nlk([[1, 3], [0, 1]], [[2, 3], [0, 2]])
    c.add(native2, torch.tensor([2]), target=(target2, torch.tensor([True, False])))
    c.add_missing(
        {
            "rows_expected": torch.tensor(3.0, dtype=torch.float64),
            "rows_missing": torch.tensor(0.0, dtype=torch.float64),
        }
    )
    out = c.finish()
    m = {k: _mean(v) for k, v in out.metrics.items()}
    # layer 0 flips on rows (mb1, 1) and (mb2, 0); layer 1 on (mb1, 1); 3 recorded rows
    assert m["routing/flip_router_frac/layer0"] == pytest.approx(2 / 3)
    assert m["routing/flip_router_frac/layer1"] == pytest.approx(1 / 3)
    assert m["routing/flip_router_frac"] == pytest.approx(3 / 6)
    assert m["routing/overlap_at_k/layer0"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert m["routing/overlap_at_k/layer1"] == pytest.approx((1 + 0 + 1) / 3)
    assert m["routing/flip_token_frac"] == pytest.approx(2 / 3)
    assert m["routing/flip_layers_per_token"] == pytest.approx(1.0)
    assert m["routing/missing_frac"] == 0.0
    assert sorted(m) == sorted(
        [
            "routing/flip_router_frac/layer0",
            "routing/flip_router_frac/layer1",
            "routing/flip_router_frac",
            "routing/overlap_at_k/layer0",
            "routing/overlap_at_k/layer1",
            "routing/overlap_at_k",
            "routing/flip_token_frac",
            "routing/flip_layers_per_token",
            "routing/missing_frac",
        ]
    )
    # the kept native routes, as records: T - 1 rows per sequence, in batch order
    rec = out.recorded
    assert rec.rows_B.tolist() == [2, 1]
    assert rec.ids_NLK.long().tolist() == [native1[0].tolist(), native1[1].tolist(), native2[0].tolist()]


@pytest.mark.unit
def test_old_route_comparison_is_filed_under_the_monitor_prefix():
    c = AgreementCollector(HEADER, [0, 1], SeqShard())
    c.begin_pass("routing/update_", keep_native=False)
    native = _nlk([[0, 1], [2, 3]], [[0, 1], [2, 3]])
    old = _nlk([[0, 1], [2, 0]], [[1, 0], [3, 2]])
    c.add(native, torch.tensor([2]), old=(old, torch.tensor([True, True])))
    out = c.finish()
    m = {k: _mean(v) for k, v in out.metrics.items()}
    assert out.recorded is None and not any(k.startswith("routing/") for k in m)
    assert m == pytest.approx(
        {
            "router_grad/update_flip_frac/layer0": 0.5,
            "router_grad/update_flip_frac/layer1": 0.0,
            "router_grad/update_flip_frac": 0.25,
            "router_grad/update_flip_token_frac": 0.5,
            "router_grad/update_flip_layers_per_token": 0.5,
        }
    )


@pytest.mark.unit
def test_route_server_fails_closed():
    server = RouteServer([1, 3])
    server.begin_pass(queue_for_recompute=True)
    server.load(torch.zeros(4, 2, 2, dtype=torch.int64))
    assert server.serve(0, 4, recompute=False).shape == (4, 2)
    with pytest.raises(ReplayError, match="layer 1: forward without routes"):
        server.serve(0, 4, recompute=False)  # stale: the same routes twice
    with pytest.raises(ReplayError, match="layer 3: 4 routes for 5 tokens"):
        server.serve(1, 5, recompute=False)
    server.begin_pass(queue_for_recompute=True)
    server.load(torch.zeros(4, 2, 2, dtype=torch.int64))
    server.serve(0, 4, recompute=False)
    with pytest.raises(ReplayError, match="layer 3: consumed 0 of 1 micro-batches' routes"):
        server.check_forward()
    server.serve(1, 4, recompute=False)
    server.check_forward()
    with pytest.raises(ReplayError, match="layer 1: 1 queued routes were not consumed by recompute"):
        server.check_consumed()
    server.serve(0, 4, recompute=True)
    server.serve(1, 4, recompute=True)
    server.check_consumed()
    assert (server.served_forward, server.served_backward) == ([1, 1], [1, 1])
    with pytest.raises(ReplayError, match="recompute asked for routes but none are queued"):
        server.serve(0, 4, recompute=True)


@pytest.mark.unit
def test_flips_by_version_lag_split_the_router_flips_by_each_rows_lag():
    c = AgreementCollector(HEADER, [0, 1], SeqShard())
    c.begin_pass("routing/", keep_native=False, num_lags=3)
    # the micro-batches of the hand-count test above; recorded rows (mb1, 0) lag 0, (mb1, 1) and
    # (mb2, 0) lag 1 (unrecorded rows carry any lag: never counted)
    native1 = _nlk([[0, 1], [2, 3], [0, 1]], [[0, 1], [0, 1], [2, 3]])
    target1 = _nlk([[1, 0], [2, 1], [3, 2]], [[0, 1], [2, 3], [0, 1]])
    c.add(
        native1,
        torch.tensor([3]),
        target=(target1, torch.tensor([True, True, False])),
        target_lag=torch.tensor([0, 1, 2]),
    )
    native2 = _nlk([[1, 2], [0, 3]], [[3, 2], [0, 1]])
    target2 = _nlk([[1, 3], [0, 1]], [[2, 3], [0, 2]])
    c.add(
        native2,
        torch.tensor([2]),
        target=(target2, torch.tensor([True, False])),
        target_lag=torch.tensor([1, 2]),
    )
    m = c.finish().metrics
    # lag 0: row (mb1, 0) agrees in both layers; lag 1: (mb1, 1) flips in 2 layers, (mb2, 0) in 1
    assert (float(m["routing/flip_frac_lag0"].sum), float(m["routing/flip_frac_lag0"].count)) == (0.0, 2.0)
    assert (float(m["routing/flip_frac_lag1"].sum), float(m["routing/flip_frac_lag1"].count)) == (3.0, 4.0)
    assert (float(m["routing/flip_frac_lag2"].sum), float(m["routing/flip_frac_lag2"].count)) == (0.0, 0.0)
    # the lags partition the step's (token, layer) pairs: together they are flip_router_frac
    total = m["routing/flip_router_frac"]
    assert (float(total.sum), float(total.count)) == (3.0, 6.0)
    # without num_lags nothing is split; a micro-batch without its lags is refused
    c.begin_pass("routing/", keep_native=False)
    c.add(native2, torch.tensor([2]), target=(target2, torch.tensor([True, False])))
    assert not [k for k in c.finish().metrics if "_lag" in k]
    c.begin_pass("routing/", keep_native=False, num_lags=2)
    with pytest.raises(ReplayError, match="without its rows' lags"):
        c.add(native2, torch.tensor([2]), target=(target2, torch.tensor([True, False])))


@pytest.mark.unit
def test_flips_by_turn_split_the_router_flips_by_each_rows_turn():
    c = AgreementCollector(HEADER, [0, 1], SeqShard())
    c.begin_pass("routing/", keep_native=False, num_lags=1, num_turns=2)
    # the micro-batches above; recorded rows (mb1, 0) turn 1, (mb1, 1) turn 2, (mb2, 0) turn 1
    native1 = _nlk([[0, 1], [2, 3], [0, 1]], [[0, 1], [0, 1], [2, 3]])
    target1 = _nlk([[1, 0], [2, 1], [3, 2]], [[0, 1], [2, 3], [0, 1]])
    rec1 = torch.tensor([True, True, False])
    zero1, zero2 = torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    c.add(
        native1,
        torch.tensor([3]),
        target=(target1, rec1),
        target_lag=zero1,
        target_turn=torch.tensor([1, 2, 0]),
    )
    native2 = _nlk([[1, 2], [0, 3]], [[3, 2], [0, 1]])
    target2 = _nlk([[1, 3], [0, 1]], [[2, 3], [0, 2]])
    rec2 = torch.tensor([True, False])
    c.add(
        native2, torch.tensor([2]), target=(target2, rec2), target_lag=zero2, target_turn=torch.tensor([1, 1])
    )
    m = c.finish().metrics
    # turn 1: (mb1, 0) agrees in both layers, (mb2, 0) flips in 1 -> 1 of 4; turn 2: (mb1, 1) 2 of 2
    assert (float(m["agent/flip_frac/turn1"].sum), float(m["agent/flip_frac/turn1"].count)) == (1.0, 4.0)
    assert (float(m["agent/flip_frac/turn2"].sum), float(m["agent/flip_frac/turn2"].count)) == (2.0, 2.0)
    assert not [k for k in m if k.endswith("turn0") or k.endswith("turn3")]
    c.begin_pass("routing/", keep_native=False, num_turns=2)
    with pytest.raises(ReplayError, match="without its rows' turns"):
        c.add(native2, torch.tensor([2]), target=(target2, rec2))


@pytest.mark.unit
def test_topk_margin_is_the_gap_between_the_kth_and_next_selection_score():
    from moe_rl.routing.gating import RouterSpec, topk_margin

    select = torch.tensor([[3.0, 1.0, 2.5, 0.0], [1.0, 1.0, 1.0, 0.5]])
    assert topk_margin(select, RouterSpec(2)).tolist() == [1.5, 0.0]  # 2.5 - 1.0; a tie is 0
    assert topk_margin(select, RouterSpec(4)).tolist() == [float("inf")] * 2  # no (K+1)-th expert
    # 2 groups of 2, one chosen (its best two summed): the K+1-th must lie in the chosen group
    grouped = RouterSpec(1, num_groups=2, group_topk=1)
    assert topk_margin(torch.tensor([[3.0, 0.5, 2.75, 2.5]]), grouped).tolist() == [0.25]  # group 1 (5.25)
    assert topk_margin(torch.tensor([[3.0, 0.5, 0.25, 0.125]]), grouped).tolist() == [2.5]  # group 0 (3.5)


@pytest.mark.unit
def test_flips_by_margin_bucket_match_hand_counts():
    """Margins on each bucket's edges go up (buckets [0, 1e-3), [1e-3, 1e-2), [1e-2, 1e-1), [1e-1, inf))."""
    c = AgreementCollector(HEADER, [0, 1], SeqShard())
    c.begin_pass("routing/", keep_native=False, margins=True)
    # 4 tokens (one sequence of 5: rows 0-3 recorded, row 4 not), 2 layers
    native = _nlk([[0, 1]] * 5, [[0, 1]] * 5)
    target = _nlk([[0, 2], [0, 1], [1, 0], [0, 3], [2, 3]], [[0, 1], [3, 2], [0, 1], [1, 2], [0, 1]])
    # flips: layer 0 rows 0, 3 (row 4 not recorded); layer 1 rows 1, 3
    margin = torch.tensor([[5e-4, 1e-3], [1e-3, 5e-4], [0.05, 0.1], [0.2, float("inf")], [0.0, 0.0]])
    c.add(native, torch.tensor([5]), target=(target, torch.tensor([True] * 4 + [False])), margin_NL=margin)
    m = {k: _mean(v) for k, v in c.finish().metrics.items()}
    # pairs per bucket: lt1e-3 {(0,0) flip, (1,1) flip}; 1e-3_1e-2 {(0,1), (1,0)}; 1e-2_1e-1 {(2,0)};
    # ge1e-1 {(2,1), (3,0) flip, (3,1) flip}
    assert [m[f"routing/flip_frac_margin_{b}"] for b in ("lt1e-3", "1e-3_1e-2", "1e-2_1e-1", "ge1e-1")] == [
        1.0,
        0.0,
        0.0,
        2 / 3,
    ]
    assert [m[f"routing/margin_frac_{b}"] for b in ("lt1e-3", "1e-3_1e-2", "1e-2_1e-1", "ge1e-1")] == [
        2 / 8,
        2 / 8,
        1 / 8,
        3 / 8,
    ]
    assert m["routing/flip_router_frac"] == 4 / 8
    with pytest.raises(ReplayError, match="flips by margin: a micro-batch came without its rows' margins"):
        c.begin_pass("routing/", keep_native=False, margins=True)
        c.add(native, torch.tensor([5]), target=(target, torch.tensor([True] * 5)))
