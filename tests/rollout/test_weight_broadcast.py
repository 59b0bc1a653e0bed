"""The weight broadcast's wire (moe_rl/pipeline/weight_broadcast.py) on a split world of 2 gloo ranks
(learner rank 0 the root, rollout rank 1), no megatron: bucketing gives the same bits at any
bucket size with the bucket count the chunk sizes give, a wrong version and an aborted stream are
one clear error each, and a root that stops mid-sync fails the receiver at the group's timeout
(2 s here), not a hang. In the engine's dtype: a bf16 engine is sent bf16 (the router and expert
bias fp32), exactly the bytes that gives, and its weights equal those of a load of the fp32 dict
bit for bit; an fp32 engine is sent fp32. The learner -> engine sync itself:
test_weight_broadcast_dist.py."""

from __future__ import annotations

import datetime
import math
import time

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.models import TINY_SIGMOID_L3 as MODEL
from tests.rollout.rank_results import packed, unpacked

TIMEOUT_S = 2.0
# bucket sizes: smaller than one tensor (and not a multiple of any element size), between, larger
# than a whole chunk
BUCKETS = (40, 1000, 1 << 20)


def _chunks() -> list[dict[str, torch.Tensor]]:
    """Three chunks of mixed dtypes and shapes (a scalar, a stacked-expert-like view, bf16)."""
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(4, 6, 5, generator=g)
    return [
        {"embed": torch.randn(13, 7, generator=g), "norm": torch.randn(7, generator=g).bfloat16()},
        {
            "a.w": torch.randn(9, 7, generator=g).bfloat16(),
            **{f"e.{i}.w": stacked[i] for i in range(4)},  # views of one tensor, as the stream yields
            "bias": torch.randn((), generator=g),
            "b.w": torch.randn(3, 7, generator=g).bfloat16(),
        },
        {"lm_head": torch.randn(11, 7, generator=g)},
    ]


ROUTER = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # the tensors engines keep in fp32


def _canonical_by_layer() -> list[dict[str, torch.Tensor]]:
    """The model's fp32 canonical weights, one chunk per decoder layer (and one for the rest), as
    the learner's stream cuts them."""
    from moe_rl.weights.canonical import random_canonical_weights

    chunks: dict[str, dict[str, torch.Tensor]] = {}
    for n, t in random_canonical_weights(MODEL, seed=3).items():
        key = n.split(".")[2] if n.startswith("model.layers.") else "rest"
        chunks.setdefault(key, {})[n] = t
    return list(chunks.values())


def _engine_dtype_wire(rank: int, sync) -> dict:
    """Root: the canonical model to a bf16 and to an fp32 engine. Receiver: a bf16 engine loaded
    from the stream against one loaded from the fp32 dict; what arrived for the fp32 engine."""
    from moe_rl.pipeline.weight_broadcast import broadcast_weights, receive_weights
    from moe_rl.rollout.builtin import BuiltinEngine

    chunks = _canonical_by_layer()
    if rank == 0:
        return {
            dt: broadcast_weights(chunks, sync, version=1, engine=d, bucket_bytes=4096)
            for dt, d in (("bf16", torch.bfloat16), ("fp32", torch.float32))
        }
    colocated, split = (BuiltinEngine(MODEL, dtype="bf16", pad_id=0) for _ in range(2))
    colocated.load_weights({n: t for c in chunks for n, t in c.items()})
    _, stream = receive_weights(sync)
    wire_dtypes: dict[str, str] = {}

    def seen(stream):
        for c in stream:
            wire_dtypes.update({n: str(t.dtype) for n, t in c.items()})
            yield c

    split.load_weights(seen(stream))
    _, stream = receive_weights(sync)
    fp32 = {n: t.clone() for c in stream for n, t in c.items()}
    sent = {n: t for c in chunks for n, t in c.items()}
    return {
        "bf16_wire_dtypes": wire_dtypes,
        "engine_tensors": sorted(colocated.model.w),
        "engine_differs": [n for n, t in colocated.model.w.items() if not torch.equal(t, split.model.w[n])],
        "engine_dtypes": {n: str(t.dtype) for n, t in split.model.w.items()},
        "fp32_differs": [n for n, t in sent.items() if not _same(fp32[n], t)],
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def expected_buckets(chunks: list[dict[str, torch.Tensor]], bucket_bytes: int) -> int:
    """Per chunk and dtype: ceil(elements / elements per bucket)."""
    n = 0
    for chunk in chunks:
        for dtype in {t.dtype for t in chunk.values()}:
            numel = sum(t.numel() for t in chunk.values() if t.dtype == dtype)
            per = max(1, bucket_bytes // dtype.itemsize)
            n += math.ceil(numel / per)
    return n


class Boom(RuntimeError):
    pass


def _raising(chunks, after: int):
    yield from chunks[:after]
    raise Boom("the learner's stream raised")


JOIN_S = 1.0  # the rollout rank joins the sync this late (one_step_off: it finishes its batch first)


def _late_join(rank: int, sync, chunks) -> dict:
    """Root: a whole split sync (``send_sync``: the run's last update, then the weights) to a
    rollout rank that joins JOIN_S late; its metrics. Receiver: what it was told and sent."""
    from moe_rl.pipeline.weight_broadcast import receive_weights
    from moe_rl.pipeline.weight_sync import send_sync, tell_last

    if rank == 0:
        return send_sync(sync, 7, chunks, version=20)
    time.sleep(JOIN_S)
    last = tell_last(sync)
    version, stream = receive_weights(sync)
    return {"last": last, "version": version, "chunks": len(list(stream))}


def _worker(rank: int):
    from moe_rl.pipeline.placement import init_placement
    from moe_rl.pipeline.weight_broadcast import (
        PendingWeights,
        WeightSender,
        WeightSyncError,
        broadcast_weights,
        receive_weights,
    )

    # a long timeout for the start (spawned ranks import for seconds), a short one for the sync
    place = init_placement(2, 1, "gloo", datetime.timedelta(seconds=120))
    place.sync.pg.set_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    sync, chunks = place.sync, _chunks()
    out: dict = {"engine_dtype": _engine_dtype_wire(rank, sync)}
    out["late_join"] = _late_join(rank, sync, chunks)
    if rank == 0:
        out["metrics"] = [
            broadcast_weights(chunks, sync, version=10 + i, bucket_bytes=b) for i, b in enumerate(BUCKETS)
        ]
        broadcast_weights(chunks, sync, version=4)  # the receiver expects 3
        try:
            broadcast_weights(_raising(chunks, 1), sync, version=5)
        except Boom as e:
            out["root_abort"] = str(e)
        sender = WeightSender(sync, version=6, bucket_bytes=100)
        for chunk in chunks[:2]:  # then stops: no end marker, and stays alive past the timeout
            sender.send(chunk)
        time.sleep(2.5 * TIMEOUT_S)
        return packed(out)
    out["received"] = []
    for _ in BUCKETS:
        version, stream = receive_weights(sync)
        out["received"].append((version, [dict(c) for c in stream]))
    try:
        PendingWeights().receive(sync, expect=3)
    except WeightSyncError as e:
        out["version_error"] = str(e)
    try:
        version, stream = receive_weights(sync)
        out["abort_got"] = [len(c) for c in stream]
    except WeightSyncError as e:
        out["abort_error"] = str(e)
    version, stream = receive_weights(sync)
    next(stream)
    try:
        receive_weights(sync)  # the stream above was left before its end
    except WeightSyncError as e:
        out["left_error"] = str(e)
    next(stream)
    t0 = time.perf_counter()
    try:
        next(stream)
    except WeightSyncError as e:
        out["truncated_error"] = str(e)
    out["truncated_s"] = time.perf_counter() - t0
    return packed(out)


@pytest.fixture(scope="module")
def ranks():
    return [unpacked(r) for r in run_ranks(_worker, 2)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.dist
def test_the_roots_wait_for_a_late_rollout_rank_is_the_syncs_wait(ranks):
    # the told update is the sync's first message: the root waits there, not at the first frame
    # (timed at the first frame alone, the wait came out ~0 s and the learner's busy share counted it)
    root, recv = ranks
    assert recv["late_join"] == {"last": 7, "version": 20, "chunks": 3}
    m = root["late_join"]
    assert m["weight_sync/version"] == 20
    assert 0.9 * JOIN_S <= m["time/weight_broadcast_wait_s"] <= m["time/weight_broadcast_s"]


@pytest.mark.dist
def test_every_bucket_size_gives_the_same_bits_and_the_counted_buckets(ranks):
    root, recv = ranks
    sent = _chunks()
    for (version, got), metrics, b in zip(recv["received"], root["metrics"], BUCKETS):
        assert version == metrics["weight_sync/version"]
        assert [list(c) for c in got] == [list(c) for c in sent]
        for c_got, c_sent in zip(got, sent):
            for n, t in c_sent.items():
                assert c_got[n].dtype == t.dtype and c_got[n].shape == t.shape
                assert torch.equal(_bits(c_got[n]), _bits(t)), (b, n)
        assert metrics["weight_sync/buckets"] == expected_buckets(sent, b)
        assert metrics["weight_sync/chunks"] == len(sent)  # one header per chunk
        assert metrics["weight_sync/bytes"] == sum(
            t.numel() * t.element_size() for c in sent for t in c.values()
        )
    # the sizes really split: a tensor over many buckets, and a chunk in one bucket per dtype
    assert [m["weight_sync/buckets"] for m in root["metrics"]] == [expected_buckets(sent, b) for b in BUCKETS]
    assert root["metrics"][0]["weight_sync/buckets"] > 3 * 10
    assert root["metrics"][2]["weight_sync/buckets"] == 5  # fp32 + bf16, fp32 + bf16, fp32


@pytest.mark.dist
def test_a_wrong_version_and_an_aborted_stream_are_one_line_errors(ranks):
    root, recv = ranks
    assert recv["version_error"] == "weight broadcast carried version 4, this rank expected 3"
    assert root["root_abort"] == "the learner's stream raised"
    assert recv["abort_error"] == "weight broadcast of version 5 aborted by the learner after 1 chunks"
    assert "abort_got" not in recv


@pytest.mark.dist
def test_a_stream_left_early_or_cut_short_fails_not_hangs(ranks):
    _, recv = ranks
    assert recv["left_error"] == (
        "the weight stream of version 6 was left after 1 chunks, before its end marker: "
        "read every stream to its end"
    )
    err = recv["truncated_error"]
    assert err.startswith("weight broadcast of version 6 broke off after 2 chunks, before its end marker (")
    assert "\n" not in err
    assert recv["truncated_s"] < TIMEOUT_S + 3  # the group's timeout, not a hang


@pytest.mark.dist
def test_the_wire_carries_the_engines_dtype_and_loads_the_same_bits(ranks):
    from moe_rl.weights.canonical import canonical_param_shapes

    root, recv = (r["engine_dtype"] for r in ranks)
    shapes = canonical_param_shapes(MODEL)
    router = [n for n in shapes if n.endswith(ROUTER)]
    assert len(router) == 2 * len(MODEL.moe_layers)  # the model has both: the test covers them
    numel = {n: math.prod(s) for n, s in shapes.items()}
    assert root["bf16"]["weight_sync/bytes"] == sum(numel[n] * (4 if n in router else 2) for n in shapes)
    assert root["fp32"]["weight_sync/bytes"] == 4 * sum(numel.values())
    wire = {n: "torch.float32" if n in router else "torch.bfloat16" for n in shapes}
    assert recv["bf16_wire_dtypes"] == wire
    # the split engine equals the one loaded from the fp32 dict, every tensor bit for bit
    assert recv["engine_differs"] == [] and len(recv["engine_tensors"]) > 10
    assert {d for n, d in recv["engine_dtypes"].items() if not n.endswith(ROUTER)} == {"torch.bfloat16"}
    assert recv["fp32_differs"] == []
