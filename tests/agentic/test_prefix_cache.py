"""unit tier, issue 44 point 3: the built-in engine's prefix cache across turns. A multi-turn
rollout through the cache gives the same tokens, log-probs, versions and route rows as the no-cache
path (each turn re-prefills the whole sequence), each later turn prefills only what its blocks do not
hold, the route rows each turn appends are exactly its new tokens, the LRU bound holds (with
eviction, the outputs are still the same) and a weight load drops the cache."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.rollout.prefix_cache import PrefixCachedEngine, block_bytes
from moe_rl.step.plan import sampling_params
from moe_rl.tasks.task import build_task
from moe_rl.weights.warmstart import load_init_weights

pytestmark = pytest.mark.unit
BLOCK = 4
LOGP_ATOL = 2e-5  # fp32, another batch shape (as tests/rollout/test_inflight.py)


@pytest.fixture(scope="module")
def runs():
    # the agent warm start's calls take up to 12 tokens: 8 would cut every call and no turn 2 runs
    cfg = load_config(None, ["agent.env=calculator", "rollout.max_new_tokens=12", "agent.max_turns=3"])
    cfg, task = build_task(cfg, start_pool=False)
    weights = load_init_weights(cfg.init_weights, cfg.model, task.tokenizer)
    prompts = task.source.sample_step(0, 2, 0, 1, 7)
    sampling = sampling_params(cfg, task.tokenizer.eos_ids)
    engines = {
        "none": BuiltinEngine(cfg.model, dtype="fp32", pad_id=task.tokenizer.pad_id),
        "big": PrefixCachedEngine(
            cfg.model, max_blocks=1000, block_tokens=BLOCK, dtype="fp32", pad_id=task.tokenizer.pad_id
        ),
        "tiny": PrefixCachedEngine(
            cfg.model, max_blocks=3, block_tokens=BLOCK, dtype="fp32", pad_id=task.tokenizer.pad_id
        ),
    }
    out = {}
    for name, eng in engines.items():
        eng.load_weights(weights)
        out[name] = task.agent.rollout(eng, prompts, 3, sampling, 11)
    return cfg, engines, out, weights


def _end_of_turn(b, k):
    """[B] the position after turn k's last sampled token (turn 0: 1, so turn 1's rows start at 0)."""
    if k == 0:
        return torch.ones_like(b.prompt_lens_B)
    turn_BS = b.turn_BS.long()
    return (
        b.prompt_lens_B
        + (b.response_mask_BS & (turn_BS <= k) & (turn_BS >= 1)).sum(1)
        + (~b.response_mask_BS & (turn_BS >= 1) & (turn_BS < k)).sum(1)
    )


@pytest.mark.parametrize("name", ["big", "tiny"])
def test_cached_turns_equal_the_full_reprefill_bit_for_bit(runs, name):
    _, _, out, _ = runs
    a, b = out["none"], out[name]
    assert torch.equal(a.tokens_BS, b.tokens_BS) and torch.equal(a.response_mask_BS, b.response_mask_BS)
    # log-probs: equal to fp32 rounding, not bit for bit: the cached path prefills one prompt at a
    # time and the new tokens alone, the no-cache path all prompts at once, and CPU matmuls are not
    # batch-shape invariant (turn 1, no cache read yet, already differs by ~1e-6)
    torch.testing.assert_close(a.logprobs_BS, b.logprobs_BS, atol=LOGP_ATOL, rtol=0)
    assert torch.equal(a.version_BS, b.version_BS) and torch.equal(a.turn_BS, b.turn_BS)
    assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes))
    for x, y in zip(a.route_prov, b.route_prov):
        assert all(torch.equal(s, t) for s, t in zip(x.tensors().values(), y.tensors().values()))
    assert int(a.turn_BS.max()) >= 2  # a second turn ran (else the cache was never read)


def test_each_turn_prefills_only_uncached_tokens_and_sends_only_new_rows(runs):
    cfg, engines, out, _ = runs
    b, eng = out["big"], engines["big"]
    T_B = b.prompt_lens_B + b.response_lens_B
    saved = 0
    for k in range(1, int(b.turn_BS.max()) + 1):
        # rows sent by turn k = its new tokens (reply + sampled), never an earlier row again
        rows_B = torch.tensor([int((p.turn_N == k).sum()) for p in b.route_prov])
        end_B = torch.minimum(_end_of_turn(b, k), T_B)
        went_B = _end_of_turn(b, k - 1) < T_B
        assert torch.equal(rows_B[went_B], (end_B - _end_of_turn(b, k - 1))[went_B]), f"turn {k}"
        assert int(rows_B[~went_B].sum()) == 0
        # the engine's prefill of turn k: each sequence's cached part is every full block of what turn
        # k - 1 fed (its tokens but the last), the rest is prefilled
        log = eng.prefill_log[k - 1]
        prev_fed_B = (_end_of_turn(b, k - 1) - 1)[went_B]
        want = [(BLOCK * (int(f) // BLOCK)) if k > 1 else 0 for f in prev_fed_B]
        assert [c for _, c in log] == want, f"turn {k}"
        saved += sum(want)
    assert saved > 0
    assert len(eng.prefix.blocks) <= 1000 and eng.prefix.evicted == 0


def test_lru_bound_and_a_weight_load_drops_the_cache(runs):
    cfg, engines, out, weights = runs
    tiny = engines["tiny"]
    assert len(tiny.prefix.blocks) == 3 and tiny.prefix.evicted > 0
    per_block = block_bytes(cfg.model, BLOCK, 4)
    held = sum(
        sum(t.numel() * t.element_size() for t in (*blk.k, *blk.v, blk.routes_TLK, blk.version_T))
        for blk in tiny.prefix.blocks.values()
    )
    assert held == 3 * per_block
    tiny.load_weights(weights)
    assert len(tiny.prefix.blocks) == 0 and tiny.version == 2
