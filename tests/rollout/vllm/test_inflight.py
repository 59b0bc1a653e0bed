"""moe_rl/rollout/vllm/inflight.py without vllm: the step loop over a scripted engine that admits two
requests a step (so one waits, as vLLM's scheduler makes requests wait when its budget is full), and
the per-token versions it counts. The real engine: tests/vllm/test_vllm_inflight.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_rl.rollout.vllm.inflight import next_version, run_steps, token_versions


class _Engine:
    """``LLMEngine``'s add_request / has_unfinished_requests / step / abort_request: request r
    generates ``lens[r]`` tokens (token value = its index), at most ``admit`` new requests start a
    step; each step returns every running request's cumulative output."""

    def __init__(self, lens: list[int], admit: int) -> None:
        self.lens, self.admit, self.ids, self.tokens, self.running = lens, admit, [], {}, []

    def add_request(self, rid, prompt, params) -> None:
        self.ids.append(rid)

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
                out.append(
                    SimpleNamespace(
                        request_id=r, finished=done, outputs=[SimpleNamespace(token_ids=list(self.tokens[r]))]
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
