"""In-flight weight updates in the built-in engine (docs/design.md 15.1): the version of every
generated token, its log-prob and its route row come from one forward pass under both KV modes,
checked against independent no-cache forwards; determinism; no update == plain generate."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import ConfigError, ModelConfig, load_config
from moe_rl.rollout.base import ScheduledUpdates, UpdateSource
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.rollout.builtin_model import BuiltinMoEModel, KVCache
from moe_rl.types import RolloutBatch, SamplingParams
from moe_rl.weights.canonical import random_canonical_weights
from tests.models import ODD_MLA_YARN, hf_tiny

pytestmark = pytest.mark.unit

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7], [2]]
PAD_ID = 0
TEMP = 0.9
SAMPLING = SamplingParams(max_new_tokens=8, temperature=TEMP, stop_token_ids=(4,))
LOGP_ATOL = 2e-5  # fp32 engine vs an fp32 no-cache forward of another batch shape


# MLA's cache holds the latent, so its re-prefill and mixed cache are a different code path
MLA = dict(ODD_MLA_YARN, qk_layernorm=False, rope_original_max_position=16)


@pytest.fixture(scope="module", params=["gqa", "mla"])
def arch(request, cfg: ModelConfig) -> ModelConfig:
    return cfg if request.param == "gqa" else hf_tiny(**MLA)


@pytest.fixture(scope="module")
def arch_versions(arch: ModelConfig) -> dict[int, dict[str, torch.Tensor]]:
    return {v: random_canonical_weights(arch, seed=1234 + 17 * v) for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def versions(cfg: ModelConfig) -> dict[int, dict[str, torch.Tensor]]:
    """Weight versions 1..3: unrelated random weights, so a wrong version shows in every token."""
    return {v: random_canonical_weights(cfg, seed=1234 + 17 * v) for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def models(arch: ModelConfig, arch_versions) -> dict[int, BuiltinMoEModel]:
    out = {}
    for v, w in arch_versions.items():
        out[v] = BuiltinMoEModel(arch, torch.float32)
        out[v].load_canonical(w)
    return out


def engine(cfg: ModelConfig, versions, kv: str) -> BuiltinEngine:
    e = BuiltinEngine(cfg, dtype="fp32", pad_id=PAD_ID, inflight_kv=kv)
    e.load_weights(versions[1])
    assert e.version == 1
    return e


def token_logp(logits_TV: torch.Tensor, tokens_T: torch.Tensor) -> torch.Tensor:
    """log p(token t | < t) for t >= 1 from next-token logits, at the sampling temperature: [T - 1]."""
    return torch.log_softmax(logits_TV[:-1] / TEMP, -1).gather(-1, tokens_T[1:, None])[:, 0]


def full_forward(model: BuiltinMoEModel, tokens_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """No-cache forward of one unpadded sequence: (log-probs of tokens 1.. [T-1], routes rows [T-1, L, K])."""
    T = tokens_T.shape[0]
    out = model.forward(tokens_T[None], torch.arange(T)[None], torch.ones((1, T), dtype=torch.bool))
    return token_logp(out.logits[0], tokens_T), out.expert_ids_BTLK[0, :-1]


def per_sample(batch: RolloutBatch, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample b's tokens [T], recorded log-probs of tokens 1.. [T-1], routes [T-1, L, K], versions [T-1]."""
    T = int(batch.prompt_lens_B[b] + batch.response_lens_B[b])
    return (
        batch.tokens_BS[b, :T],
        batch.logprobs_BS[b, 1:T],
        batch.routes[b].long(),
        batch.version_BS[b, 1:T],
    )


def expected_versions(batch: RolloutBatch, schedule: dict[int, int]) -> torch.Tensor:
    """version_BS the schedule implies: generated token j comes from forward j, which polls j
    first; schedule = {poll: version}, the engine at version 1 before any."""
    G = int(batch.response_lens_B.max())
    v_G = torch.ones(G, dtype=torch.int32)
    for poll, v in sorted(schedule.items()):
        v_G[poll:] = v
    S = batch.tokens_BS.shape[1]
    j_BS = torch.arange(S)[None, :] - batch.prompt_lens_B[:, None]
    return torch.where(batch.response_mask_BS, v_G[j_BS.clamp(0, G - 1)], 0).to(torch.int32)


def test_recompute_logprobs_and_routes_of_each_version_equal_that_versions_full_forward(
    arch: ModelConfig, arch_versions, models
) -> None:
    """inflight_kv=recompute, updates at polls 3 and 5: every generated token's log-prob and route
    row equal a no-cache forward of the whole sequence at the version version_BS names; the
    re-prefill's routes of earlier tokens (which a later version routes differently) were not kept."""
    schedule = {3: 2, 5: 3}
    eng = engine(arch, arch_versions, "recompute")
    batch = eng.generate(
        PROMPTS,
        2,
        SAMPLING,
        seed=5,
        updates=ScheduledUpdates({k: (v, arch_versions[v]) for k, v in schedule.items()}),
    )
    assert eng.version == 3 and batch.version_BS.dtype == torch.int32
    assert torch.equal(batch.version_BS, expected_versions(batch, schedule))
    counts = {v: 0 for v in (1, 2, 3)}
    later_route_diffs = 0  # rows an overwrite by a later re-prefill would have changed
    for b in range(batch.num_seqs):
        tokens_T, logp_T, routes_T, ver_T = per_sample(batch, b)
        for v in (1, 2, 3):
            ref_logp, ref_routes = full_forward(models[v], tokens_T)
            mine = ver_T == v
            counts[v] += int(mine.sum())
            assert torch.equal(routes_T[mine], ref_routes[mine]), f"sample {b} version {v}"
            torch.testing.assert_close(logp_T[mine], ref_logp[mine], atol=LOGP_ATOL, rtol=0)
            older = (ver_T > 0) & (ver_T < v)
            later_route_diffs += int((routes_T[older] != ref_routes[older]).any(-1).any(-1).sum())
    assert min(counts.values()) >= 8, counts  # every version produced tokens
    assert later_route_diffs >= 10, later_route_diffs  # so the test sees an overwrite


def test_keep_mixes_caches_and_recorded_values_are_the_mixed_forwards(
    arch: ModelConfig, arch_versions, models
) -> None:
    """inflight_kv=keep, update at poll 3: version-1 tokens equal the version-1 full forward; the
    version-2 tokens equal neither full forward, but a forward at version 2 over a cache of the
    prefix built at version 1 (slots fed before the update), computed here one sequence at a time."""
    k = 3
    eng = engine(arch, arch_versions, "keep")
    batch = eng.generate(PROMPTS, 2, SAMPLING, seed=5, updates=ScheduledUpdates({k: (2, arch_versions[2])}))
    assert torch.equal(batch.version_BS, expected_versions(batch, {k: 2}))
    gaps = {1: [], 2: []}  # max |recorded - full forward at v| over the version-2 tokens
    n_new = 0
    for b in range(batch.num_seqs):
        tokens_T, logp_T, routes_T, ver_T = per_sample(batch, b)
        old, new = ver_T == 1, ver_T == 2
        ref_logp, ref_routes = full_forward(models[1], tokens_T)
        assert torch.equal(routes_T[old], ref_routes[old]), f"sample {b}"
        torch.testing.assert_close(logp_T[old], ref_logp[old], atol=LOGP_ATOL, rtol=0)
        if not new.any():
            continue  # stopped before the update
        n_new += int(new.sum())
        for v in (1, 2):
            gaps[v].append(float((logp_T[new] - full_forward(models[v], tokens_T)[0][new]).abs().max()))
        # the mixed reference: forward k (the first at version 2) feeds slot p + k - 1
        T, cut = tokens_T.shape[0], int(batch.prompt_lens_B[b]) + k - 1
        cache = KVCache.allocate(arch, 1, T, torch.float32, "cpu")
        ones = torch.ones((1, T), dtype=torch.bool)
        models[1].forward(tokens_T[None, :cut], torch.arange(cut)[None], ones[:, :cut], cache)
        out = models[2].forward(tokens_T[None, cut:], torch.arange(cut, T)[None], ones, cache)
        assert torch.equal(new, torch.arange(T - 1) >= cut)  # token cut + 1 on: rows cut on
        assert torch.equal(routes_T[cut:], out.expert_ids_BTLK[0, :-1]), f"sample {b}"
        torch.testing.assert_close(
            logp_T[cut:], token_logp(out.logits[0], tokens_T[cut:]), atol=LOGP_ATOL, rtol=0
        )
    assert n_new >= 10
    # the mixed cache is a third policy, far from both full forwards (measured: 4.75 and 3.04 nats)
    assert min(max(gaps[1]), max(gaps[2])) > 1.0, gaps


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_same_seed_and_schedule_give_the_same_batch_bit_for_bit(cfg: ModelConfig, versions, kv: str) -> None:
    def run(poll: int) -> RolloutBatch:
        return engine(cfg, versions, kv).generate(
            PROMPTS, 3, SAMPLING, seed=9, updates=ScheduledUpdates({poll: (2, versions[2])})
        )

    a, b, c = run(2), run(2), run(4)
    for name in ("tokens_BS", "logprobs_BS", "version_BS"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes))
    assert not torch.equal(a.version_BS, c.version_BS)


class Counting:
    """An UpdateSource that never delivers and counts its polls."""

    def __init__(self) -> None:
        self.polls = 0

    def poll(self) -> None:
        self.polls += 1
        return None


def test_no_update_is_plain_generate_and_polls_once_per_forward(cfg: ModelConfig, versions) -> None:
    eng = engine(cfg, versions, "recompute")
    plain = eng.generate(PROMPTS, 2, SAMPLING, seed=3)
    source = Counting()
    assert isinstance(source, UpdateSource)
    polled = eng.generate(PROMPTS, 2, SAMPLING, seed=3, updates=source)
    for name in ("tokens_BS", "logprobs_BS", "version_BS", "response_lens_B", "finished_B"):
        assert torch.equal(getattr(plain, name), getattr(polled, name)), name
    assert all(torch.equal(x, y) for x, y in zip(plain.routes, polled.routes))
    assert torch.equal(plain.version_BS, plain.response_mask_BS.int())  # version 1, 0 elsewhere
    assert source.polls == int(plain.response_lens_B.max())  # one forward per sampled step

    # an update due after the last forward stays with its source
    late = ScheduledUpdates({source.polls: (2, versions[2])})
    eng.generate(PROMPTS, 2, SAMPLING, seed=3, updates=late)
    assert eng.version == 1 and late.polls == source.polls


def test_update_at_poll_0_is_a_load_before_the_prefill(cfg: ModelConfig, versions) -> None:
    moved = engine(cfg, versions, "keep").generate(
        PROMPTS, 2, SAMPLING, seed=4, updates=ScheduledUpdates({0: (2, versions[2])})
    )
    fresh = BuiltinEngine(cfg, dtype="fp32", pad_id=PAD_ID)
    fresh.load_weights(versions[2], version=2)
    plain = fresh.generate(PROMPTS, 2, SAMPLING, seed=4)
    for name in ("tokens_BS", "logprobs_BS", "version_BS"):
        assert torch.equal(getattr(moved, name), getattr(plain, name)), name
    assert all(torch.equal(x, y) for x, y in zip(moved.routes, plain.routes))


def test_versions_must_increase_and_a_bad_update_changes_nothing(cfg: ModelConfig, versions) -> None:
    eng = engine(cfg, versions, "keep")
    with pytest.raises(ValueError, match="weight version 1: the engine is at version 1"):
        eng.generate(PROMPTS, 1, SAMPLING, seed=0, updates=ScheduledUpdates({2: (1, versions[2])}))
    with pytest.raises(ValueError, match="must be >= 1"):
        eng.load_weights(versions[2], version=0)
    bad = dict(versions[2])
    bad.pop("model.norm.weight")
    with pytest.raises(Exception, match="model.norm.weight"):
        eng.generate(PROMPTS, 1, SAMPLING, seed=0, updates=ScheduledUpdates({2: (2, bad)}))
    assert eng.version == 1  # the dict was refused whole: weights and version as before
    again = eng.generate(PROMPTS, 1, SAMPLING, seed=0)
    ref = engine(cfg, versions, "keep").generate(PROMPTS, 1, SAMPLING, seed=0)
    assert torch.equal(again.tokens_BS, ref.tokens_BS) and torch.equal(again.logprobs_BS, ref.logprobs_BS)


def test_inflight_kv_config_key() -> None:
    assert load_config(None, []).rollout.inflight_kv == "keep"
    with pytest.raises(ConfigError, match="config key 'rollout.inflight_kv': 'redo' is not one of"):
        load_config(None, ["rollout.inflight_kv=redo"])
    with pytest.raises(ConfigError, match="config key 'rollout.inflight_kv': recompute acts on in-flight"):
        load_config(None, ["rollout.inflight_kv=recompute"])
    async_split = ["rollout.mode=async", "parallel.nproc=3", "parallel.rollout_ranks=1"]
    assert (
        load_config(None, [*async_split, "rollout.inflight_kv=recompute"]).rollout.inflight_kv == "recompute"
    )
    # vLLM takes in-flight updates keeping the KV (keep, the default); its re-prefill is not built
    vllm_async = [*async_split, "rollout.engine=vllm"]
    assert load_config(None, vllm_async).rollout.inflight_kv == "keep"
    with pytest.raises(ConfigError, match="config key 'rollout.inflight_kv': recompute: vLLM's in-flight"):
        load_config(None, [*vllm_async, "rollout.inflight_kv=recompute"])
    # and with an engine of 2 TP ranks, whose ranks agree on each update (docs/design.md 15.1)
    tp2 = [*vllm_async, "parallel.rollout_ranks=2", "parallel.expert_parallel=1"]
    assert load_config(None, [*tp2, "rollout.vllm.tensor_parallel=2"]).rollout.vllm.tensor_parallel == 2


def test_long_tail_rows_ignore_the_stop_tokens_and_leave_the_other_rows_as_they_were(cfg, versions):
    """rollout.long_tail_frac (a lab/bench instrument, docs/design.md 15.3): ceil(frac * B) rows,
    picked by the seed, run to max_new_tokens past their stop tokens; every other row is the plain
    call's (the sampling stream is unchanged), so only the tail is longer."""
    eng = engine(cfg, versions, "keep")
    stop = SamplingParams(max_new_tokens=12, temperature=3.0, stop_token_ids=(4, 5, 6, 7, 8))
    plain = eng.generate(PROMPTS, 2, stop, seed=5)
    tail_sp = SamplingParams(
        max_new_tokens=12, temperature=3.0, stop_token_ids=(4, 5, 6, 7, 8), long_tail_frac=0.2
    )
    tail = eng.generate(PROMPTS, 2, tail_sp, seed=5)
    long_B = tail.response_lens_B == 12
    assert int((tail.response_lens_B != plain.response_lens_B).sum()) >= 1  # a tail row did stop before
    assert int((~tail.finished_B).sum()) >= 2 and bool((tail.response_lens_B[~tail.finished_B] == 12).all())
    rows = torch.nonzero(tail.response_lens_B != plain.response_lens_B)[:, 0]
    assert bool(long_B[rows].all()) and rows.numel() <= 2  # ceil(0.2 * 8) = 2 rows ignore eos
    keep = [b for b in range(8) if b not in rows.tolist()]
    n = plain.tokens_BS.shape[1]
    assert torch.equal(tail.tokens_BS[keep, :n], plain.tokens_BS[keep])
    # the tail rows feed tokens where they fed pad: other expert groupings, float-close log-probs
    assert torch.allclose(tail.logprobs_BS[keep, :n], plain.logprobs_BS[keep], atol=LOGP_ATOL, rtol=0)
    for b in rows.tolist():  # the tail row's first tokens, up to its old stop, are the plain call's
        m = int(plain.prompt_lens_B[b] + plain.response_lens_B[b])
        assert torch.equal(tail.tokens_BS[b, :m], plain.tokens_BS[b, :m])
    assert torch.equal(eng.generate(PROMPTS, 2, tail_sp, seed=5).tokens_BS, tail.tokens_BS)  # seeded


def test_long_tail_frac_config_key() -> None:
    assert load_config(None, []).rollout.long_tail_frac == 0.0
    with pytest.raises(ConfigError, match=r"config key 'rollout.long_tail_frac': must be in \[0, 1\]"):
        load_config(None, ["rollout.long_tail_frac=1.5"])
    with pytest.raises(ConfigError, match="config key 'rollout.long_tail_frac': 0.5 is a built-in engine"):
        load_config(None, ["rollout.long_tail_frac=0.5", "rollout.engine=vllm"])


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_route_provenance_names_each_rows_version_and_the_reprefilled_row(arch, arch_versions, kv) -> None:
    """Update at poll 3: row t carries the version of the forward that fed token t (rows from
    p + 2 on: version 2); the row of generated token 2 (sampled at version 1, fed by the first
    version-2 forward) is the one stale row per sample (issue 44.4), and under recompute it is the
    re-prefill's row (source REPREFILL), every other row COMPUTED."""
    from moe_rl.routing.provenance import COMPUTED, REPREFILL, stale_rows_N

    k = 3
    eng = engine(arch, arch_versions, kv)
    batch = eng.generate(PROMPTS, 2, SAMPLING, seed=5, updates=ScheduledUpdates({k: (2, arch_versions[2])}))
    n_stale = 0
    for b in range(batch.num_seqs):
        prov, T = batch.route_prov[b], int(batch.prompt_lens_B[b] + batch.response_lens_B[b])
        cut = int(batch.prompt_lens_B[b]) + k - 1
        assert prov.num_rows == T - 1 and prov.turn_N.tolist() == [0] * (T - 1)
        assert torch.equal(prov.version_N, torch.where(torch.arange(T - 1) >= cut, 2, 1).to(torch.int32))
        src = torch.full((T - 1,), COMPUTED, dtype=torch.uint8)
        if kv == "recompute" and cut < T - 1:
            src[cut] = REPREFILL
        assert torch.equal(prov.source_N, src), f"sample {b}"
        stale = stale_rows_N(
            prov, torch.zeros(T - 1, dtype=torch.long), torch.arange(T - 1), batch.version_BS[b : b + 1]
        )
        assert stale.nonzero().flatten().tolist() == ([cut] if cut < T - 1 else [])
        n_stale += int(stale.sum())
    assert n_stale >= 4
