"""unit tier, issue 44 point 4: per-row route provenance (version, source, turn) is carried by the
record through select / from_records / records / save / load, checked at ingest naming the sample
and row, and ``routing.stale_rows`` acts on exactly the rows whose version is not their token's."""

from __future__ import annotations

import re

import pytest
import torch

from moe_rl.routing.provenance import COMPUTED, NONE, PREFIX_HIT, Provenance, apply_stale_policy
from moe_rl.routing.record import (
    RouteBatch,
    RouteError,
    load_records,
    missing_id,
    save_records,
    validate,
)
from tests.routing.route_helpers import HEADER
from tests.routing.route_helpers import random_routes as _random_routes

pytestmark = pytest.mark.unit


def _with_prov(routes: RouteBatch) -> RouteBatch:
    N = routes.ids_NLK.shape[0]
    prov = Provenance(
        (torch.arange(N) % 3 + 1).to(torch.int32),
        torch.tensor([COMPUTED, PREFIX_HIT] * (N // 2) + [COMPUTED] * (N % 2), dtype=torch.uint8),
        (torch.arange(N) % 4).to(torch.int16),
    )
    return RouteBatch(routes.ids_NLK, routes.rows_B, routes.start_B, routes.prompt_len_B, routes.header, prov)


def _same(a: Provenance, b: Provenance) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))


def test_provenance_rides_select_records_and_save_load():
    routes = _with_prov(_random_routes([5, 3, 7]))
    validate(routes, torch.tensor([5, 3, 7]), HEADER)
    rows = torch.cat([torch.arange(6, 12), torch.arange(0, 4)])  # sample 2 then sample 0
    sub = routes.select(torch.tensor([2, 0]))
    assert _same(sub.prov, routes.prov.index(rows))
    assert sub.prov.version_N.tolist() == (rows % 3 + 1).tolist()
    recs = routes.records()
    assert [r.prov.num_rows for r in recs] == [4, 2, 6]
    again = RouteBatch.from_records(recs)
    assert _same(again.prov, routes.prov)
    loaded = load_records(save_records(recs), "buffer.safetensors")
    assert _same(RouteBatch.from_records(loaded).prov, routes.prov)
    # without provenance the blob is what it was (no prov tensors) and loads as None
    plain = _random_routes([5, 3])
    assert all(r.prov is None for r in load_records(save_records(plain.records())))


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda p: setattr(p, "version_N", p.version_N[:-1]), "version_N has 11 entries for 12 route rows"),
        (
            lambda p: p.source_N.__setitem__(5, 7),
            "sample 1, row 1: route provenance source 7 is not one of 0..3",
        ),
        (
            lambda p: p.source_N.__setitem__(4, NONE),
            "sample 1, row 0: route provenance source none on a row with expert ids",
        ),
        (
            lambda p: p.version_N.__setitem__(6, 0),
            "sample 2, row 0: route provenance version 0 on a row with expert ids",
        ),
        (
            lambda p: setattr(p, "turn_N", p.turn_N.to(torch.int64)),
            "turn_N: torch.int64 (12,), expected torch.int16",
        ),
    ],
)
def test_ingest_checks_provenance_naming_sample_and_row(mutate, needle):
    routes = _with_prov(_random_routes([5, 3, 7]))
    mutate(routes.prov)
    with pytest.raises(RouteError, match=re.escape(needle)):
        validate(routes, torch.tensor([5, 3, 7]), HEADER)


def test_missing_rows_must_be_source_none_version_0():
    routes = _with_prov(_random_routes([5, 3]))
    routes.ids_NLK[2] = missing_id(HEADER.dtype)
    with pytest.raises(
        RouteError, match=re.escape("sample 0, row 2: route provenance source computed on a row with no ids")
    ):
        validate(routes, torch.tensor([5, 3]), HEADER)
    routes.prov.source_N[2], routes.prov.version_N[2], routes.prov.turn_N[2] = NONE, 0, 0
    validate(routes, torch.tensor([5, 3]), HEADER)


@pytest.mark.parametrize("policy", ["replay", "native", "drop_sample"])
def test_stale_policy_acts_on_exactly_the_rows_at_another_version(policy):
    routes = _random_routes([5, 4, 6])  # rows 4, 3, 5 at positions 0..
    N = routes.ids_NLK.shape[0]
    routes.prov = Provenance.computed(torch.full((N,), 2, dtype=torch.int32), turn=1)
    version_BS = torch.zeros(3, 6, dtype=torch.int32)
    version_BS[:, 2:] = 2  # tokens from position 2 sampled at version 2
    version_BS[0, 2] = 1  # sample 0's token 2 at version 1: its row (computed at 2) is stale
    version_BS[2, 3:5] = 1  # sample 2: two stale rows
    routes.prov.version_N[0] = 1  # a prompt row at another version: no log-prob there, not stale
    ids, keep_B, m = apply_stale_policy(
        routes.ids_NLK, routes.prov, routes.sample_N, routes.position_N, version_BS, policy, 255
    )
    assert m["routing/version_mismatch_rows"].value == 3.0
    stale = torch.zeros(N, dtype=torch.bool)
    stale[[2, 4 + 3 + 3, 4 + 3 + 4]] = True
    changed = (ids != routes.ids_NLK).any(-1).any(-1)
    assert torch.equal(changed, stale if policy == "native" else torch.zeros(N, dtype=torch.bool))
    if policy == "native":
        assert bool((ids[stale] == 255).all())
    assert keep_B.tolist() == ([False, True, False] if policy == "drop_sample" else [True] * 3)
    assert m["routing/stale_samples_dropped"].value == (2.0 if policy == "drop_sample" else 0.0)
