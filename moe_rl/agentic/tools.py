"""Running tools safely: a calculator that parses with ``ast`` (never ``eval``) and the runner that
enforces every per-call limit (docs/agentic.md 3).

Every failure of a call becomes an error reply the model reads, with a kind the loop counts
(``agent/tool_errors/<kind>``); none ends the job: ``unknown_tool``, ``bad_arguments``, ``raised``,
``timeout`` (past ``agent.tool_timeout_s``; the call's thread is abandoned, a daemon, since Python
cannot kill a thread), ``not_string``, ``too_long`` (more than ``agent.max_tool_tokens`` tokens),
``unencodable`` (characters the tokenizer has no token for), and ``malformed`` (the call did not
parse; ``moe_rl.agentic.formats``).
"""

from __future__ import annotations

import ast
import operator
import threading
from collections.abc import Callable

from moe_rl.agentic.environment import Tool, ToolCall, ToolResult

ERROR_KINDS = (
    "malformed",
    "unknown_tool",
    "bad_arguments",
    "raised",
    "timeout",
    "not_string",
    "too_long",
    "unencodable",
)

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_ABS = 10**12  # a result or operand beyond it is refused (no giant integers from 9*9*9*...)


class CalcError(ValueError):
    """An expression the calculator does not evaluate; the message is the reply the model reads."""


def calculate(expression: str, max_ops: int = 0) -> int:
    """The integer value of ``expression``: integers, + - * // %, unary +/-, parentheses. Parsed
    with ``ast`` and walked; names, calls, attributes, floats, powers: CalcError. ``max_ops`` > 0
    refuses an expression with more binary operations (a task can then need several calls)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expression!r}") from None
    ops = sum(isinstance(n, ast.BinOp) for n in ast.walk(tree))
    if max_ops and ops > max_ops:
        raise CalcError(f"{ops} operations in one call; at most {max_ops}")
    return _eval(tree.body)


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    else:
        raise CalcError(f"{type(node).__name__} is not allowed (integers and + - * // % only)")
    if abs(value) > MAX_ABS:
        raise CalcError(f"a value beyond {MAX_ABS}")
    return value


class ToolRunner:
    """Runs one task's tool calls under the per-call limits; ``count_tokens(text)`` is the
    reply's token count in the run's format, or None when the tokenizer cannot encode it."""

    def __init__(
        self,
        tools: tuple[Tool, ...],
        timeout_s: float,
        max_tokens: int,
        count_tokens: Callable[[str], int | None],
    ) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.max_tokens, self.count_tokens = timeout_s, max_tokens, count_tokens

    def __call__(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return _error(call.name, "unknown_tool", f"no tool {call.name!r}; tools: {sorted(self.tools)}")
        box: dict[str, object] = {}

        def target() -> None:
            try:
                box["value"] = tool.fn(**call.arguments)
            except TypeError as e:
                box["error"] = ("bad_arguments", f"{call.name} arguments {sorted(call.arguments)}: {e}")
            except Exception as e:  # the tool's own failure is the model's reply, never the job's
                box["error"] = ("raised", f"{call.name} raised {type(e).__name__}: {e}")

        thread = threading.Thread(target=target, daemon=True, name=f"tool-{call.name}")
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            return _error(call.name, "timeout", f"{call.name} took longer than {self.timeout_s:g} s")
        if "error" in box:
            kind, text = box["error"]  # type: ignore[misc]
            return _error(call.name, kind, text)
        value = box["value"]
        if not isinstance(value, str):
            return _error(
                call.name, "not_string", f"{call.name} returned a {type(value).__name__}, not a str"
            )
        n = self.count_tokens(value)
        if n is None:
            return _error(
                call.name, "unencodable", f"{call.name} returned characters the tokenizer cannot encode"
            )
        if n > self.max_tokens:
            return _error(
                call.name, "too_long", f"{call.name} returned {n} tokens; at most {self.max_tokens}"
            )
        return ToolResult(call.name, value)


def _error(name: str, kind: str, text: str) -> ToolResult:
    return ToolResult(name, f"error: {text}", kind)
