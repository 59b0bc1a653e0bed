"""Rewards scored on text, per sample, in a worker pool: ``math``, the text forms of ``exact_match``
and ``char_accuracy``, and user functions by path (``task.reward=python:my_rewards.py:score``).

A text reward is ``fn(prompt, response, ground_truth, extra) -> float | {"score": float, ...}``:
the prompt text, the decoded response (cut at the first EOS, special tokens skipped), the
ground-truth string and the dataset row's other fields. A reward that raises, returns something
that is not a finite number, or runs past ``timeout_s`` scores 0 and is counted (``TextScore.error``,
``reward/error_frac``); it never kills the step.

``math`` (NeMo-RL / verl style): the final answer is the content of the LAST ``\\boxed{...}``
(nested braces balanced; ``\\fbox`` too), else the text after the last ``#### `` (GSM8K); no final
answer scores 0. The ground truth goes through the same extraction (a GSM8K solution ending in
``#### 72`` means 72), falling back to the whole string. Both are normalised (``$``, ``\\!``, a
trailing period, thousands commas, a trailing unit word such as ``12 dollars``), compared as plain
numbers when both are, else with math-verify (``parse`` + ``verify``: fractions, LaTeX, intervals,
sets, percentages, equations ``x=5``).

Pool (``RewardPool``): ``workers`` processes (spawned; this module imports neither torch nor the
rest of the package, and ``moe_rl/tasks/__init__.py`` imports nothing, so they start in about two
seconds, once, while the model builds). Each sample gets its own time limit inside the worker
(``setitimer``); a worker that stops answering (a hang in C code) is killed after a deadline, its
samples score 0 as timed out, and the pool restarts. ``workers=0`` scores in the calling process
(time limit only on the main thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import importlib.util
import logging
import math
import multiprocessing
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TextRewardFn = Callable[[str, str, str, Mapping[str, Any]], Any]
TEXT_REWARDS: dict[str, TextRewardFn] = {}
USER_PREFIX = "python:"


def register_text_reward(name: str) -> Callable[[TextRewardFn], TextRewardFn]:
    def deco(fn: TextRewardFn) -> TextRewardFn:
        if name in TEXT_REWARDS:
            raise ValueError(f"text reward {name!r} is already registered")
        TEXT_REWARDS[name] = fn
        return fn

    return deco


# ---------------------------------------------------------------------------------------------
# math
# ---------------------------------------------------------------------------------------------

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_NUMBER = re.compile(r"^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_NUMBER_UNIT = re.compile(r"^(-?(?:\d+\.?\d*|\.\d+))\s*[A-Za-z][A-Za-z ]*$")


def boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), in order; an
    unclosed box is ignored. ``\\boxed 5`` (no braces) gives the next word."""
    out, pos = [], 0
    while (m := _BOX.search(text, pos)) is not None:
        start = m.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for k in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                if depth == 0:
                    out.append(text[start + 1 : k])
                    break
            pos = start + 1
        else:
            word = re.match(r"[^\s$]*", text[start:]).group(0)
            if word and m.group(0).endswith(" "):
                out.append(word)
            pos = start
    return out


def extract_final_answer(text: str) -> str | None:
    """The last boxed answer, else the text after the last ``####``, else None."""
    boxes = boxed_contents(text)
    if boxes:
        return boxes[-1]
    marks = re.findall(r"####[ \t]*([^\n]*)", text)
    return marks[-1] if marks else None


def normalize_answer(ans: str) -> str:
    s = ans.strip().strip("$").replace("\\!", "").replace("\\,", "").strip()
    s = s[:-1].strip() if s.endswith(".") else s
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    m = _NUMBER_UNIT.match(s)
    return m.group(1) if m else s


def math_equal(pred: str, gold: str) -> bool:
    """Normalised answers equal as plain numbers, or equivalent for math-verify."""
    if not pred or not gold:
        return False
    if _NUMBER.match(pred) and _NUMBER.match(gold):
        return float(pred) == float(gold)
    from math_verify import parse, verify  # our own time limit (setitimer) bounds these calls

    gold_p, pred_p = parse(f"${gold}$", parsing_timeout=None), parse(f"${pred}$", parsing_timeout=None)
    return bool(gold_p) and bool(pred_p) and bool(verify(gold_p, pred_p, timeout_seconds=None))


@register_text_reward("math")
def math_reward(prompt: str, response: str, ground_truth: str, extra: Mapping[str, Any]) -> float:
    """1 iff the response's final answer equals the ground truth's (see the module docstring)."""
    pred = extract_final_answer(response)
    if pred is None:
        return 0.0
    gold = extract_final_answer(ground_truth)
    gold = ground_truth if gold is None else gold
    return 1.0 if math_equal(normalize_answer(pred), normalize_answer(gold)) else 0.0


@register_text_reward("exact_match")
def exact_match_text(prompt: str, response: str, ground_truth: str, extra: Mapping[str, Any]) -> float:
    """1 iff the response equals the ground truth, surrounding whitespace ignored."""
    return float(response.strip() == ground_truth.strip())


@register_text_reward("char_accuracy")
def char_accuracy_text(prompt: str, response: str, ground_truth: str, extra: Mapping[str, Any]) -> float:
    """Fraction of ground-truth characters matched position by position, halved unless the lengths match."""
    resp, gold = response.strip(), ground_truth.strip()
    if not gold:
        return 1.0 if not resp else 0.5
    matched = sum(a == b for a, b in zip(resp, gold))
    return matched / len(gold) * (1.0 if len(resp) == len(gold) else 0.5)


# ---------------------------------------------------------------------------------------------
# user functions
# ---------------------------------------------------------------------------------------------

_USER_FNS: dict[str, TextRewardFn] = {}


def load_user_reward(spec: str) -> TextRewardFn:
    """``python:FILE.py:FUNCTION`` -> the function (cached); ValueError naming the spec otherwise."""
    if spec in _USER_FNS:
        return _USER_FNS[spec]
    path_str, sep, name = spec[len(USER_PREFIX) :].rpartition(":")
    if not sep or not path_str or not name:
        raise ValueError(f"task.reward={spec!r}: use python:FILE.py:FUNCTION")
    path = Path(path_str)
    if not path.is_file():
        raise ValueError(f"task.reward={spec!r}: {path} does not exist")
    mod_name = "moe_rl_user_reward_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    try:
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except SystemExit as e:  # a BaseException: it would end the trainer
        raise ValueError(f"task.reward={spec!r}: {path} calls sys.exit({e.code!r}) on import") from None
    except Exception as e:
        raise ValueError(f"task.reward={spec!r}: {path} does not import: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"task.reward={spec!r}: {path} has no function {name!r}")
    _USER_FNS[spec] = fn
    return fn


def resolve_text_reward(name: str) -> TextRewardFn:
    if name.startswith(USER_PREFIX):
        return load_user_reward(name)
    if name not in TEXT_REWARDS:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(TEXT_REWARDS)} or python:FILE.py:FUNCTION")
    return TEXT_REWARDS[name]


# ---------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextSample:
    """One response to score with the reward ``reward``."""

    reward: str
    prompt: str
    response: str
    ground_truth: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TextScore:
    score: float
    error: bool = False  # raised, returned a non-number, or timed out: scored 0
    timed_out: bool = False


class _Timeout(BaseException):  # BaseException: a reward's own `except Exception` cannot swallow it
    pass


def _on_alarm(signum, frame):
    raise _Timeout


def score_sample(sample: TextSample, timeout_s: float) -> TextScore:
    """One sample; errors and timeouts score 0 (the time limit needs the main thread)."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, _on_alarm) if on_main else None
    try:
        if on_main:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        out = resolve_text_reward(sample.reward)(
            sample.prompt, sample.response, sample.ground_truth, sample.extra
        )
        out = out["score"] if isinstance(out, Mapping) else out
        if isinstance(out, str | bytes):  # float("0.75") would parse it: text is not a number
            raise TypeError(f"reward returned text {out!r}, not a number")
        value = float(out)
        if not math.isfinite(value):
            raise ValueError(f"reward {value}")
        return TextScore(value)
    except _Timeout:
        return TextScore(0.0, error=True, timed_out=True)
    except (
        Exception,
        SystemExit,
    ) as e:  # a reward never kills the step (sys.exit neither): scored 0, counted
        logger.debug("reward %s raised %s: %s", sample.reward, type(e).__name__, e)
        return TextScore(0.0, error=True)
    finally:
        if on_main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def score_chunk(samples: Sequence[TextSample], timeout_s: float) -> list[TextScore]:
    return [score_sample(s, timeout_s) for s in samples]


def _warm_up() -> bool:
    import math_verify  # noqa: F401  (import sympy and math-verify once, while the model builds)

    return True


def _worker_init() -> None:
    """A worker leaves Ctrl-C to its trainer rank (which closes the pool) instead of printing a
    KeyboardInterrupt traceback of its own, and dies with its rank (Linux PR_SET_PDEATHSIG)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)


class RewardPool:
    """Score text samples in ``workers`` processes (0: in this process), each within ``timeout_s``."""

    STARTUP_GRACE_S = 60.0  # first use: the workers may still be importing math-verify

    def __init__(self, workers: int, timeout_s: float) -> None:
        self.workers, self.timeout_s = workers, timeout_s
        self._ex: cf.ProcessPoolExecutor | None = None
        self._started = 0.0

    def _executor(self) -> cf.ProcessPoolExecutor:
        if self._ex is None:
            self._ex = cf.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init
            )
            self._started = time.monotonic()
            for _ in range(self.workers):
                self._ex.submit(_warm_up)
        return self._ex

    def start(self) -> RewardPool:
        if self.workers:
            self._executor()
        return self

    def score(self, samples: Sequence[TextSample]) -> list[TextScore]:
        """A score per sample, in order."""
        if not self.workers or not samples:
            return score_chunk(samples, self.timeout_s)
        ex = self._executor()
        size = -(-len(samples) // (self.workers * 2))
        chunks = [list(samples[i : i + size]) for i in range(0, len(samples), size)]
        futures = [ex.submit(score_chunk, c, self.timeout_s) for c in chunks]
        grace = max(0.0, self.STARTUP_GRACE_S - (time.monotonic() - self._started))
        deadline = time.monotonic() + grace + 5.0 + self.timeout_s * size * len(chunks) / self.workers
        out: list[TextScore] = []
        broken = False
        for fut, chunk in zip(futures, chunks):
            try:
                out.extend(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except (cf.TimeoutError, BrokenProcessPool):
                broken = True
                out.extend(TextScore(0.0, error=True, timed_out=True) for _ in chunk)
        if broken:
            logger.warning("a reward worker stopped answering; its samples scored 0; restarting the pool")
            self.close()
        return out

    def close(self) -> None:
        if self._ex is not None:
            procs = list(getattr(self._ex, "_processes", {}).values())  # a hung worker must be ended
            self._ex.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                p.terminate()
            self._ex = None
