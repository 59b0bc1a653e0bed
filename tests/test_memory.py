"""Sizing arithmetic (moe_rl/memory/): parameter counts against canonical shapes, FLOPs/MFU by
hand, and the smoke-test summary on a synthetic metrics.jsonl."""

from __future__ import annotations

import math
import re

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.memory import (
    GiB,
    Layout,
    candidate_layouts,
    choose_layout,
    estimate,
    forward_flops_per_token,
    layer_activations,
    mfu,
    micro_batches,
    param_counts,
    rank_layouts,
    stage_memory,
    stage_params,
    summarize_run,
    train_flops_per_token,
)
from moe_rl.weights.canonical import canonical_param_shapes
from tests.models import DEFAULT_WIDTH_L3 as CFG


@pytest.mark.unit
def test_param_counts_match_the_canonical_shapes():
    shapes = canonical_param_shapes(CFG)
    c = param_counts(CFG)
    assert c["total"] == sum(math.prod(s) for s in shapes.values())
    assert c["expert"] == sum(math.prod(s) for k, s in shapes.items() if ".experts." in k)
    one_expert = 3 * CFG.hidden_size * CFG.moe_ffn_hidden_size
    assert c["active"] == c["dense"] + 2 * 2 * one_expert  # 2 MoE layers x top-2
    assert c["matmul_active"] == c["active"] - 50 * CFG.hidden_size


@pytest.mark.unit
def test_mfu_by_hand():
    n = param_counts(CFG)["matmul_active"]
    assert train_flops_per_token(CFG) == 6 * n and forward_flops_per_token(CFG) == 2 * n
    got = mfu(CFG, trained_tokens=1000, forward_tokens=2000, seconds=2.0, num_gpus=4, peak_tflops=1.0)
    assert got == pytest.approx((6 * n * 1000 + 2 * n * 2000) / (2.0 * 4 * 1e12))


def _small_run():
    """8 sequences a step (4 prompts x 2 samples) in one minibatch, vocabulary 50."""
    sizes = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "algo.num_minibatches=1"]
    return load_config(None, ["model.vocab_size=50", *sizes])


@pytest.mark.unit
def test_summarize_run_skips_warmup_and_reports_agreement():
    cfg = _small_run()
    rows = [
        {"time/step_s": 100.0, "rollout/response_len_mean": 1.0},
        {"time/step_s": 2.0, "rollout/response_len_mean": 4.0, "routing/flip_router_frac": 0.1},
        {"time/step_s": 4.0, "rollout/response_len_mean": 6.0, "routing/flip_router_frac": 0.3},
    ]
    s = summarize_run(rows, cfg, prompt_tokens=5.0)
    assert s["steps"] == 2 and s["step_s"] == 3.0
    assert s["tokens_per_step"] == 8 * (5.0 + 5.0) and s["tokens_per_s"] == pytest.approx(80 / 3)
    assert s["routing_agreement"] == pytest.approx(0.8)
    n = param_counts(cfg.model)["matmul_active"]
    assert s["mfu"] == pytest.approx((6 * n * 80 + 2 * 2 * n * 80) / (3.0 * 989e12))
    assert "learner_mfu" not in s and "peak_gib" not in s


@pytest.mark.unit
def test_summarize_run_learner_mfu_peak_memory_and_reward_trend():
    cfg = _small_run()
    rows = [
        {
            "time/step_s": 9.0,
            "time/old_logprob_s": 1.0,
            "time/update_s": 2.0,
            "rollout/response_len_mean": 5.0,
            "reward/mean": 0.1 * i,
            "mem/peak_gib": 3.0 + i % 3,
            "time/sync_s": 0.5 + i,
        }
        for i in range(8)
    ]
    s = summarize_run(rows, cfg, prompt_tokens=5.0)
    n = param_counts(cfg.model)["matmul_active"]
    tokens = 8 * 10.0
    assert s["learner_s"] == 3.0
    # the learner trains every token once (6N) and runs one forward-only pass (old log-probs, 2N)
    assert s["learner_mfu"] == pytest.approx((6 * n * tokens + 2 * n * tokens) / (3.0 * 989e12))
    assert s["peak_gib"] == 5.0
    assert s["sync_s"] == pytest.approx(sum(0.5 + i for i in range(1, 8)) / 7)  # the warm-up step left out
    assert (s["reward_first"], s["reward_last"]) == (pytest.approx(0.05), pytest.approx(0.65))


# ---- per-GPU memory by layout (estimate / stage_memory / choose_layout) --------------------------

TINY = [
    "model.vocab_size=64",
    "model.hidden_size=32",
    "model.num_layers=6",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.head_dim=8",
    "model.ffn_hidden_size=64",
    "model.moe_ffn_hidden_size=16",
    "model.num_experts=8",
    "model.moe_router_topk=2",
    "model.max_seq_len=16",
    "model.precision=bf16",
    "algo.micro_batch_size=2",
    "parallel.nproc=8",
    "parallel.expert_parallel=8",
]


def _tiny(*extra: str):
    return load_config(None, TINY + list(extra))


def _peak(est: dict) -> float:
    """The largest phase peak: train, sync, generate (rollout), async."""
    return max(est[k] for k in ("train_peak_gib", "sync_peak_gib", "rollout_peak_gib", "async_peak_gib"))


@pytest.mark.unit
def test_stage_params_by_hand():
    m = _tiny().model
    # H=32, D=8, Q=4, G=2, V=64, E=8, expert F=16; per layer: q,o,k,v 2*32*(4+2)*8 = 3072 (split
    # over TP), norms 2*32 + q/k norms 2*8 = 80 and router 8*32 = 256 (replicated)
    lay = Layout(world=8, tp=2, pp=2, ep=2, etp=1)
    assert lay.stage_layers(6) == [3, 3] and (lay.dp, lay.expert_dp) == (2, 2)
    # stage 0: 3 * (3072/2 + 80 + 256) + embedding 64*32/2; stage 1: the output layer and final norm
    assert stage_params(m, lay, 0, [3, 3]) == (3 * 1872 + 1024, 3 * 8 * 3 * 32 * 16 / 2)
    assert stage_params(m, lay, 1, [3, 3]) == (3 * 1872 + 1024 + 32, 3 * 8 * 3 * 32 * 16 / 2)
    # one GPU of a 1-rank layout holds the whole model; two stages hold it between them
    whole = stage_params(m, Layout(world=1), 0, [6])
    assert sum(whole) == param_counts(m)["total"]
    halves = [stage_params(m, Layout(world=2, pp=2), s, [2, 4]) for s in (0, 1)]
    assert sum(map(sum, halves)) == param_counts(m)["total"]


@pytest.mark.unit
def test_doubling_tp_halves_the_split_dense_params():
    m = _tiny("model.num_query_groups=4").model
    replicated = 6 * (80 + 256) + 32  # norms, routers and the final norm stay whole on every TP rank
    assert not Layout(world=8, tp=4, ep=2).problems(m)
    d1, _ = stage_params(m, Layout(world=8, tp=1, ep=8), 0, [6])
    d2, _ = stage_params(m, Layout(world=8, tp=2, ep=4), 0, [6])
    d4, _ = stage_params(m, Layout(world=8, tp=4, ep=2), 0, [6])
    assert d1 - replicated == 2 * (d2 - replicated) == 4 * (d4 - replicated)


@pytest.mark.unit
def test_expert_tp_divides_expert_weights_and_grads_but_not_their_sharded_optimizer():
    cfg = _tiny()
    tp, ep = 2, 2
    one = stage_memory(cfg, Layout(world=8, tp=tp, ep=ep, etp=1), 0)
    full = stage_memory(cfg, Layout(world=8, tp=tp, ep=ep, etp=tp), 0)
    assert one["expert"] == tp * full["expert"] and one["dense"] == full["dense"]
    # bf16 weight 2 B + fp32 grad 4 B per parameter; the distributed optimizer's 12 B per expert
    # parameter are sharded over expert-DP = world / (EP x ETP): 12 x all experts / world either way
    assert one["weights"] + one["grads"] - full["weights"] - full["grads"] == 6 * (
        one["expert"] - full["expert"]
    )
    assert one["optimizer"] == full["optimizer"]
    experts_all = 6 * 8 * 3 * 32 * 16
    assert one["optimizer"] == 12 * one["dense"] / 4 + 12 * experts_all / 8  # dense DP = 8 / TP = 4
    unsharded = stage_memory(
        _tiny("parallel.distributed_optimizer=false"), Layout(world=8, tp=tp, ep=ep, etp=1), 0
    )
    assert unsharded["optimizer"] == 12 * (one["dense"] + one["expert"])


@pytest.mark.unit
def test_activations_per_layer_and_in_flight_micro_batches():
    m = _tiny().model
    # 4H + (Q+2G)D + QD + 2E = 128 + 64 + 32 + 16 = 240; per selected expert (ETP H + 3F)
    assert layer_activations(m, Layout(world=1)) == 240 + 2 * (32 + 48)
    assert layer_activations(m, Layout(world=2, tp=2, etp=1)) == (240 + 2 * (32 + 48)) / 2
    assert layer_activations(m, Layout(world=2, tp=2, etp=2)) == (240 + 2 * (2 * 32 + 48)) / 2
    assert layer_activations(m, Layout(world=1), dense_layer=True) == 240 - 16 + 3 * 64  # no router
    # 16 prompts over DP 4, x 2 samples / 2 minibatches = 4 sequences per rank; micro_batch_size 2
    batch = ["rollout.prompts_per_step=16", "rollout.samples_per_prompt=2", "algo.num_minibatches=2"]
    cfg = _tiny(*batch)
    lay = Layout(world=8, pp=2, ep=4)
    assert micro_batches(cfg, lay) == 2
    tokens, per_layer = 2 * 16, 400
    s0, s1 = stage_memory(cfg, lay, 0), stage_memory(cfg, lay, 1)
    assert (s0["in_flight"], s1["in_flight"]) == (2, 1)  # 1F1B: stage 0 holds PP micro-batches
    assert (
        s0["activations"] == 2 * tokens * 2 * 3 * per_layer
        and s1["activations"] == 2 * tokens * 3 * per_layer
    )
    rc = _tiny(*batch, "model.recompute=true")
    # full recomputation: each in-flight micro-batch keeps its 3 layer inputs (H), plus one full layer
    assert stage_memory(rc, lay, 0)["activations"] == 2 * tokens * (2 * 3 * 32 + per_layer)
    assert stage_memory(rc, lay, 1)["activations"] == 2 * tokens * (1 * 3 * 32 + per_layer)


@pytest.mark.unit
def test_logits_per_tp_shard_on_the_last_stage_only():
    cfg = _tiny()
    tokens = 2 * 16
    # bf16 logits 2 B + fp32 log-softmax and softmax saved + one fp32 gradient
    assert stage_memory(cfg, Layout(world=8, ep=8), 0)["logits"] == tokens * 64 * (2 + 3 * 4)
    # vocab-parallel: a V / TP slice, and exp(z - max) saved too
    assert stage_memory(cfg, Layout(world=8, tp=2, ep=4), 0)["logits"] == tokens * 32 * (2 + 4 * 4)
    lay = Layout(world=8, pp=2, ep=4)
    assert (
        stage_memory(cfg, lay, 0)["logits"] == 0 and stage_memory(cfg, lay, 1)["logits"] == tokens * 64 * 14
    )


@pytest.mark.unit
def test_uneven_stages_move_the_peak_to_the_heaviest_stage():
    cfg = _tiny("model.recompute=true")
    for first, last, heavy in ((5, 1, 0), (1, 5, 1)):
        lay = Layout(world=8, pp=2, ep=4, first=first, last=last)
        assert lay.stage_layers(6) == [first, last]
        stages = [stage_memory(cfg, lay, s) for s in (0, 1)]
        est = estimate(cfg, layout=lay)
        assert est["peak_stage"] == heavy and stages[heavy]["train_peak"] > stages[1 - heavy]["train_peak"]
        assert est["train_peak_gib"] == stages[heavy]["train_peak"] / GiB
        assert est["learner_static_max_gib"] == max(s["static"] for s in stages) / GiB
        parts = (
            "weights_gib",
            "grads_gib",
            "optimizer_gib",
            "reference_gib",
            "activations_gib",
            "logits_gib",
        )
        assert sum(est[k] for k in parts) == pytest.approx(est["train_peak_gib"])
    # a frozen reference copy of the weights with a KL term
    kl = estimate(_tiny("model.recompute=true", "algo.kl_coef=0.1"), layout=lay)
    assert kl["reference_gib"] == kl["weights_gib"] > 0


@pytest.mark.unit
def test_stage_layers_follow_megatrons_uneven_split():
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    for pp, first, last in ((4, 23, 23), (4, 22, 24), (8, 11, 11), (2, 40, 54), (4, 0, 0), (3, 30, 0)):
        lay = Layout(world=pp, pp=pp, first=first, last=last)
        num_layers = 94 if (first or last) else 96
        tc = TransformerConfig(
            num_layers=num_layers,
            hidden_size=8,
            num_attention_heads=1,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32,
            num_layers_in_first_pipeline_stage=first or None,
            num_layers_in_last_pipeline_stage=last or None,
        )
        assert lay.stage_layers(num_layers) == [get_num_layers_to_build(tc, pp_rank=r) for r in range(pp)]
    for lay, needle in (
        (Layout(world=4, pp=4), "94 layers do not split evenly over 4 pipeline stages"),
        (
            Layout(world=4, pp=4, first=21, last=20),
            "94 layers after 21 on the first and 20 on the last stage do not split evenly over 2 middle",
        ),
        (
            Layout(world=2, pp=2, first=20, last=20),
            "94 layers after 20 on the first and 20 on the last stage do not split evenly over 0 middle",
        ),
    ):
        with pytest.raises(ValueError, match=re.escape(needle)):
            lay.stage_layers(94)


@pytest.mark.unit
def test_choose_layout_offers_only_layouts_whose_sizes_divide():
    cfg = _tiny()
    m = cfg.model
    layouts = candidate_layouts(m, nodes=2, gpus_per_node=4)
    assert layouts and all(not lay.problems(m) for lay in layouts)
    for lay in layouts:
        assert lay.tp in (1, 2) and lay.expert_tp in (1, lay.tp)  # TP 4 does not divide 2 query groups
        assert 8 % lay.ep == 0 and (8 // lay.pp) % (lay.ep * lay.expert_tp) == 0
        assert sum(lay.stage_layers(6)) == 6 and lay.pp <= 6
    assert Layout(8, tp=2, pp=4, ep=1, etp=2, first=1, last=1) in layouts  # 1/2/2/1 layers
    assert not any(lay.pp == 4 and (lay.first, lay.last) == (0, 0) for lay in layouts)  # 6 layers, PP 4
    assert Layout(8, tp=4, ep=2).problems(m) == ["TP 4 does not divide model.num_query_groups 2"]
    assert Layout(8, tp=2, ep=3, etp=1).problems(m) == [
        "EP 3 does not divide model.num_experts 8",
        "EP*ETP = 3 does not divide DP*TP = 8",
    ]
    assert Layout(8, tp=2, ep=4, etp=2).problems(m) == ["EP*ETP = 8 does not divide DP*TP = 8"][:0]
    assert Layout(8, pp=2, ep=8).problems(m) == ["EP*ETP = 8 does not divide DP*TP = 4"]
    assert Layout(6, tp=4).problems(m)[0] == "TP*PP = 4 does not divide 6 GPUs"


@pytest.mark.unit
def test_choose_layout_ranks_the_fitting_ones_by_the_stated_rule():
    cfg = _tiny("model.num_layers=8")
    ranked = rank_layouts(cfg, 2, 4)
    assert len({(r.layout.tp, r.layout.ep, r.layout.expert_tp, r.layout.pp) for r in ranked}) == len(ranked)
    peaks = sorted(_peak(r.est) for r in ranked)
    gpu_gib = peaks[len(peaks) // 2] + 0.1  # a GPU that holds about half of them, less 0.1 GiB margin
    chosen = choose_layout(cfg, 2, 4, gpu_gib=gpu_gib, margin_gib=0.1)
    assert 0 < len(chosen) < len(ranked)
    assert {r.layout for r in chosen} == {
        r.layout for r in rank_layouts(cfg, 2, 4, gpu_gib) if _peak(r.est) <= gpu_gib - 0.1
    }
    keys = [(r.layout.pp, r.layout.tp, r.layout.expert_tp, r.layout.ep) for r in chosen]
    assert keys == sorted(keys) and keys[0][0] == 1  # fewest pipeline stages first
    for r in chosen:
        assert r.est == estimate(cfg, gpu_gib, r.layout)
        # per (TP, EP, ETP, PP) the first/last split with the smallest peak
        splits = [
            lay
            for lay in candidate_layouts(cfg.model, 2, 4)
            if (lay.tp, lay.ep, lay.expert_tp, lay.pp)
            == (r.layout.tp, r.layout.ep, r.layout.expert_tp, r.layout.pp)
        ]
        assert min(_peak(estimate(cfg, gpu_gib, lay)) for lay in splits) == _peak(r.est)
    # vLLM: its ~2 GiB of activations / CUDA graphs leave no KV cache in a 1.25 GiB budget
    vllm = _tiny("model.num_layers=8", "rollout.engine=vllm", "rollout.top_k=0")
    assert (
        estimate(vllm, 2.5)["vllm_kv_tokens"] == 0
        and choose_layout(vllm, 2, 4, gpu_gib=2.5, margin_gib=0) == []
    )
    assert choose_layout(vllm, 2, 4, gpu_gib=8.0, margin_gib=0)


@pytest.mark.unit
def test_estimate_command_prints_the_layouts_row_both_peaks_host_memory_and_sync():
    from pathlib import Path

    from click.testing import CliRunner

    from moe_rl.cli import main

    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "qwen3_30b_a3b_1x8h100.yaml")
    out = CliRunner().invoke(main, ["estimate", recipe, "parallel.expert_parallel=4"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == "TP 2 x EP 4 x ETP 1 x PP 1 on 8 GPUs of 80 GiB"
    assert lines[-2] == "| TP 2 x EP 4 x ETP 1 x PP 1 | 87.5 | 93.3 | 68.0 | 2,572,995 | no |"
    assert lines[-1] == (  # the verdict for the config's own layout ends the output
        "verdict for TP 2 x EP 4 x ETP 1 x PP 1: does not fit: the train phase needs 93.3 GiB per GPU "
        "against 76 GiB usable (the GPU less 4)"
    )
    assert "rollout peak: 155.5 GiB without parallel.offload_during_rollout, 68.0 GiB with it" in lines
    assert (
        "device peak per phase (GiB a GPU; train -> offload -> engine_wake -> sync -> learner_out -> "
        "kv_wake -> generate): train 93.3, sync 23.1, generate 68.0, async 0.0 of 76 usable: "
        "train does not fit"
    ) in lines
    assert any(
        line.startswith("host memory per rank: 102.6 GiB (CPU Adam 0.0, offloaded learner 93.0, ")
        for line in lines
    )
    assert any(line.startswith("host memory per node: 821 GiB (8 GPUs") for line in lines)
    assert (
        "weight sync: 7.6 GB received per engine rank (its shard); 0.02 s at line rate (NVLink 450 / "
        "InfiniBand 50 GB/s per GPU, a lower bound) to 1-7 s at the peers' measured efficiency "
        "(a 30B-class MoE)"
    ) in lines


@pytest.mark.unit
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen2_moe"])
@pytest.mark.parametrize("q_lora_rank", [24, 0])
def test_param_counts_of_the_hf_families_match_their_canonical_shapes(family, q_lora_rank):
    """MLA (q LoRA or not), shared experts and their gate, the expert bias, q/k/v biases, tied
    embeddings: every canonical tensor counted once, routed experts apart."""
    from tests.models import HF_FAMILY_TINY

    m = HF_FAMILY_TINY[family](**({"q_lora_rank": q_lora_rank} if family == "deepseek_v3" else {}))
    shapes = canonical_param_shapes(m)
    c = param_counts(m)
    assert c["total"] == sum(math.prod(s) for s in shapes.values())
    assert c["expert"] == sum(math.prod(s) for k, s in shapes.items() if ".experts." in k)
    one_expert = 3 * m.hidden_size * m.moe_ffn_hidden_size
    assert c["active"] == c["dense"] + len(m.moe_layers) * m.moe_router_topk * one_expert
    embed = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
    assert c["matmul_active"] == c["active"] - embed


@pytest.mark.unit
def test_mla_kv_cache_is_the_latent_on_every_rank():
    from moe_rl.memory import kv_cache_bytes_per_token
    from tests.models import deepseek_v3_tiny

    m = deepseek_v3_tiny()  # 4 layers, kv_lora_rank 16 + qk_rope_head_dim 4, bf16
    assert kv_cache_bytes_per_token(m, 1) == kv_cache_bytes_per_token(m, 8) == 4 * 20 * 2
    # GQA: K and V of the rank's KV heads (2 groups over TP 2: one each; over TP 4: replicated)
    gqa = 2 * 3 * 1 * CFG.head_dim * 2
    assert kv_cache_bytes_per_token(CFG, 2) == kv_cache_bytes_per_token(CFG, 4) == gqa


# ---- offload during rollouts, CPU Adam, host memory and the weight sync (issue 32.5 / 32.6) -------

VLLM_TINY = ("rollout.engine=vllm", "rollout.top_k=0", "parallel.expert_parallel=4")


@pytest.mark.unit
def test_offload_and_cpu_adam_move_the_stated_bytes_off_the_device():
    lay = Layout(world=8, tp=2, ep=4, etp=1)
    plain = stage_memory(_tiny(*VLLM_TINY), lay, 0)
    dense, expert = plain["dense"], plain["expert"]
    w, g, o = 2 * (dense + expert), 4 * (dense + expert), 12 * (dense / 4 + expert / 2)  # DP 4, expert-DP 2
    assert (plain["weights"], plain["grads"], plain["optimizer"]) == (w, g, o)
    assert plain["offloaded"] == 0 and plain["rollout_resident"] == plain["static"] == w + g + o
    # the weights leave too: either engine generates with its own copy (learner/offload.py)
    vllm = stage_memory(_tiny(*VLLM_TINY, "parallel.offload_during_rollout=true"), lay, 0)
    assert vllm["offloaded"] == w + g + o and vllm["rollout_resident"] == 0
    builtin = stage_memory(
        _tiny("parallel.offload_during_rollout=true", "parallel.expert_parallel=4"), lay, 0
    )
    assert builtin["offloaded"] == w + g + o and builtin["rollout_resident"] == 0
    kl = stage_memory(_tiny(*VLLM_TINY, "parallel.offload_during_rollout=true", "algo.kl_coef=0.1"), lay, 0)
    assert kl["rollout_resident"] == w  # the frozen reference stays
    # CPU Adam: none of it on the device; its state lives on the host for the whole run
    cpu = stage_memory(_tiny(*VLLM_TINY, "optim.cpu_adam=true"), lay, 0)
    assert (cpu["optimizer"], cpu["host_optim_elems"]) == (0, dense / 4 + expert / 2)
    assert cpu["train_peak"] == plain["train_peak"] - o
    both = _tiny(*VLLM_TINY, "optim.cpu_adam=true", "parallel.offload_during_rollout=true")
    assert stage_memory(both, lay, 0)["offloaded"] == w + g
    est = estimate(both, gpu_gib=8.0, layout=lay, gpus_per_node=4)
    assert est["rollout_peak_gib"] == both.rollout.vllm.gpu_memory_utilization * 8.0  # nothing resident
    assert est["offload_s"] == pytest.approx(2 * (w + g) / 55e9)


def _pow2(n: float) -> int:
    return 1 << math.ceil(math.log2(n))


@pytest.mark.unit
def test_host_bytes_per_rank_cpu_adam_at_megatrons_18_bytes_offload_without_grads_pinned_rounded():
    """By hand for the tiny model (H 32, expert F 16, 8 experts over EP 4: 2 a rank in each of the 6
    MoE layers, expert-DP 2, DP 4): CPU Adam 12 B pageable (fp32 main param, m, v) per element of
    the rank's shard + 6 B pinned (the fp32 grad copy, the cached bf16 host copy) per shard tensor,
    rounded up to a power of two; offload: the two DDP param buffers (dense, expert) pinned, the
    grads dropped (no host bytes); vLLM asleep: one pinned backup per fused tensor."""
    from moe_rl.memory import pinned

    assert [pinned(x) for x in (0, 1, 3, 4, 5, 1000, 1024, 1025)] == [0, 1, 4, 4, 8, 1024, 1024, 2048]
    lay = Layout(world=8, tp=2, ep=4, etp=1)
    both = _tiny(*VLLM_TINY, "optim.cpu_adam=true", "parallel.offload_during_rollout=true")
    st = stage_memory(both, lay, 0)
    dense, expert = st["dense"], st["expert"]
    fc1, fc2 = 2 * 16 * 32 / 2, 16 * 32 / 2  # an expert's fc1 / fc2 shard over expert-DP 2
    local = 6 * 2  # experts of the rank, all layers
    adam = 12 * (dense / 4 + expert / 2) + local * (_pow2(6 * fc1) + _pow2(6 * fc2))
    adam += 6 * _pow2(6 * dense / 4 / 6)  # the dense shard: one block a layer
    offload = _pow2(2 * dense) + _pow2(2 * expert)  # bf16 weights; grads dropped; CPU Adam's on the host
    m = both.model
    embed = 64 * 32 * 2
    dense_layer = (param_counts(m)["dense"] * 2 - 2 * embed) / 6
    asleep = 6 * (_pow2(8 * 2 * 16 * 32 * 2) + _pow2(8 * 16 * 32 * 2) + _pow2(dense_layer)) + 2 * _pow2(embed)
    est = estimate(both, gpu_gib=8.0, layout=lay, gpus_per_node=4)
    assert est["host_cpu_adam_gib_per_rank"] * GiB == pytest.approx(adam)
    assert est["host_offload_gib_per_rank"] * GiB == pytest.approx(offload)
    assert est["host_vllm_asleep_gib_per_rank"] * GiB == pytest.approx(asleep)
    assert est["host_gib_per_node"] == pytest.approx(4 * (adam + offload + asleep) / GiB)
    # GPU Adam with offload: m, v and the fp32 main params (12 B) per shard tensor, pinned
    gpu = estimate(_tiny(*VLLM_TINY, "parallel.offload_during_rollout=true"), gpu_gib=8.0, layout=lay)
    opt = local * (_pow2(12 * fc1) + _pow2(12 * fc2)) + 6 * _pow2(12 * dense / 4 / 6)
    assert gpu["host_offload_gib_per_rank"] * GiB == pytest.approx(offload + opt)
    assert gpu["host_cpu_adam_gib_per_rank"] == gpu["cpu_adam_s"] == 0
    # CPU Adam's step: the rank's shard at the measured rate (or the one given)
    assert est["cpu_adam_s"] == pytest.approx((dense / 4 + expert / 2) / (0.35e9 * 12))
    fast = estimate(both, gpu_gib=8.0, layout=lay, cpu_adam_elems_per_s=1e6)
    assert fast["cpu_adam_s"] == pytest.approx((dense / 4 + expert / 2) / 1e6)


@pytest.mark.unit
def test_phase_peaks_follow_the_colocated_order_by_hand():
    """train -> offload -> engine_wake -> sync -> learner_out -> kv_wake -> generate: with offload
    the sync holds the learner's weights (optimizer and grads gone), vLLM's TP shard and two
    gathered units of parallel.sync_bucket_mib; generate holds vLLM's budget; without offload the
    learner's whole state stays through every phase."""
    from moe_rl.memory import COLOCATED_ORDER, phase_bytes

    assert COLOCATED_ORDER == (
        "train", "offload", "engine_wake", "sync", "learner_out", "kv_wake", "generate"
    )  # fmt: skip
    lay = Layout(world=8, tp=2, ep=4, etp=1)
    cfg = _tiny(*VLLM_TINY, "parallel.offload_during_rollout=true", "parallel.sync_bucket_mib=3")
    st = stage_memory(cfg, lay, 0)
    engine = 2 * param_counts(cfg.model)["total"] / 1  # vLLM TP 1: the whole model in bf16
    budget = 0.35 * 8 * GiB
    ph = phase_bytes(cfg, st, budget)
    assert ph["train"] == st["train_peak"] and ph["offload"] == st["static"]
    assert ph["engine_wake"] == st["weights"] + engine
    assert ph["sync"] == st["weights"] + engine + 2 * 3 * 2**20
    assert ph["learner_out"] == engine and ph["kv_wake"] == ph["generate"] == budget
    assert ph["async"] == 0
    est = estimate(cfg, 8.0, lay)
    assert est["sync_peak_gib"] * GiB == pytest.approx(ph["sync"])
    kept = phase_bytes(
        _tiny(*VLLM_TINY, "parallel.sync_bucket_mib=3"), stage_memory(_tiny(*VLLM_TINY), lay, 0), budget
    )
    assert kept["sync"] == st["static"] + engine + 2 * 3 * 2**20 and kept["generate"] == st["static"] + budget
    # rollout ranks (async): the learner ranks hold no engine; a rollout rank the budget and one
    # staged copy of the next weights
    split = _tiny(
        *VLLM_TINY, "parallel.nproc=9", "parallel.rollout_ranks=1", "rollout.mode=async",
        "rollout.inflight_kv=keep", "parallel.sync_bucket_mib=3",
    )  # fmt: skip
    sp = phase_bytes(split, stage_memory(split, lay, 0), budget)
    assert (
        sp["sync"] == stage_memory(split, lay, 0)["static"] + 2 * 3 * 2**20 and sp["async"] == budget + engine
    )


@pytest.mark.unit
def test_weight_sync_bytes_each_engine_rank_receives_only_its_shard():
    """vLLM: each engine rank receives its TP slice (the model / vLLM TP in the rollout dtype), not
    the whole model; the built-in engine (unsharded) the model less what its own learner rank
    holds. Line rate: InfiniBand when the learner spans nodes, NVLink inside one."""
    from moe_rl.memory import sync_traffic

    cfg = _tiny("parallel.expert_parallel=4", "rollout.engine=vllm", "rollout.top_k=0")
    m, lay = cfg.model, Layout(world=8, pp=2, ep=4, first=2, last=4)  # layers 0-1 | 2-5
    total = sum(math.prod(s) for s in canonical_param_shapes(m).values())
    for vtp in (1, 2, 4):
        run = _tiny("parallel.expert_parallel=4", "rollout.engine=vllm", "rollout.top_k=0",
                    f"rollout.vllm.tensor_parallel={vtp}")  # fmt: skip
        got = sync_traffic(run, lay, gpus_per_node=4)
        assert got["sync_bytes"] == 2 * total / vtp and got["sync_s"] == pytest.approx(2 * total / vtp / 50e9)
        assert sync_traffic(run, lay, gpus_per_node=8)["sync_s"] == pytest.approx(2 * total / vtp / 450e9)
    assert got["sync_bucket_bytes"] == 512 * 2**20
    builtin = _tiny("parallel.expert_parallel=4")
    own = min(sum(stage_params(m, lay, st, [2, 4])) for st in (0, 1))
    assert sync_traffic(builtin, lay, 8)["sync_bytes"] == 2 * (total - own)
    # the estimate prints the line rate beside the peers' range for the model's size
    est = estimate(cfg, 8.0, lay, gpus_per_node=4)
    assert (est["sync_s_peers_lo"], est["sync_s_peers_hi"]) == (1.0, 7.0)
    assert est["sync_gb_per_rank"] == 2 * total / 1e9


@pytest.mark.bad_input
def test_a_run_that_does_not_fit_its_gpus_stops_before_any_rank_names_the_key():
    from pathlib import Path

    from moe_rl.config import ConfigError
    from moe_rl.preflight import check_fit

    recipe = Path(__file__).resolve().parents[1] / "configs" / "qwen3_30b_a3b_1x8h100.yaml"
    check_fit(load_config(recipe), 80.0)  # the recipe fits its H100s
    with pytest.raises(ConfigError) as e:
        check_fit(load_config(recipe, ["parallel.offload_during_rollout=false"]), 80.0)
    assert str(e.value) == (
        "config key 'parallel.nproc': 8 GPUs of 80 GiB do not fit this run: the generate phase needs "
        "135.3 GiB per GPU against 76 GiB usable (the GPU less 4); try "
        "parallel.offload_during_rollout=true / optim.cpu_adam=true, or more GPUs: "
        "`moe-rl estimate CONFIG --rank 5` ranks the layouts"
    )
    with pytest.raises(ConfigError) as e:
        check_fit(load_config(recipe), 40.0)
    assert str(e.value).startswith(
        "config key 'parallel.nproc': 8 GPUs of 40 GiB do not fit this run: the train phase needs 73.1 GiB"
    )
    # the sync phase: vLLM TP 1 wakes the whole model (56.9 GiB) beside the learner's weights and two
    # gathered units of 8 GiB
    bad = ["rollout.vllm.tensor_parallel=1", "parallel.sync_bucket_mib=8192"]
    with pytest.raises(ConfigError) as e:
        check_fit(load_config(recipe, bad), 80.0)
    assert str(e.value).startswith(
        "config key 'parallel.nproc': 8 GPUs of 80 GiB do not fit this run: the sync phase needs 81.1 GiB"
    )
