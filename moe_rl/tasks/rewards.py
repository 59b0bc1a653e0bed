"""Verifiable rewards: a registry of vectorized scoring functions, and ``score`` to dispatch them.

One name space for ``task.reward``: the token rewards below (``REWARDS``, vectorised over ids; they
serve the built-in character tokenizer), the text rewards of ``moe_rl/tasks/text_rewards.py`` (``math``,
text forms of ``exact_match`` / ``char_accuracy``; scored per sample in a worker pool) and
``python:FILE.py:FUNCTION``. ``check_reward_name`` checks a name against all of them.

Every reward function has one signature::

    fn(response_ids_BS, answer_ids_BA, eos_id, pad_id) -> (rewards_B, metrics)

Shape suffixes: B sequences, S response length, A answer length, L = max(S, A + 1).

``response_ids_BS`` holds the generated tokens only (no prompt), right-padded with pad; it may
contain eos. The response ends at its FIRST eos: anything after it is ignored (engines stop at eos,
and ``CharTokenizer.decode`` reads the same way). A response without eos (it hit the length limit)
never counts as finished. ``answer_ids_BA`` holds the answers' tokens without eos, right-padded
with pad; an answer never contains pad or eos, so its length is its count of non-pad tokens.

Rules:
    exact_match    1 iff the response is exactly the answer followed by eos, else 0.
    char_accuracy  (matched / answer_len) * (1 if the first eos sits right after the answer,
                   else 0.5), where matched counts answer positions j with response[j] ==
                   answer[j] before the first eos. An empty answer counts as fully matched. It is 1
                   iff exact_match is 1, and partial credit otherwise.

Scoring is pure tensor math (no per-sample Python loop, no ``.item()``). Metrics follow
``moe_rl.metrics``: local ``Mean(sum, count)`` / ``Std`` values under ``reward/...`` keys, reduced
across ranks only by ``reduce_metrics``. ``score`` returns the same keys on every rank (whatever
mix of tasks and rewards a rank happens to draw), as that reduction requires.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from moe_rl.metrics import Mean, MetricValue, Std
from moe_rl.registry import Registry
from moe_rl.tasks.text_rewards import (
    TEXT_REWARDS,
    USER_PREFIX,
    RewardPool,
    TextSample,
    TextScore,
    load_user_reward,
)
from moe_rl.tasks.tokenizer import CharTokenizer

if TYPE_CHECKING:
    from moe_rl.types import Prompt

Metrics = dict[str, MetricValue]
RewardFn = Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, Metrics]]

REWARDS: Registry[RewardFn] = Registry("reward")
register_reward = REWARDS.register


def _align(
    response_ids_BS: torch.Tensor, answer_ids_BA: torch.Tensor, eos_id: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad both sides to a common length L = max(S, A + 1) and find lengths.

    Returns:
        resp_BL: int64 [B, L] the response, pad beyond S.
        ans_BL: int64 [B, L] the answer, pad beyond its length.
        answer_len_B: int64 [B] number of answer tokens.
        first_eos_B: int64 [B] index of the first eos in the response, L when there is none.
    """
    if response_ids_BS.dim() != 2 or answer_ids_BA.dim() != 2:
        raise ValueError("response_ids_BS and answer_ids_BA must be 2-D [B, S] / [B, A]")
    if response_ids_BS.shape[0] != answer_ids_BA.shape[0]:
        raise ValueError(
            f"batch sizes differ: responses {response_ids_BS.shape[0]}, answers {answer_ids_BA.shape[0]}"
        )
    (num_seqs, resp_len), ans_len = response_ids_BS.shape, answer_ids_BA.shape[1]
    length = max(resp_len, ans_len + 1)
    resp_BL = torch.full((num_seqs, length), pad_id, dtype=torch.long, device=response_ids_BS.device)
    resp_BL[:, :resp_len] = response_ids_BS
    ans_BL = torch.full_like(resp_BL, pad_id)
    ans_BL[:, :ans_len] = answer_ids_BA
    answer_len_B = (ans_BL != pad_id).sum(dim=1)
    is_eos_BL = resp_BL == eos_id
    first_eos_B = torch.where(
        is_eos_BL.any(dim=1), is_eos_BL.long().argmax(dim=1), torch.full_like(answer_len_B, length)
    )
    return resp_BL, ans_BL, answer_len_B, first_eos_B


def _mean(x_B: torch.Tensor) -> Mean:
    """Local ``Mean(sum, count)`` of a [B] tensor (bool or float); count 0 for an empty batch."""
    x_B = x_B.to(torch.float64)
    return Mean(x_B.sum(), torch.tensor(float(x_B.numel()), dtype=torch.float64, device=x_B.device))


@register_reward("exact_match")
def exact_match(
    response_ids_BS: torch.Tensor, answer_ids_BA: torch.Tensor, eos_id: int, pad_id: int
) -> tuple[torch.Tensor, Metrics]:
    """1 iff the response is exactly the answer followed by eos.

    Args:
        response_ids_BS: int64 [B, S] generated tokens, right-padded with pad.
        answer_ids_BA: int64 [B, A] answer tokens (no eos), right-padded with pad.
        eos_id, pad_id: the tokenizer's ids.
    Returns:
        rewards_B: float32 [B] in {0, 1}.
        metrics: ``reward/exact_match_frac``.
    """
    resp_BL, ans_BL, answer_len_B, first_eos_B = _align(response_ids_BS, answer_ids_BA, eos_id, pad_id)
    pos_BL = torch.arange(resp_BL.shape[1], device=resp_BL.device).expand_as(resp_BL)
    before_BL = pos_BL < answer_len_B[:, None]
    rewards_B = ((resp_BL == ans_BL) | ~before_BL).all(dim=1) & (first_eos_B == answer_len_B)
    rewards_B = rewards_B.float()
    return rewards_B, {"reward/exact_match_frac": _mean(rewards_B)}


@register_reward("char_accuracy")
def char_accuracy(
    response_ids_BS: torch.Tensor, answer_ids_BA: torch.Tensor, eos_id: int, pad_id: int
) -> tuple[torch.Tensor, Metrics]:
    """Fraction of answer characters right, halved unless eos directly follows the answer.

    Args:
        response_ids_BS: int64 [B, S] generated tokens, right-padded with pad.
        answer_ids_BA: int64 [B, A] answer tokens (no eos), right-padded with pad.
        eos_id, pad_id: the tokenizer's ids.
    Returns:
        rewards_B: float32 [B] in [0, 1]; 1 iff the response is an exact match.
        metrics: ``reward/char_accuracy_mean`` (the reward), ``reward/char_accuracy_chars_frac``
            (matched / answer_len, before the eos factor), ``reward/char_accuracy_eos_ok_frac``.
    """
    resp_BL, ans_BL, answer_len_B, first_eos_B = _align(response_ids_BS, answer_ids_BA, eos_id, pad_id)
    pos_BL = torch.arange(resp_BL.shape[1], device=resp_BL.device).expand_as(resp_BL)
    counted_BL = (pos_BL < answer_len_B[:, None]) & (pos_BL < first_eos_B[:, None])
    matched_B = ((resp_BL == ans_BL) & counted_BL).sum(dim=1)
    chars_B = torch.where(
        answer_len_B > 0,
        matched_B / answer_len_B.clamp(min=1),
        torch.ones_like(matched_B, dtype=torch.float32),
    ).float()
    eos_ok_B = first_eos_B == answer_len_B
    rewards_B = chars_B * torch.where(eos_ok_B, 1.0, 0.5)
    metrics = {
        "reward/char_accuracy_mean": _mean(rewards_B),
        "reward/char_accuracy_chars_frac": _mean(chars_B),
        "reward/char_accuracy_eos_ok_frac": _mean(eos_ok_B),
    }
    return rewards_B.float(), metrics


def check_reward_name(name: str) -> None:
    """A token reward, a text reward or an importable ``python:FILE.py:FUNCTION``; ValueError otherwise."""
    if name.startswith(USER_PREFIX):
        load_user_reward(name)
    elif name not in REWARDS and name not in TEXT_REWARDS:
        raise ValueError(
            f"unknown reward {name!r}; known: {sorted(set(REWARDS) | set(TEXT_REWARDS))} "
            f"or python:FILE.py:FUNCTION"
        )


def uses_token_reward(name: str, tokenizer) -> bool:
    """Token rewards (vectorised over ids) serve the character tokenizer; text rewards the rest."""
    return isinstance(tokenizer, CharTokenizer) and name in REWARDS


def score(
    prompts: list[Prompt],
    response_ids_BS: torch.Tensor,
    tokenizer: CharTokenizer,
    group_size: int,
    task_names: Sequence[str] = (),
    pool: RewardPool | None = None,
    text_metrics: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """Score B = len(prompts) * group_size responses; sequence b answers prompt b // group_size.

    Each reward kind present runs once: a token reward vectorized over the sequences (selected by
    mask) whose prompt names it (character tokenizer), a text reward per sample on the decoded
    responses in ``pool`` (``moe_rl/tasks/text_rewards.py``).

    Args:
        prompts: P prompts, each naming its answer, reward and task.
        response_ids_BS: int64 [B, S] generated tokens, right-padded with the pad id.
        tokenizer: encodes the answers / decodes the responses.
        group_size: samples per prompt.
        task_names: tasks that get a ``reward/mean/<task>`` metric (pass the source's
            ``task_names`` so every rank has the same keys); a task missing locally gives a
            zero-count Mean.
        pool: scores text rewards (default: in this process, 10 s per sample).
        text_metrics: add ``reward/error_frac`` and ``reward/timeout_frac`` (the run's config
            decides, so every rank has the same keys).
    Returns:
        rewards_B: float32 [B] in [0, 1].
        metrics: local ``reward/mean``, ``reward/std``, ``reward/exact_match_frac`` (character
            tokenizer), ``reward/eos_frac`` (responses containing eos) and ``reward/mean/<task>``.
    Raises:
        ValueError: B != len(prompts) * group_size, or a prompt names an unknown reward.
    """
    if group_size < 1 or response_ids_BS.dim() != 2:
        raise ValueError(f"need group_size >= 1 (got {group_size}) and a 2-D response tensor")
    num_seqs = response_ids_BS.shape[0]
    if num_seqs != len(prompts) * group_size:
        raise ValueError(f"{num_seqs} responses for {len(prompts)} prompts x {group_size} samples")
    device = response_ids_BS.device
    rewards_B = torch.zeros(num_seqs, dtype=torch.float32, device=device)
    error_B, timeout_B = (
        torch.zeros_like(rewards_B, dtype=torch.bool),
        torch.zeros_like(rewards_B, dtype=torch.bool),
    )
    char = isinstance(tokenizer, CharTokenizer)
    answer_ids_BA = None
    if char:
        answer_ids_BA = tokenizer.pad([tokenizer.encode(p.answer) for p in prompts]).to(device)
        answer_ids_BA = answer_ids_BA.repeat_interleave(group_size, dim=0)
    for name, mask_B in _group_masks([p.reward for p in prompts], group_size, device).items():
        check_reward_name(name)
        if uses_token_reward(name, tokenizer):
            rewards_B[mask_B], _ = REWARDS[name](
                response_ids_BS[mask_B], answer_ids_BA[mask_B], tokenizer.eos_id, tokenizer.pad_id
            )
        else:
            idx = mask_B.nonzero().flatten().tolist()
            scored = _score_text(prompts, response_ids_BS, idx, group_size, tokenizer, pool)
            rewards_B[mask_B] = torch.tensor([x.score for x in scored], dtype=torch.float32, device=device)
            error_B[mask_B] = torch.tensor([x.error for x in scored], dtype=torch.bool, device=device)
            timeout_B[mask_B] = torch.tensor([x.timed_out for x in scored], dtype=torch.bool, device=device)
    r64_B = rewards_B.to(torch.float64)
    metrics: Metrics = {
        "reward/mean": _mean(rewards_B),
        "reward/std": Std(r64_B.sum(), (r64_B * r64_B).sum(), _mean(r64_B).count),
    }
    if char:
        exact_B, _ = exact_match(response_ids_BS, answer_ids_BA, tokenizer.eos_id, tokenizer.pad_id)
        metrics["reward/exact_match_frac"] = _mean(exact_B)
    eos_ids = torch.tensor(tokenizer.eos_ids, dtype=response_ids_BS.dtype, device=device)
    metrics["reward/eos_frac"] = _mean(torch.isin(response_ids_BS, eos_ids).any(dim=1))
    if text_metrics:
        metrics["reward/error_frac"], metrics["reward/timeout_frac"] = _mean(error_B), _mean(timeout_B)
    task_masks = _group_masks([p.task for p in prompts], group_size, device)
    for task in task_names:
        mask_B = task_masks.get(task, torch.zeros(num_seqs, dtype=torch.bool, device=device))
        metrics[f"reward/mean/{task}"] = _mean(rewards_B[mask_B])
    return rewards_B, metrics


def _score_text(
    prompts: list[Prompt],
    response_ids_BS: torch.Tensor,
    idx: list[int],
    group_size: int,
    tokenizer,
    pool: RewardPool | None,
) -> list[TextScore]:
    """Decode the responses ``idx`` and score them (per sample: text rewards are Python)."""
    rows = response_ids_BS[idx].tolist()
    samples = []
    for b, row in zip(idx, rows):
        p = prompts[b // group_size]
        samples.append(TextSample(p.reward, p.text, tokenizer.decode(row), p.answer, p.extra))
    return (pool or RewardPool(0, 10.0)).score(samples)


def overlong_penalty(
    response_lens_B: torch.Tensor, max_new_tokens: int, buffer: int, factor: float
) -> tuple[torch.Tensor, Metrics]:
    """DAPO's soft overlong penalty: 0 up to L - buffer tokens, then falling linearly to -factor at
    L = max_new_tokens (DAPO eq. 13, L_cache = buffer).

    Args:
        response_lens_B: int64 [B] generated tokens (stop token included).
    Returns:
        penalty_B: float32 [B] in [-factor, 0]; metrics ``reward/overlong_penalty_mean``,
        ``reward/overlong_frac`` (responses inside the penalised window).
    """
    over_B = (response_lens_B.float() - (max_new_tokens - buffer)).clamp(min=0.0)
    penalty_B = -(over_B / buffer).clamp(max=1.0) * factor
    return penalty_B, {
        "reward/overlong_penalty_mean": _mean(penalty_B),
        "reward/overlong_frac": _mean(over_B > 0),
    }


def _group_masks(labels: list[str], group_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Per-prompt labels -> {label: bool [B] mask of the sequences whose prompt has it}."""
    names = sorted(set(labels))
    position = {name: k for k, name in enumerate(names)}
    index_P = torch.tensor([position[x] for x in labels], dtype=torch.long, device=device)
    index_B = index_P.repeat_interleave(group_size)
    return {name: index_B == k for k, name in enumerate(names)}
