"""Rewards: closed-form values on hand-built batches, and vectorized vs reference-loop equality.

Shape suffixes: B sequences, S response length, A answer length.
"""

from __future__ import annotations

import random

import pytest
import torch

from moe_rl.metrics import Mean, Std, reduce_metrics
from moe_rl.tasks.rewards import REWARDS, char_accuracy, exact_match, register_reward, score
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.types import Prompt

TOK = CharTokenizer()
EOS, PAD = TOK.eos_id, TOK.pad_id


def _resp(spec: str) -> list[int]:
    """'123$' -> ids; '$' is eos, '_' is pad (a pad generated before eos, or right padding)."""
    return [EOS if c == "$" else PAD if c == "_" else TOK.encode(c)[0] for c in spec]


def _val(metric: Mean) -> torch.Tensor:
    """The local value of a Mean metric, as float32 for comparisons."""
    assert isinstance(metric, Mean)
    return (metric.sum / metric.count).float()


def _batch(cases: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(response spec, answer)] -> (response_ids_BS, answer_ids_BA), both right-padded."""
    response_BS = TOK.pad([_resp(r) for r, _ in cases])
    answer_BA = TOK.pad([TOK.encode(a) for _, a in cases])
    return response_BS, answer_BA


# (response, answer, exact_match, char_accuracy)
CASES = [
    ("123$", "123", 1.0, 1.0),
    ("123$__", "123", 1.0, 1.0),  # right padding after eos
    ("123$4", "123", 1.0, 1.0),  # tokens after the first eos are ignored
    ("123$$", "123", 1.0, 1.0),
    ("123", "123", 0.0, 0.5),  # no eos: hit the length limit
    ("123___", "123", 0.0, 0.5),  # no eos, padded
    ("12$", "123", 0.0, 1 / 3),  # eos too early: 2/3 chars, halved
    ("1234$", "123", 0.0, 0.5),  # extra token before eos
    ("123_$", "123", 0.0, 0.5),  # a pad token before eos is a wrong token
    ("124$", "123", 0.0, 2 / 3),  # one wrong char, eos in place
    ("321$", "123", 0.0, 1 / 3),
    ("$123", "123", 0.0, 0.0),  # empty response; the rest is ignored
    ("_", "123", 0.0, 0.0),
    ("12", "123", 0.0, 1 / 3),  # response shorter than the answer, no eos
    ("$", "", 1.0, 1.0),  # empty answer: eos first is exact
    ("1$", "", 0.0, 0.5),
    ("9$", "9", 1.0, 1.0),
    ("99999$", "99999", 1.0, 1.0),
    ("99998$", "99999", 0.0, 0.8),
]


@pytest.mark.unit
@pytest.mark.parametrize("name,column", [("exact_match", 2), ("char_accuracy", 3)])
def test_hand_built_batch(name: str, column: int) -> None:
    response_BS, answer_BA = _batch([(c[0], c[1]) for c in CASES])
    rewards_B, metrics = REWARDS[name](response_BS, answer_BA, EOS, PAD)
    expected_B = torch.tensor([c[column] for c in CASES], dtype=torch.float32)
    assert rewards_B.dtype == torch.float32 and rewards_B.shape == (len(CASES),)
    torch.testing.assert_close(rewards_B, expected_B)
    key = {"exact_match": "reward/exact_match_frac", "char_accuracy": "reward/char_accuracy_mean"}
    torch.testing.assert_close(_val(metrics[key[name]]), expected_B.mean())
    assert float(metrics[key[name]].count) == len(CASES)


@pytest.mark.unit
def test_hand_built_rows_one_at_a_time() -> None:
    # each row alone (no cross-row padding) gives the same values as in the batch
    for resp, ans, exact, chars in CASES:
        response_BS, answer_BA = _batch([(resp, ans)])
        assert exact_match(response_BS, answer_BA, EOS, PAD)[0].tolist() == [exact], resp
        torch.testing.assert_close(char_accuracy(response_BS, answer_BA, EOS, PAD)[0], torch.tensor([chars]))


@pytest.mark.unit
def test_char_accuracy_metrics() -> None:
    response_BS, answer_BA = _batch([("123$", "123"), ("12$", "123"), ("1234", "123")])
    _, metrics = char_accuracy(response_BS, answer_BA, EOS, PAD)
    torch.testing.assert_close(
        _val(metrics["reward/char_accuracy_chars_frac"]), torch.tensor((1 + 2 / 3 + 1) / 3)
    )
    torch.testing.assert_close(_val(metrics["reward/char_accuracy_eos_ok_frac"]), torch.tensor(1 / 3))
    torch.testing.assert_close(
        _val(metrics["reward/char_accuracy_mean"]), torch.tensor((1 + 1 / 3 + 0.5) / 3)
    )


@pytest.mark.unit
@pytest.mark.parametrize("name", ["exact_match", "char_accuracy"])
def test_extra_padding_does_not_change_rewards(name: str) -> None:
    response_BS, answer_BA = _batch([(c[0], c[1]) for c in CASES])
    base_B, _ = REWARDS[name](response_BS, answer_BA, EOS, PAD)
    wide_resp = torch.nn.functional.pad(response_BS, (0, 7), value=PAD)
    wide_ans = torch.nn.functional.pad(answer_BA, (0, 4), value=PAD)
    torch.testing.assert_close(REWARDS[name](wide_resp, wide_ans, EOS, PAD)[0], base_B)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["exact_match", "char_accuracy"])
def test_empty_and_mismatched_batches(name: str) -> None:
    rewards_B, metrics = REWARDS[name](
        torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long), EOS, PAD
    )
    assert rewards_B.shape == (0,)
    assert all(float(v.sum) == 0.0 and float(v.count) == 0.0 for v in metrics.values())
    rewards_B, _ = REWARDS[name](
        torch.zeros(2, 0, dtype=torch.long), TOK.pad([TOK.encode("1"), []]), EOS, PAD
    )
    assert rewards_B.tolist() == [0.0, 0.0 if name == "exact_match" else 0.5]
    with pytest.raises(ValueError, match="batch sizes differ"):
        REWARDS[name](torch.zeros(3, 4, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long), EOS, PAD)


@pytest.mark.unit
def test_registry_rejects_duplicates() -> None:
    before = dict(REWARDS)
    with pytest.raises(ValueError, match="'exact_match' is already registered"):
        register_reward("exact_match")(char_accuracy)
    assert REWARDS == before


# ---------------------------------------------------------------- score vs reference loop


def _ref_exact(resp: list[int], answer: list[int]) -> float:
    if EOS not in resp:
        return 0.0
    return float(resp[: resp.index(EOS)] == answer)


def _ref_char(resp: list[int], answer: list[int]) -> float:
    has_eos = EOS in resp
    body = resp[: resp.index(EOS)] if has_eos else resp
    matched = sum(1 for j, a in enumerate(answer) if j < len(body) and body[j] == a)
    chars = matched / len(answer) if answer else 1.0
    return chars * (1.0 if has_eos and len(body) == len(answer) else 0.5)


REF = {"exact_match": _ref_exact, "char_accuracy": _ref_char}


def _random_response(rng: random.Random, answer: list[int], max_len: int) -> list[int]:
    """A near-miss of answer + eos: mutations, early/late/missing eos, junk after eos."""
    body = list(answer)
    for j in range(len(body)):
        if rng.random() < 0.2:
            body[j] = rng.randrange(TOK.vocab_size)
    roll = rng.random()
    if roll < 0.2:
        body = body[: rng.randrange(len(body) + 1)]
    elif roll < 0.35:
        body += [rng.randrange(3, TOK.vocab_size) for _ in range(rng.randrange(1, 3))]
    out = body if rng.random() < 0.15 else body + [EOS]
    out += [rng.randrange(TOK.vocab_size) for _ in range(rng.randrange(3))]
    return out[:max_len]


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(8))
def test_score_matches_reference_loop(seed: int) -> None:
    rng = random.Random(seed)
    group_size = rng.choice([1, 2, 4])
    num_prompts = rng.randrange(1, 12)
    tasks = ["reverse", "sort", "copy"]
    prompts = []
    for _ in range(num_prompts):
        answer = "".join(rng.choice("0123456789") for _ in range(rng.randrange(0, 6)))
        prompts.append(
            Prompt([TOK.bos_id] + TOK.encode("C1:"), answer, rng.choice(sorted(REWARDS)), rng.choice(tasks))
        )
    max_len = rng.randrange(1, 10)
    responses = [
        _random_response(rng, TOK.encode(prompts[b // group_size].answer), max_len)
        for b in range(num_prompts * group_size)
    ]
    response_BS = TOK.pad(responses, length=max(max_len, 1))

    rewards_B, metrics = score(prompts, response_BS, TOK, group_size, task_names=tasks)

    expected = []
    for b, resp in enumerate(response_BS.tolist()):
        p = prompts[b // group_size]
        expected.append(REF[p.reward](resp, TOK.encode(p.answer)))
    expected_B = torch.tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(rewards_B, expected_B)
    assert rewards_B.dtype == torch.float32
    assert bool(((rewards_B >= 0) & (rewards_B <= 1)).all())
    torch.testing.assert_close(_val(metrics["reward/mean"]), expected_B.mean())
    std = metrics["reward/std"]
    assert isinstance(std, Std) and float(std.count) == len(expected)
    torch.testing.assert_close(float(std.sum_sq), float((expected_B.double() ** 2).sum()))
    exact = [
        _ref_exact(r, TOK.encode(prompts[b // group_size].answer)) for b, r in enumerate(response_BS.tolist())
    ]
    torch.testing.assert_close(_val(metrics["reward/exact_match_frac"]), torch.tensor(exact).mean())
    eos_frac = sum(EOS in r for r in response_BS.tolist()) / len(responses)
    torch.testing.assert_close(_val(metrics["reward/eos_frac"]), torch.tensor(eos_frac))
    for task in tasks:
        vals = [expected[b] for b in range(len(expected)) if prompts[b // group_size].task == task]
        m = metrics[f"reward/mean/{task}"]
        assert float(m.count) == len(vals)
        torch.testing.assert_close(float(m.sum), float(sum(vals)))


@pytest.mark.unit
def test_char_accuracy_is_one_iff_exact() -> None:
    rng = random.Random(0)
    answers = ["".join(rng.choice("0123456789") for _ in range(rng.randrange(0, 6))) for _ in range(400)]
    responses = [_random_response(rng, TOK.encode(a), 8) for a in answers]
    response_BS, answer_BA = TOK.pad(responses, length=8), TOK.pad(TOK.encode_batch(answers))
    exact_B, _ = exact_match(response_BS, answer_BA, EOS, PAD)
    chars_B, _ = char_accuracy(response_BS, answer_BA, EOS, PAD)
    assert 0 < int(exact_B.sum()) < len(answers)  # the batch has both kinds
    assert torch.equal(exact_B == 1, chars_B == 1)
    assert bool((chars_B >= exact_B).all())


@pytest.mark.unit
def test_score_group_layout_and_errors() -> None:
    prompts = [Prompt([1], "12", "exact_match", "copy"), Prompt([1], "3", "char_accuracy", "sort")]
    response_BS = TOK.pad([_resp("12$"), _resp("21$"), _resp("3$"), _resp("4$")])
    rewards_B, metrics = score(
        prompts, response_BS, TOK, group_size=2, task_names=("copy", "sort", "reverse")
    )
    assert rewards_B.tolist() == [1.0, 0.0, 1.0, 0.0]
    out = reduce_metrics(metrics)  # local reduction: no process group
    assert out["reward/mean/copy"] == 0.5 and out["reward/mean/sort"] == 0.5
    assert out["reward/mean"] == 0.5 and out["reward/std"] == 0.5
    assert out["reward/exact_match_frac"] == 0.5 and out["reward/eos_frac"] == 1.0
    assert float(metrics["reward/mean/reverse"].count) == 0  # listed but absent: zero count
    with pytest.raises(ValueError, match="4 responses for 2 prompts x 3 samples"):
        score(prompts, response_BS, TOK, group_size=3)
    with pytest.raises(ValueError, match="unknown reward 'bleu'"):
        score([Prompt([1], "1", "bleu", "copy")], response_BS[:1], TOK, group_size=1)


@pytest.mark.unit
def test_score_keys_do_not_depend_on_the_local_mix() -> None:
    # ranks reduce metrics together, so each must return the same keys whatever it drew
    names = ("copy", "sort", "reverse")
    key_sets = set()
    mixes = [("copy", "exact_match"), ("sort", "char_accuracy"), ("reverse", "exact_match")]
    for task, reward in mixes:
        prompts = [Prompt([1], "1", reward, task)]
        _, metrics = score(prompts, TOK.pad([_resp("1$")]), TOK, 1, task_names=names)
        key_sets.add(tuple(sorted(metrics)))
    _, metrics = score([], torch.zeros(0, 3, dtype=torch.long), TOK, 2, task_names=names)
    key_sets.add(tuple(sorted(metrics)))
    assert key_sets == {
        tuple(
            sorted(
                ["reward/mean", "reward/std", "reward/exact_match_frac", "reward/eos_frac"]
                + [f"reward/mean/{t}" for t in names]
            )
        )
    }


# ---------------------------------------------------------------- text rewards through score()


@pytest.mark.unit
def test_score_text_rewards_with_hf_tokenizer(hf_tok_dir, tmp_path) -> None:
    from moe_rl.tasks.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(hf_tok_dir)
    user = tmp_path / "r.py"
    user.write_text(
        "def f(prompt, response, ground_truth, extra):\n"
        "    if response == 'x':\n        raise ValueError('no')\n"
        "    return {'score': 0.25 * extra['k']}\n"
    )
    prompts = [
        Prompt([1], "12", "math", "a", text="q"),
        Prompt([1], "3", f"python:{user}:f", "b", extra={"k": 2}),
    ]
    texts = ["so \\boxed{12}", "\\boxed{13}", "y", "x"]
    rows = [tok.encode(t) + [tok.eos_id, 5, 6] for t in texts]  # anything after the first eos is ignored
    rewards_B, m = score(prompts, tok.pad(rows), tok, 2, task_names=("a", "b"), text_metrics=True)
    assert rewards_B.tolist() == [1.0, 0.0, 0.5, 0.0]
    assert {k: float(v.sum / v.count) for k, v in m.items() if isinstance(v, Mean)} == {
        "reward/mean": 0.375,
        "reward/eos_frac": 1.0,
        "reward/error_frac": 0.25,
        "reward/timeout_frac": 0.0,
        "reward/mean/a": 0.5,
        "reward/mean/b": 0.25,
    }


@pytest.mark.unit
def test_overlong_penalty_is_dapo_soft_linear() -> None:
    from moe_rl.tasks.rewards import overlong_penalty

    penalty_B, m = overlong_penalty(
        torch.tensor([10, 16, 17, 18, 20]), max_new_tokens=20, buffer=4, factor=0.5
    )
    assert penalty_B.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert (
        float(m["reward/overlong_frac"].sum) == 3.0 and float(m["reward/overlong_penalty_mean"].sum) == -0.875
    )


@pytest.mark.unit
@pytest.mark.parametrize("workers", [0, 1])
def test_reward_that_exits_or_returns_text_scores_an_error(hf_tok_dir, tmp_path, workers) -> None:
    """sys.exit in the call (a BaseException) and a returned "0.75" (text, not a number) score 0 and
    are counted in reward/error_frac, in the trainer's process and in a worker; the step goes on."""
    from moe_rl.tasks.hf_tokenizer import HFTokenizer
    from moe_rl.tasks.text_rewards import RewardPool

    tok = HFTokenizer(hf_tok_dir)
    user = tmp_path / "r.py"
    user.write_text(
        "import sys\n"
        "def f(prompt, response, ground_truth, extra):\n"
        "    if response == 'x':\n        sys.exit(3)\n"
        "    if response == 'y':\n        return '0.75'\n"
        "    return {'score': 0.75}\n"
    )
    prompts = [Prompt([1], "3", f"python:{user}:f", "b")]
    rows = [tok.encode(t) + [tok.eos_id] for t in ("x", "y", "z", "x")]
    pool = RewardPool(workers, 5.0)
    try:
        rewards_B, m = score(prompts, tok.pad(rows), tok, 4, task_names=("b",), pool=pool, text_metrics=True)
    finally:
        pool.close()
    assert rewards_B.tolist() == [0.0, 0.0, 0.75, 0.0]
    assert float(m["reward/error_frac"].sum / m["reward/error_frac"].count) == 0.75
    assert float(m["reward/timeout_frac"].sum) == 0.0
