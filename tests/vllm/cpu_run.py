"""The vllm tier's shared CPU run (a helper module, no tests): one vLLM engine on the embedded
default architecture (vocabulary 50), its rollouts at T = 1 and T = 0.7 in bf16, the learner's R3
pass over them, one learner update and a weight sync from the learner's canonical layer stream
(``module_run``; the session fixture ``run`` of conftest.py), and the helpers of its tests."""

from __future__ import annotations

import dataclasses

import torch

from moe_rl.config import load_config
from moe_rl.routing.record import RouteBatch, RouteHeader
from tests.vllm.conftest import require_vllm

VOCAB = 50
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
N = 2
TEMPS = (1.0, 0.7)
# vLLM computes in bf16, the learner in fp32: the largest per-token log-prob gap seen on these
# rollouts was ~0.03 (docs/vllm.md 7); a sync that missed would leave gaps of ~1
LOGP_ATOL = 0.1
SYNC_MEAN_ATOL = 0.03  # mean over all scored tokens, native routes on both sides (seen: ~0.01)


def cpu_cfg(*extra: str):
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "parallel.nproc=1",
            "parallel.expert_parallel=1",
        ]
        + list(extra),
    )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))


def start_engine(cfg, weights):
    require_vllm()
    from moe_rl.rollout.vllm.engine import VllmEngine

    engine = VllmEngine(cfg, cfg.model, pad_id=0)
    engine.load_weights(weights)
    return engine


def sampling_at(T: float):
    from moe_rl.types import SamplingParams

    return SamplingParams(max_new_tokens=8, temperature=T, stop_token_ids=(3,))


def score_seqs(engine, tokens: list[list[int]]) -> list[list[float]]:
    """vLLM's log-prob of every token after the first of each sequence (prompt log-probs, T = 1)."""
    import vllm

    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": t} for t in tokens], sp, use_tqdm=False)
    return [
        [float(d[t].logprob) for d, t in zip(o.prompt_logprobs[1:], seq[1:])] for o, seq in zip(outs, tokens)
    ]


def joined_batch(batches, header: RouteHeader):
    """Sequences of several RolloutBatches as one learner batch: tokens_BS (pad 0), lengths,
    response mask and the routes as one RouteBatch (ingest-checked by rollout_routes)."""
    from moe_rl.step.prepare import rollout_routes

    seqs, masks, routes = [], [], []
    for b in batches:
        lens_B = b.prompt_lens_B + b.response_lens_B
        seqs += [b.tokens_BS[i, : int(lens_B[i])] for i in range(b.num_seqs)]
        masks += [b.response_mask_BS[i, : int(lens_B[i])] for i in range(b.num_seqs)]
        routes.append(rollout_routes(b, header))
    S, B = max(len(s) for s in seqs), len(seqs)
    tokens_BS = torch.zeros((B, S), dtype=torch.int64)
    mask_BS = torch.zeros((B, S), dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        tokens_BS[i, : len(s)], mask_BS[i, : len(s)] = s, m
    joined = RouteBatch(
        torch.cat([r.ids_NLK for r in routes]),
        torch.cat([r.rows_B for r in routes]),
        torch.cat([r.start_B for r in routes]),
        torch.cat([r.prompt_len_B for r in routes]),
        header,
    )
    return tokens_BS, torch.tensor([len(s) for s in seqs]), mask_BS, joined


def module_run(tmp_path_factory) -> dict:
    """Everything the module checks, computed once (see the module docstring)."""
    from moe_rl.weights.canonical import random_canonical_weights
    from tests.dist_harness import run_ranks
    from tests.vllm.learner_ref import learner_side

    cfg = cpu_cfg()
    weights = random_canonical_weights(cfg.model, seed=1)
    engine = start_engine(cfg, weights)
    header = RouteHeader.for_model(cfg.model)
    batches = {T: engine.generate(PROMPTS, N, sampling_at(T), seed=3) for T in TEMPS}
    tokens_BS, lens_B, mask_BS, routes = joined_batch([batches[T] for T in TEMPS], header)
    seqs = [tokens_BS[i, : int(lens_B[i])].tolist() for i in range(len(lens_B))]
    score_old = score_seqs(engine, seqs)
    out = str(tmp_path_factory.mktemp("learner") / "ref.pt")
    run_ranks(learner_side, 1, cfg.model, weights, tokens_BS, lens_B, mask_BS, routes, TEMPS, out)
    ref = torch.load(out)
    version_before = engine.versions.current
    engine.load_weights(iter(ref["chunks"]))  # the learner's canonical layer stream, chunk by chunk
    return dict(
        cfg=cfg,
        engine=engine,
        header=header,
        batches=batches,
        tokens_BS=tokens_BS,
        lens_B=lens_B,
        mask_BS=mask_BS,
        routes=routes,
        seqs=seqs,
        score_old=score_old,
        score_new=score_seqs(engine, seqs),
        ref=ref,
        version_before=version_before,
    )
