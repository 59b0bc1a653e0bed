"""moe_rl/rollout/vllm/inflight.py without vllm: the step loop over a scripted engine that admits two
requests a step (so one waits, as vLLM's scheduler makes requests wait when its budget is full), and
the per-token versions it counts. The real engine: tests/vllm/test_vllm_inflight.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_rl.rollout.vllm.abort import CutOutput, rows_so_far
from moe_rl.rollout.vllm.inflight import StepAbort, next_version, run_steps, token_versions
from moe_rl.routing.record import RouteError


class _Engine:
    """``LLMEngine``'s add_request / has_unfinished_requests / step / abort_request: request r
    generates ``lens[r]`` tokens (token value = its index), at most ``admit`` new requests start a
    step; each step returns every running request's cumulative output."""

    def __init__(self, lens: list[int], admit: int) -> None:
        self.lens, self.admit, self.ids, self.tokens, self.running = lens, admit, [], {}, []

    def add_request(self, rid, prompt, params) -> str:
        self.ids.append(rid)
        return f"{rid}-internal"  # vLLM's internal id (the output processor's key)

    def has_unfinished_requests(self) -> bool:
        return any(len(self.tokens.get(r, [])) < n for r, n in zip(self.ids, self.lens))

    def step(self) -> list:
        waiting = [r for r in self.ids if r not in self.tokens]
        for r in waiting[: self.admit]:
            self.tokens[r] = []
        out = []
        for r, n in zip(self.ids, self.lens):
            if r in self.tokens and len(self.tokens[r]) < n:
                self.tokens[r].append(len(self.tokens[r]))
                done = len(self.tokens[r]) == n
                toks = list(self.tokens[r])
                completion = SimpleNamespace(token_ids=toks, logprobs=[{t: -1.0} for t in toks])
                out.append(
                    SimpleNamespace(
                        request_id=r,
                        finished=done,
                        outputs=[completion],
                        prompt_token_ids=[1, 2],
                        num_cached_tokens=0,
                    )
                )
        return out

    def abort_request(self, ids) -> None:
        self.aborted = list(ids)


@pytest.mark.unit
def test_polls_wait_for_every_prefill_and_versions_follow_the_counts():
    engine, polls = _Engine([4, 2, 5], admit=2), []

    def poll(started: bool):
        polls.append(started)
        return {1: 7}.get(len(polls) - 1)  # the second poll delivers version 7

    requests = [(f"r{b}", {"prompt_token_ids": [1]}, None) for b in range(3)]
    outputs, landed = run_steps(engine, requests, poll)
    # before step 0 (none started); none before step 1 (r2 still waits); before steps 2-5 (r2's
    # 5 tokens end at step 5)
    assert polls == [False, True, True, True, True]
    assert [o.request_id for o in outputs] == ["r0", "r1", "r2"] and all(o.finished for o in outputs)
    (version, counts_B), *rest = landed
    assert version == 7 and rest == [] and counts_B.tolist() == [2, 2, 1]  # tokens each had before step 2
    # prompts of 1, 2, 3 tokens; the responses right after them, padded to S = 8
    prompt_lens_B = torch.tensor([1, 2, 3])
    s_S = torch.arange(8)
    mask_BS = (s_S >= prompt_lens_B[:, None]) & (s_S < (prompt_lens_B + torch.tensor([4, 2, 5]))[:, None])
    assert token_versions(prompt_lens_B, mask_BS, 3, landed).tolist() == [
        [0, 3, 3, 7, 7, 0, 0, 0],
        [0, 0, 3, 3, 0, 0, 0, 0],
        [0, 0, 0, 3, 7, 7, 7, 7],
    ]


@pytest.mark.unit
def test_an_update_source_that_raises_aborts_the_running_requests_and_versions_only_increase():
    engine = _Engine([3, 3], admit=2)

    def poll(started: bool):
        if started:
            raise RuntimeError("sync broke")
        return None

    with pytest.raises(RuntimeError, match="sync broke"):
        run_steps(engine, [("a", {}, None), ("b", {}, None)], poll)
    assert engine.aborted == ["a", "b"]
    assert next_version(2, None) == 3 and next_version(2, 5) == 5
    with pytest.raises(ValueError, match="weight version 2: the engine is at version 2"):
        next_version(2, 2)


def _rows(engine: _Engine, extra: int = 0):
    """A request's route rows so far as vLLM streams them: 2 prompt rows, then one per decode step."""

    def rows(internal_id: str):
        rid = internal_id.removesuffix("-internal")
        return np.zeros((2 + len(engine.tokens[rid]) - 1 + extra, 3, 2), dtype=np.uint8)

    return rows


@pytest.mark.unit
def test_the_abort_waits_for_every_first_token_then_cuts_the_unfinished_with_their_rows():
    """One request starts per step: the check at every 2nd step first runs at step 4 (the third
    request's first token came at step 3); it aborts the two unfinished ones, returned as their
    snapshots (tokens so far, P + G - 1 route rows) beside the finished one."""
    engine, seen = _Engine([2, 6, 7], admit=1), []

    def enough(done, snapshot) -> bool:
        seen.append(([len(engine.tokens[r]) for r in engine.ids], list(done)))
        return True

    requests = [(f"r{b}", {}, None) for b in range(3)]
    outputs, landed = run_steps(
        engine, requests, lambda s: None, StepAbort(2, enough, _rows(engine), (0, 0, 0))
    )
    assert seen == [([2, 3, 2], [True, False, False])]  # step 4: r0 done, r1 3 tokens, r2 2
    assert engine.aborted == ["r1", "r2"] and landed == []
    assert not isinstance(outputs[0], CutOutput) and outputs[0].finished
    cut1, cut2 = outputs[1:]
    assert isinstance(cut1, CutOutput) and cut1.outputs[0].token_ids == [0, 1, 2]
    assert cut2.outputs[0].token_ids == [0, 1] and cut2.outputs[0].finish_reason is None
    assert [c.outputs[0].routed_experts.shape[0] for c in (cut1, cut2)] == [4, 3]  # P + G - 1


@pytest.mark.unit
def test_a_check_that_peeks_then_aborts_reads_each_unfinished_request_once():
    """No engine step lies between the peek (dynamic sampling scores it) and the abort: the abort
    returns the peek's outputs, each unfinished request's rows read once, not twice."""
    engine, reads, peeked = _Engine([2, 6, 7], admit=1), [], []
    rows = _rows(engine)

    def counted(internal_id: str):
        reads.append(internal_id)
        return rows(internal_id)

    def enough(done, snapshot) -> bool:
        peeked.append(snapshot())
        return True

    requests = [(f"r{b}", {}, None) for b in range(3)]
    outputs, _ = run_steps(engine, requests, lambda s: None, StepAbort(2, enough, counted, (0, 0, 0)))
    assert sorted(reads) == ["r1-internal", "r2-internal"]
    assert all(a is b for a, b in zip(outputs, peeked[0], strict=True))


@pytest.mark.unit
def test_a_cut_request_whose_rows_do_not_match_its_tokens_is_a_route_error_naming_it():
    engine = _Engine([5, 5], admit=2)
    abort = StepAbort(2, lambda done, snap: True, _rows(engine, extra=1), (0, 0))
    with pytest.raises(
        RouteError, match=r"sample 0 \(vLLM request r0\), cut by the early abort: 4 route rows "
    ):
        run_steps(engine, [("r0", {}, None), ("r1", {}, None)], lambda s: None, abort)
    assert engine.aborted == ["r0", "r1"]  # none left running


@pytest.mark.unit
def test_the_route_row_accessor_names_the_vllm_version_and_the_missing_attribute():
    chunks = [np.ones((3, 2, 2), np.uint8), np.zeros((1, 2, 2), np.uint8)]
    state = SimpleNamespace(routed_experts_chunks=chunks)
    engine = SimpleNamespace(output_processor=SimpleNamespace(request_states={"a-1": state}))
    got = rows_so_far(engine, "a-1", "0.30.0")
    assert got.shape == (4, 2, 2) and got[:3].all() and not got[3].any()
    with pytest.raises(
        RuntimeError, match=r"vLLM 0.99.0: SimpleNamespace has no attribute 'output_processor'"
    ):
        rows_so_far(SimpleNamespace(), "a-1", "0.99.0")
    state_09 = SimpleNamespace(output_processor=SimpleNamespace(request_states={"a-1": SimpleNamespace()}))
    with pytest.raises(
        RuntimeError, match=r"vLLM 0.99.0: SimpleNamespace has no attribute 'routed_experts_chunks'"
    ):
        rows_so_far(state_09, "a-1", "0.99.0")
    state.routed_experts_chunks = []
    assert rows_so_far(engine, "a-1", "0.30.0") is None
