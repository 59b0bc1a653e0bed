"""The learner -> rollout rank weight broadcast on a split world of 3 gloo ranks: learner ranks 0-1
(the megatron learner, EP=2) and rollout rank 2 (a built-in engine in fp32), built by
``init_distributed`` as a run builds them.

After each sync the engine's weights equal ``learner.export_canonical()`` bit for bit and its
log-probs of a fixed sequence equal the learner's old-log-prob pass within LOGP_TOL (the two fp32
forwards differ in summation order only); after optimizer steps without a sync (a missed sync) they
differ by more than 100 x LOGP_TOL, and a sync of an unexpected version is refused. A sync
received in the background changes nothing the engine computes until ``apply``."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from moe_rl.types import TrainBatch
from tests.dist_harness import run_ranks
from tests.models import TINY_MOE_L3 as MODEL
from tests.rollout.rank_results import digests, packed, unpacked

LOGP_TOL = 1e-5
SMALL_BUCKET = 1000  # bytes: smaller than most tensors of the model; the default is larger than a layer
PAR = ParallelConfig(nproc=3, rollout_ranks=1, expert_parallel=2, distributed_optimizer=False)


def _sequence() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tokens_BS = torch.randint(3, MODEL.vocab_size, (3, 12), generator=g)
    return tokens_BS, torch.full((3,), 12)


def engine_logprobs(engine, tokens_BS: torch.Tensor) -> torch.Tensor:
    """log p(token s | tokens < s) under the engine, [B, S] (position 0 has none: 0), as the
    learner's ``logp_BS`` lays them out."""
    B, S = tokens_BS.shape
    pos_BS = torch.arange(S).expand(B, S)
    logits_BSV = engine.model.forward(tokens_BS, pos_BS, torch.ones(B, S, dtype=torch.bool)).logits
    logp_BS = torch.log_softmax(logits_BSV[:, :-1], -1).gather(-1, tokens_BS[:, 1:, None])[..., 0]
    return torch.cat([logp_BS.new_zeros(B, 1), logp_BS], 1)


def _nll(mb, st, normalizer):
    return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}


def _learner_rank(dims, rank: int) -> dict:
    from moe_rl.learner.learner import Learner
    from moe_rl.pipeline.weight_broadcast import broadcast_weights
    from moe_rl.weights.canonical import random_canonical_weights

    learner = Learner(MODEL, PAR, OptimConfig(lr=1e-2), dims, random_canonical_weights(MODEL, seed=0))
    tokens_BS, lens_B = _sequence()
    out: dict = {"metrics": []}

    def sync(version: int, bucket_bytes: int = 64 << 20) -> None:
        chunks = learner.iter_canonical_layers()
        if rank == 0:
            out["metrics"].append(broadcast_weights(chunks, dims.placement.sync, version, bucket_bytes))
        else:
            for _ in chunks:  # the other learner ranks take part in the stream's gathers
                pass

    def logp() -> torch.Tensor:
        return learner.forward_logprobs(TrainBatch(tokens_BS, lens_B), 1.0, micro_batch_size=3).stats.logp_BS

    def step() -> None:
        mask_BS = torch.ones_like(tokens_BS, dtype=torch.bool)
        learner.update(TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS), _nll, 1.0, 3, lr=1e-2)

    sync(1, SMALL_BUCKET)
    export = learner.export_canonical()
    out["logp_v1"], out["export_v1"] = logp(), digests(export)
    out["nbytes"] = sum(t.numel() * t.element_size() for t in export.values())
    del export
    step()  # version 2, not synced: the engine keeps version 1
    out["logp_v2"] = logp()
    step()
    sync(3)  # the engine expects 2 (it missed nothing it knows of): refused
    sync(3)  # in the background, applied after one stale check
    out["logp_v3"], out["export_v3"] = logp(), digests(learner.export_canonical())
    return out if rank == 0 else {}


def _rollout_rank(dims) -> dict:
    from moe_rl.pipeline.weight_broadcast import PendingWeights, WeightSyncError
    from moe_rl.rollout.builtin import BuiltinEngine

    engine = BuiltinEngine(MODEL, dtype="fp32", pad_id=0)
    pending = PendingWeights()
    tokens_BS, _ = _sequence()
    group = dims.placement.sync

    def weights() -> dict[str, tuple]:
        return digests(engine.model._slots)

    out: dict = {}
    pending.receive(group, expect=1)
    out["applied_v1"] = pending.apply(engine)
    out["logp_v1"], out["weights_v1"] = engine_logprobs(engine, tokens_BS), weights()
    try:
        pending.receive(group, expect=pending.version + 1)
    except WeightSyncError as e:
        out["version_error"] = str(e)
    out["ready_after_refusal"] = pending.ready
    pending.receive_in_background(group, expect=3)
    pending.wait()  # received in full, not applied: the engine still samples with version 1
    out["ready"], out["logp_staged"] = pending.ready, engine_logprobs(engine, tokens_BS)
    out["applied_v3"] = pending.apply(engine)
    out["apply_again"] = pending.apply(engine)
    out["logp_v3"], out["weights_v3"] = engine_logprobs(engine, tokens_BS), weights()
    return out


def _worker(rank: int) -> bytes:
    from megatron.core import parallel_state as ps

    from moe_rl import dist

    dims = dist.init_distributed(PAR, seed=7)
    if dims.is_rollout:
        return packed(_rollout_rank(dims))
    out = _learner_rank(dims, rank)
    ps.destroy_model_parallel()
    return packed(out)


@pytest.fixture(scope="module")
def ranks():
    learner, _, rollout = [unpacked(r) for r in run_ranks(_worker, 3)]
    return learner, rollout


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b)[:, 1:].abs().max())


@pytest.mark.dist
def test_after_a_sync_the_engine_holds_the_learners_weights_bit_for_bit(ranks):
    learner, rollout = ranks
    assert rollout["applied_v1"] == 1 and rollout["applied_v3"] == 3 and rollout["apply_again"] is None
    for v in ("v1", "v3"):
        export, engine = learner[f"export_{v}"], rollout[f"weights_{v}"]
        assert sorted(engine) == sorted(export)
        assert engine == export, v  # dtype, shape and the bytes' digest of every tensor
        assert _max_diff(rollout[f"logp_{v}"], learner[f"logp_{v}"]) < LOGP_TOL
    # the two sizes really bucket differently: many buckets per layer, then one per dtype and chunk
    small, refused, large = learner["metrics"]
    assert small["weight_sync/chunks"] == large["weight_sync/chunks"] == MODEL.num_layers + 2
    assert large["weight_sync/buckets"] == large["weight_sync/chunks"]  # all fp32: one bucket each
    assert small["weight_sync/buckets"] > 5 * large["weight_sync/buckets"]
    nbytes = learner["nbytes"]
    assert small["weight_sync/bytes"] == large["weight_sync/bytes"] == refused["weight_sync/bytes"] == nbytes


@pytest.mark.dist
def test_a_missed_sync_fails_the_check_and_a_wrong_version_is_refused(ranks):
    learner, rollout = ranks
    # the learner stepped twice without a sync: the engine's log-probs are version 1's
    assert _max_diff(rollout["logp_staged"], learner["logp_v3"]) > 100 * LOGP_TOL
    assert _max_diff(rollout["logp_v1"], learner["logp_v2"]) > 100 * LOGP_TOL
    assert torch.equal(rollout["logp_staged"], rollout["logp_v1"])  # received, not yet applied
    assert rollout["ready"] and not rollout["ready_after_refusal"]
    assert rollout["version_error"] == "weight broadcast carried version 3, this rank expected 2"
