"""In-flight weight updates on vLLM (``rollout.mode=async``; docs/design.md 15.1): our own step loop
over vLLM's ``LLMEngine`` in place of the blocking ``LLM.generate``, so an update can be loaded whole
between two engine steps, and the per-token weight versions (``version_BS``) counted from each
request's output length at every update.

vLLM keeps one engine-wide weight version and nothing per token. Its requests are put in with
``RequestOutputKind.CUMULATIVE``, so each step returns every request that sampled a token with its
output so far; at an update the loop records how many tokens each request had (a request with no
output yet: 0). Generated token g of request b then carries the version of the last update whose
count for b is <= g, or the call's starting version. One step of a request yields one token (no
speculative decoding here), sampled from the logits of that step's forward, so the version is the
forward's, as the built-in engine stamps it. The loop runs in vLLM's process (in-process engine
core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; no async scheduling on the CPU build, switched off on
GPU for async), so a step has finished its forward when ``step`` returns. Pure apart from the
engine it is handed (vllm is imported in engine.py only). The same loop takes over-sampling's
early abort (``StepAbort``; abort.py).

Shape suffixes: B requests (samples), S padded sequence length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from moe_rl.rollout.vllm.abort import StepAbort, cut_output


def next_version(current: int, asked: int | None) -> int:
    """The weight version a load sets: ``asked``, or ``current + 1`` when None; it must exceed
    ``current`` (0 marks prompt and pad tokens, so the first load is >= 1)."""
    new = current + 1 if asked is None else int(asked)
    if new <= current:
        raise ValueError(f"weight version {new}: the engine is at version {current} (versions increase)")
    return new


def poll_update(eng: Any, updates: Any, started: bool) -> int | None:
    """``VllmEngine``'s poll of ``run_steps`` (None: no source, no update): load the source's update
    whole, keeping the KV of the running requests (``inflight_kv=keep``). The prefix cache is reset
    where vLLM can (no request holds blocks: before the first step), else at the next call's start."""
    if updates is None or (update := updates.poll()) is None:
        return None
    new = next_version(eng.version, update[0])
    eng._reload(update[1])
    eng.version, eng.cache_stale = new, started
    if not started:
        eng.llm.reset_prefix_cache()
    return new


def run_steps(
    engine: Any,
    requests: Sequence[tuple[str, dict, Any]],
    poll: Callable[[bool], int | None],
    abort: StepAbort | None = None,
) -> tuple[list[Any], list[tuple[int, torch.Tensor]]]:
    """Generate ``requests`` ((request id, prompt, ``SamplingParams`` with CUMULATIVE outputs)) on
    vLLM's ``engine`` (an ``LLMEngine``) step by step. Before each step ``poll(started)`` (started:
    a step ran in this call) may load an update whole and returns its version, or None. It is
    called only where no request is part-way into its prefill: before the first step, or once
    every request has sampled its first token, so no request's prompt KV (and prompt routes)
    straddles two versions and no request still waiting can hit another version's prefix-cache
    blocks. No poll follows the last step. ``abort``: ``StepAbort``, checked between steps (as
    polls, only once every request has a token: none is cut before its first). Returns the final
    outputs in request order and the updates as (version, tokens each request had generated when
    it landed, int64 [B])."""
    ids = [rid for rid, _, _ in requests]
    internal = {rid: engine.add_request(rid, prompt, params) for rid, prompt, params in requests}
    latest: dict[str, Any] = {}
    updates: list[tuple[int, torch.Tensor]] = []
    started, steps = False, 0

    def snapshot() -> list[Any]:  # every unfinished request's rows read before any abort
        return [
            latest[r]
            if latest[r].finished
            else cut_output(latest[r], abort.rows(internal[r]), int(abort.starts[b]), b)
            for b, r in enumerate(ids)
        ]

    try:
        while engine.has_unfinished_requests():
            if len(latest) in (0, len(ids)) and (version := poll(started)) is not None:
                counts_B = [len(latest[r].outputs[0].token_ids) if r in latest else 0 for r in ids]
                updates.append((version, torch.tensor(counts_B, dtype=torch.int64)))
            for out in engine.step():
                latest[out.request_id] = out
            started, steps = True, steps + 1
            if abort is not None and steps % abort.every == 0 and len(latest) == len(ids):
                done = [bool(latest[r].finished) for r in ids]
                taken: list[list[Any]] = []  # no engine step between the peek and the abort: one read

                def peek() -> list[Any]:
                    taken[:] = taken or [snapshot()]
                    return taken[0]

                if not all(done) and abort.enough(done, peek):
                    outs = peek()
                    engine.abort_request([r for r, d in zip(ids, done) if not d])
                    return outs, updates
    except BaseException:  # leave no request of ours running in the engine
        engine.abort_request([r for r in ids if r not in latest or not latest[r].finished])
        raise
    missing = [r for r in ids if r not in latest or not latest[r].finished]
    if missing:
        raise RuntimeError(
            f"vLLM step loop: {len(missing)} requests unfinished with none running ({missing[:3]})"
        )
    return [latest[r] for r in ids], updates


def token_versions(
    prompt_lens_B: torch.Tensor,
    response_mask_BS: torch.Tensor,
    start: int,
    updates: Sequence[tuple[int, torch.Tensor]],
) -> torch.Tensor:
    """``version_BS`` (int32 [B, S]; 0 on prompt and pad positions) of a batch laid out as
    ``types.py`` says: generated token g = s - prompt_len of sample b carries ``start`` or the
    version of the last update in ``updates`` ((version, counts_B), in order) with counts_B[b] <= g."""
    S = response_mask_BS.shape[1]
    g_BS = torch.arange(S)[None, :] - prompt_lens_B[:, None]
    version_BS = torch.full(g_BS.shape, start, dtype=torch.int32)
    for version, counts_B in updates:
        version_BS = torch.where(g_BS >= counts_B[:, None], version, version_BS)
    return torch.where(response_mask_BS, version_BS, 0).to(torch.int32)
