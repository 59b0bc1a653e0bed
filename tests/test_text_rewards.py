"""Text rewards: the math reward on a table of answer formats, user functions by path, errors and
time limits scored 0 and counted, the worker pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.tasks.rewards import check_reward_name
from moe_rl.tasks.text_rewards import (
    RewardPool,
    TextSample,
    TextScore,
    boxed_contents,
    extract_final_answer,
    math_reward,
    score_chunk,
    score_sample,
)

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"

MATH_TABLE = [  # (response, ground truth, reward)
    ("The answer is \\boxed{72}.", "72", 1.0),  # integer
    ("\\boxed{-3}", "-3", 1.0),  # negative
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # LaTeX fraction vs decimal
    ("\\boxed{1/2}", "\\frac12", 1.0),  # slash fraction
    ("\\boxed{0.50}", "1/2", 1.0),  # decimal vs fraction
    ("\\boxed{3.14}", "3.14", 1.0),  # decimal
    ("\\boxed{1,000}", "1000", 1.0),  # thousands comma
    ("\\boxed{12 \\text{ cm}}", "12", 1.0),  # LaTeX unit
    ("\\boxed{12 dollars}", "12", 1.0),  # unit word
    ("\\boxed{\\$12}", "12", 1.0),  # currency
    ("\\boxed{x=5}", "5", 1.0),  # equation
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),  # \dfrac
    ("\\boxed{\\sqrt{2}}", "\\sqrt 2", 1.0),  # radical
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # equivalent radicals
    ("\\boxed{50\\%}", "50", 1.0),  # percent
    ("\\boxed{7}", "8", 0.0),  # wrong
    ("\\boxed{}", "5", 0.0),  # empty box
    ("I do not know.", "5", 0.0),  # no final answer
    ("\\boxed{abc}", "5", 0.0),  # garbage
    ("\\boxed{\\text{garbage}}", "5", 0.0),  # garbage text
    ("", "5", 0.0),  # empty response
    ("\\boxed{\\pi}", "\\pi", 1.0),  # constant
    ("\\boxed{\\frac{1}{3}}", "0.333", 0.0),  # rounding is not equal
    ("\\boxed{-\\frac{2}{3}}", "-2/3", 1.0),  # negative fraction
    ("\\boxed{3.0}", "3", 1.0),  # trailing zero
    ("\\boxed{5.}", "5", 1.0),  # trailing period
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),  # nested braces
    ("\\boxed{{5}}", "5", 1.0),  # doubled braces
    ("first \\boxed{3}, then \\boxed{4}", "4", 1.0),  # several boxes: the last
    ("first \\boxed{3}, then \\boxed{4}", "3", 0.0),  # ... not the first
    ("so it is \\boxed{6", "6", 0.0),  # unclosed box
    ("\\boxed 5", "5", 1.0),  # box without braces
    ("\\fbox{9}", "9", 1.0),  # \fbox
    ("$\\boxed{10}$.", "10", 1.0),  # inside math mode
    ("Step 1 ...\n#### 72", "72", 1.0),  # GSM8K marker
    ("#### 1,234", "1234", 1.0),  # GSM8K with comma
    ("\\boxed{72}", GSM8K_SOLUTION, 1.0),  # GSM8K solution as ground truth
    ("\\boxed{10^{3}}", "1000", 1.0),  # power
    ("\\boxed{1e3}", "1000", 1.0),  # scientific notation
    ("\\boxed{-0}", "0", 1.0),  # signed zero
    ("\\boxed{12}", "12.0", 1.0),  # decimal ground truth
]


@pytest.mark.unit
@pytest.mark.parametrize("response,truth,expected", MATH_TABLE)
def test_math_reward_table(response: str, truth: str, expected: float) -> None:
    assert len(MATH_TABLE) >= 30
    assert math_reward("", response, truth, {}) == expected


@pytest.mark.unit
def test_extraction() -> None:
    assert boxed_contents("a \\boxed{1} b \\boxed{\\frac{a}{b}} c \\fbox{x}") == ["1", "\\frac{a}{b}", "x"]
    assert boxed_contents("\\boxed{unclosed") == []
    assert extract_final_answer("x \\boxed{2} #### 3") == "2"  # a box wins over ####
    assert extract_final_answer("#### 1\n#### 2") == "2"
    assert extract_final_answer("nothing") is None


def _user_module(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "import time\n"
        "def score(prompt, response, ground_truth, extra):\n"
        "    return {'score': float(response == ground_truth) + extra.get('bonus', 0.0), 'note': 'x'}\n"
        "def plain(prompt, response, ground_truth, extra):\n"
        "    return len(prompt)\n"
        "def boom(prompt, response, ground_truth, extra):\n"
        "    raise RuntimeError('bad')\n"
        "def nan(prompt, response, ground_truth, extra):\n"
        "    return float('nan')\n"
        "def slow(prompt, response, ground_truth, extra):\n"
        "    time.sleep(30)\n"
        "    return 1.0\n"
    )
    return path


@pytest.mark.unit
def test_user_function_errors_and_time_limit(tmp_path: Path) -> None:
    mod = _user_module(tmp_path)
    ok = TextSample(f"python:{mod}:score", "p", "42", "42", {"bonus": 0.5})
    assert score_sample(ok, 5.0) == TextScore(1.5)
    assert score_sample(TextSample(f"python:{mod}:plain", "abc", "", "", {}), 5.0) == TextScore(3.0)
    assert score_sample(TextSample(f"python:{mod}:boom", "", "", "", {}), 5.0) == TextScore(0.0, error=True)
    assert score_sample(TextSample(f"python:{mod}:nan", "", "", "", {}), 5.0) == TextScore(0.0, error=True)
    slow = score_sample(TextSample(f"python:{mod}:slow", "", "", "", {}), 0.2)
    assert slow == TextScore(0.0, error=True, timed_out=True)
    assert score_sample(TextSample("math", "", "\\boxed{2}", "2"), 5.0) == TextScore(1.0)


@pytest.mark.unit
def test_reward_names_are_checked(tmp_path: Path) -> None:
    mod = _user_module(tmp_path)
    for name in ("math", "exact_match", "char_accuracy", f"python:{mod}:score"):
        check_reward_name(name)
    with pytest.raises(
        ValueError, match=r"unknown reward 'bleu'; known: \['char_accuracy', 'exact_match', 'math'\]"
    ):
        check_reward_name("bleu")
    with pytest.raises(ValueError, match=r"nope\.py does not exist"):
        check_reward_name(f"python:{tmp_path}/nope.py:score")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"broken\.py does not import: ModuleNotFoundError"):
        check_reward_name(f"python:{broken}:score")
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError) as err:  # SystemExit is a BaseException: it must not end the trainer
        check_reward_name(f"python:{exits}:score")
    assert str(err.value) == f"task.reward='python:{exits}:score': {exits} calls sys.exit(3) on import"
    with pytest.raises(ValueError, match=r"has no function 'missing'"):
        check_reward_name(f"python:{mod}:missing")
    with pytest.raises(ValueError, match=r"use python:FILE\.py:FUNCTION"):
        check_reward_name("python:score")


@pytest.mark.unit
def test_pool_matches_inline_and_survives_errors(tmp_path: Path) -> None:
    mod = _user_module(tmp_path)
    samples = [TextSample("math", "", f"\\boxed{{{i}}}", str(i % 3)) for i in range(6)]
    samples += [
        TextSample(f"python:{mod}:boom", "", "", "", {}),
        TextSample(f"python:{mod}:score", "", "a", "a", {}),
    ]
    pool = RewardPool(2, 5.0)
    try:
        got = pool.score(samples)
    finally:
        pool.close()
    assert got == score_chunk(samples, 5.0)
    assert [s.score for s in got] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert [s.error for s in got] == [False] * 6 + [True, False]


@pytest.mark.unit
def test_pool_ends_a_worker_that_stops_answering(tmp_path: Path) -> None:
    hang = tmp_path / "hang.py"
    hang.write_text(
        "import signal, time\n"
        "def score(prompt, response, ground_truth, extra):\n"
        "    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # as a hang in C code would: no alarm\n"
        "    time.sleep(60)\n"
    )
    pool = RewardPool(1, 0.2)
    pool.STARTUP_GRACE_S = 0.0
    try:
        got = pool.score(
            [TextSample(f"python:{hang}:score", "", "", ""), TextSample("math", "", "\\boxed{1}", "1")]
        )
        assert (
            got == [TextScore(0.0, error=True, timed_out=True)] * 2
        )  # the second waited behind the hung one
        pool.STARTUP_GRACE_S = RewardPool.STARTUP_GRACE_S
        assert pool.score([TextSample("math", "", "\\boxed{1}", "1")]) == [TextScore(1.0)]  # a fresh pool
    finally:
        pool.close()
