"""moe_rl/rollout/vllm/dvp_processor.py: DVP's logits processor masks to the safe set, and the safe
sets come back from the processed top-k log-probs (vllm 0.33.0: vllm/v1/worker/gpu/sample/
{sampler,logprob}.py, vllm/v1/worker/gpu/sample/logits_processor/interface.py, vllm/logprobs.py)."""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.config.vllm_rules import logprobs_mode
from moe_rl.corrections.correction_specs import DvpSpec
from moe_rl.rollout.vllm import engine, env
from moe_rl.rollout.vllm.dvp_processor import (
    DVP_ARG,
    DVP_PROCESSOR,
    apply_dvp,
    dvp_num_logprobs,
    dvp_params,
    dvp_request_args,
    dvp_safe_mask,
    dvp_safe_sets,
)
from moe_rl.rollout.vllm.requests import build_requests, engine_kwargs, to_rollout_batch
from moe_rl.routing.record import RouteHeader
from moe_rl.types import SamplingParams
from tests.rollout.vllm.fakes import PAD_ID, VLLM, as_vllm
from tests.rollout.vllm_format import (
    Logprob,
    RequestOutput,
)

DVP_CASES = [
    ("relative", 0.02),
    ("relative", 0.3),
    ("relative", 1.0),
    ("top_p", 0.5),
    ("top_p", 0.9),
    ("top_p", 0.999),
]


def _dvp_spec(rule: str, threshold: float) -> DvpSpec:
    """A case's DvpSpec; relative 1.0 (the top token alone) lies past the config's [0, 1), so the
    threshold is set past the spec's validation: the maths takes it."""
    spec = DvpSpec(rule=rule)
    object.__setattr__(spec, "threshold", threshold)
    return spec


def _dvp_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random logits with ties: half the rows rounded to 0.25 (ties at the relative cut and in
    the top-p sort), a few rows constant (every token tied with the top)."""
    g = torch.Generator().manual_seed(seed)
    z_RV = torch.randn((rows, vocab), generator=g) * 3
    z_RV[: rows // 2] = (z_RV[: rows // 2] * 4).round() / 4
    z_RV[-3:] = 1.5
    return z_RV


@pytest.mark.unit
@pytest.mark.parametrize("rule, threshold", DVP_CASES)
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_dvp_safe_mask_equals_the_builtin_engine(rule, threshold, temperature):
    from moe_rl.rollout.token_sampling import sample_next

    for vocab, seed in ((40, 0), (997, 1)):
        z_RV = _dvp_logits(256, vocab, seed)
        g = torch.Generator().manual_seed(0)
        want = sample_next(z_RV, temperature, 0, 1.0, g, _dvp_spec(rule, threshold))[3]
        got = dvp_safe_mask(z_RV, temperature, rule, threshold)
        assert got.dtype == torch.bool and torch.equal(got, want)
        assert got.sum(-1).min() >= 1  # the top token always
        assert rule != "relative" or got[-3:].all()  # a tie with the top is inside (top_p: by sort order)


@pytest.mark.unit
def test_apply_dvp_masks_each_row_by_its_own_request_and_leaves_the_rest():
    z_RV = _dvp_logits(12, 50, 3)
    params = [None, ("relative", 0.1, 0.7), ("top_p", 0.8, 1.0), ("relative", 0.1, 0.7)] * 3
    out = apply_dvp(z_RV.clone(), params)
    for r, p in enumerate(params):
        if p is None:
            assert torch.equal(out[r], z_RV[r])
            continue
        safe_V = dvp_safe_mask(z_RV[r : r + 1], p[2], p[0], p[1])[0]
        assert torch.equal(torch.isfinite(out[r]), safe_V) and torch.equal(out[r][safe_V], z_RV[r][safe_V])
    buf = z_RV.clone()
    assert apply_dvp(buf, params) is buf and torch.equal(buf, out)  # in place, as vLLM prefers
    with pytest.raises(ValueError, match="parameter rows"):
        apply_dvp(z_RV.clone(), params[:-1])


@pytest.mark.unit
@pytest.mark.parametrize("rule, threshold", DVP_CASES)
def test_processed_logprob_after_the_mask_is_the_builtin_safe_set_logprob(rule, threshold):
    """vLLM's order (sampler.py apply_sampling_params): custom processors, then logits / T, then
    processed log-probs; the sampled token's value equals what the built-in engine reports."""
    from moe_rl.rollout.token_sampling import sample_next

    T = 0.8
    z_RV = _dvp_logits(128, 64, 5)
    tok_R, lp_R, _, safe_RV = sample_next(
        z_RV, T, 0, 1.0, torch.Generator().manual_seed(1), _dvp_spec(rule, threshold)
    )
    processed_RV = apply_dvp(z_RV.clone(), [(rule, threshold, T)] * 128) / T
    assert safe_RV.gather(-1, tok_R[:, None]).all()
    got_R = torch.log_softmax(processed_RV, -1).gather(-1, tok_R[:, None])[:, 0]
    torch.testing.assert_close(got_R, lp_R, rtol=0, atol=1e-6)


def vllm_position_logprobs(processed_V: torch.Tensor, sampled: int, k: int) -> dict[int, Logprob]:
    """One position of ``CompletionOutput.logprobs`` as vLLM 0.33 builds it: compute_topk_scores
    (the sampled token, then torch.topk(k) of the processed logits, log-probs over the processed
    distribution) and append_logprobs_for_next_position ({sampled: rank}, then ranks 1..k
    overwrite duplicates)."""
    lp_V = torch.log_softmax(processed_V, -1)
    ids = [sampled] + torch.topk(processed_V, k).indices.tolist()
    rank = int((processed_V >= processed_V[sampled]).sum())
    ranks = [rank] + list(range(1, k + 1))
    return {t: Logprob(float(lp_V[t]), rank=r) for t, r in zip(ids, ranks)}


@pytest.fixture(scope="module", params=[("relative", 0.2), ("top_p", 0.6)], ids=["relative", "top_p"])
def dvp_rollout(request, fp32_engine):
    rule, threshold = request.param
    sp = SamplingParams(
        max_new_tokens=6,
        temperature=0.9,
        stop_token_ids=(3,),
        dvp=DvpSpec(threshold, rule),
        return_dist=True,
    )
    return fp32_engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], 3, sp, seed=11), sp


def as_vllm_dvp(batch, cfg, b: int, k: int) -> RequestOutput:
    """Sample b of a built-in DVP rollout as vLLM with the DVP processor returns it: top-k
    processed log-probs per position (safe tokens finite, the rest -inf), and the sampled
    token's value exactly as the built-in engine reported it."""
    out = as_vllm(batch, cfg, b)
    P, G = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
    lps = []
    for g in range(G):
        s, tok = P + g, int(batch.tokens_BS[b, P + g])
        processed_V = batch.dist_logp_BSV[b, s].masked_fill(~batch.safe_BSV[b, s], float("-inf"))
        entry = vllm_position_logprobs(processed_V, tok, k)
        entry[tok] = Logprob(float(batch.logprobs_BS[b, s]), rank=entry[tok].rank)
        lps.append(entry)
    out.outputs[0].logprobs = lps
    return out


@pytest.mark.unit
def test_vllm_dvp_outputs_round_trip_to_the_builtin_safe_sets(dvp_rollout, cfg):
    batch, sp = dvp_rollout
    sizes = batch.safe_BSV.sum(-1)[batch.response_mask_BS]
    assert 1 <= int(sizes.min()) and int(sizes.max()) < cfg.vocab_size  # some pruning happened

    def round_trip(k: int):  # vLLM's outputs when k log-probs per position were requested, decoded
        outs = [as_vllm_dvp(batch, cfg, b, k) for b in range(batch.num_seqs)]
        header = RouteHeader.for_model(cfg)
        return to_rollout_batch(
            outs, 3, PAD_ID, header, sp.logprob_support, vocab_size=cfg.vocab_size, dvp_logprobs=k
        )

    got = round_trip(dvp_num_logprobs(int(sizes.max()), cfg.vocab_size))
    for f in ("tokens_BS", "response_mask_BS", "logprobs_BS", "safe_BSV"):
        assert torch.equal(getattr(got, f), getattr(batch, f)), f
    assert (
        got.safe_BSV.dtype == torch.bool
        and got.logprob_support == batch.logprob_support == sp.logprob_support
    )
    assert got.dist_logp_BSV is None  # vLLM has no full distribution next to the restricted one
    # the whole vocabulary requested: never ambiguous, same sets
    full = round_trip(cfg.vocab_size)
    assert torch.equal(full.safe_BSV, batch.safe_BSV)


@pytest.mark.unit
def test_a_safe_set_larger_than_dvp_max_safe_is_an_error_naming_sample_position_and_key(dvp_rollout, cfg):
    batch, sp = dvp_rollout
    header = RouteHeader.for_model(cfg)
    sizes_BS = batch.safe_BSV.sum(-1) * batch.response_mask_BS
    b, s = divmod(int(sizes_BS.argmax()), sizes_BS.shape[1])
    k = int(sizes_BS.max())  # one short of telling the largest set from a larger one
    outs = [as_vllm_dvp(batch, cfg, i, k) for i in range(batch.num_seqs)]
    first_b = int((sizes_BS >= k).any(-1).nonzero()[0])
    first_s = int((sizes_BS[first_b] >= k).nonzero()[0])
    g = first_s - int(batch.prompt_lens_B[first_b])
    with pytest.raises(
        ValueError,
        match=rf"sample {first_b}, generated token {g} \(sequence position {first_s}\)"
        rf".*more than {k - 1} tokens.*rollout\.vllm\.dvp_max_safe",
    ):
        to_rollout_batch(
            outs, 3, PAD_ID, header, sp.logprob_support, vocab_size=cfg.vocab_size, dvp_logprobs=k
        )
    assert sizes_BS[b, s] == k
    # exactly max_safe tokens fit: dvp_num_logprobs asks for one more
    k1 = dvp_num_logprobs(k, cfg.vocab_size)
    outs = [as_vllm_dvp(batch, cfg, i, k1) for i in range(batch.num_seqs)]
    got = to_rollout_batch(
        outs, 3, PAD_ID, header, sp.logprob_support, vocab_size=cfg.vocab_size, dvp_logprobs=k1
    )
    assert torch.equal(got.safe_BSV, batch.safe_BSV)


@pytest.mark.unit
def test_dvp_safe_sets_reject_malformed_outputs():
    V = 10
    ok = [{4: Logprob(-0.1, 1), 2: Logprob(-2.4, 2), 7: Logprob(float("-inf"), 3)}]
    assert dvp_safe_sets(ok, [4], 3, V, sample=0).nonzero().tolist() == [[0, 2], [0, 4]]
    with pytest.raises(ValueError, match="sampled token 7 is outside its DVP safe set"):
        dvp_safe_sets(ok, [7], 3, V, sample=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dvp_safe_sets([{4: Logprob(-0.1, 1), 12: Logprob(-2.4, 2)}], [4], 3, V, sample=0)
    with pytest.raises(ValueError, match="sample 3: vLLM returned 1 log-prob entries for 2"):
        dvp_safe_sets(ok, [4, 5], 3, V, sample=3)
    with pytest.raises(ValueError, match="needs vocab_size and dvp_logprobs"):
        to_rollout_batch([], 1, PAD_ID, None, "dvp:relative:0.1")


@pytest.mark.unit
def test_dvp_request_args_and_their_validation():
    args = dvp_request_args(DvpSpec(0.9, "top_p"))
    assert dvp_params(args, 0.7) == ("top_p", 0.9, 0.7)
    assert dvp_params(None, 0.7) is None and dvp_params({"other": 1}, 0.7) is None
    for bad, needle in [
        ({DVP_ARG: {"rule": "min_p", "threshold": 0.1}}, "rule 'min_p'"),
        ({DVP_ARG: {"rule": "relative", "threshold": 0.0}}, "threshold"),
        ({DVP_ARG: {"rule": "relative"}}, "must be"),
    ]:
        with pytest.raises(ValueError, match=needle):
            dvp_params(bad, 1.0)
    with pytest.raises(ValueError, match="temperature > 0"):
        dvp_params(args, 0.0)
    sp = SamplingParams(max_new_tokens=4, temperature=0.8, dvp=DvpSpec(0.05, "relative"), return_dist=True)
    reqs = build_requests([[4, 5]], 2, sp, seed=3, dvp_logprobs=17)
    for _, kw in reqs:
        assert kw["logprobs"] == 17 and dvp_params(kw["extra_args"], kw["temperature"]) == (
            "relative",
            0.05,
            0.8,
        )
    assert dvp_num_logprobs(64, 151936) == 65 and dvp_num_logprobs(64, 40) == 40


@pytest.mark.unit
def test_dvp_config_with_vllm():
    run = load_config(None, VLLM + ["correction.dvp_threshold=0.02", "rollout.temperature=0.7"])
    assert run.rollout.vllm.dvp_max_safe == 64
    kw = engine_kwargs(run, "/m", external=False)
    assert kw["logits_processors"] == [DVP_PROCESSOR] == ["moe_rl.rollout.vllm.engine:DvpLogitsProcessor"]
    assert (kw["max_logprobs"], kw["logprobs_mode"]) == (65, "processed_logprobs")
    plain = engine_kwargs(load_config(None, VLLM), "/m", external=False)
    assert "logits_processors" not in plain and "max_logprobs" not in plain
    with pytest.raises(ValueError, match="DVP"):
        logprobs_mode(1.0, 0, 0.9, dvp=True)  # raw_logprobs would be the full vocabulary


class _FakeV2LogitsProcessor:
    """vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor (0.33): __init__(vllm_config,
    req_states), classmethod validate_params, add_request(req_idx, params) -> bool,
    apply_staged_writes(), apply(logits, ctx)."""

    def __init__(self, vllm_config, req_states) -> None:
        pass

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        pass

    def add_request(self, req_idx, sampling_params) -> bool:
        return True

    def apply_staged_writes(self) -> None:
        pass


@pytest.mark.unit
def test_dvp_processor_class_through_the_v2_interface(monkeypatch):
    names = [
        "vllm",
        "vllm.v1",
        "vllm.v1.worker",
        "vllm.v1.worker.gpu",
        "vllm.v1.worker.gpu.sample",
        "vllm.v1.worker.gpu.sample.logits_processor",
    ]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].LogitsProcessor = _FakeV2LogitsProcessor
    monkeypatch.setattr(env, "installed_vllm", lambda: ("vllm", "0.33.0"))  # the GPU build's interface
    try:
        module, qualname = DVP_PROCESSOR.split(":")  # as vLLM's loader resolves an FQCN
        cls = getattr(importlib.import_module(module), qualname)
        assert issubclass(cls, _FakeV2LogitsProcessor) and cls is engine.DvpLogitsProcessor
        assert (cls.__module__, cls.__qualname__) == (module, qualname)  # picklable by reference
        proc = cls(None, types.SimpleNamespace(max_num_reqs=4))
        sp = types.SimpleNamespace
        dvp = sp(extra_args=dvp_request_args(DvpSpec(0.3, "relative")), temperature=0.5)
        assert proc.add_request(2, dvp) and not proc.add_request(0, sp(extra_args=None, temperature=1.0))
        assert proc.add_request(1, dvp) and not proc.add_request(
            1, sp(extra_args={}, temperature=1.0)
        )  # slot reused
        with pytest.raises(ValueError, match="rule"):
            cls.validate_params(sp(extra_args={DVP_ARG: {"rule": "x", "threshold": 0.1}}, temperature=1.0))
        z_RV = _dvp_logits(3, 30, 9)
        out = proc.apply(z_RV.clone(), sp(idx_mapping_np=np.array([0, 2, 1])))  # batch order != slot order
        assert torch.equal(out[0], z_RV[0]) and torch.equal(out[2], z_RV[2])
        assert torch.equal(torch.isfinite(out[1]), dvp_safe_mask(z_RV[1:2], 0.5, "relative", 0.3)[0])
        with pytest.raises(RuntimeError, match="speculative decoding"):
            proc.apply(z_RV.clone(), sp(idx_mapping_np=np.array([0, 2])))
    finally:
        engine.__dict__.pop("DvpLogitsProcessor", None)
