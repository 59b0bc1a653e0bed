"""unit tier, issue 44 points 1 and 9: the calculator never evaluates anything but integer
arithmetic, every failing tool call becomes a counted error reply (raises, hangs, a non-string, an
over-long output, an unknown tool, bad arguments), and both tool-call formats parse and render
append-only (the qwen3 one through a real HF tokenizer's chat template)."""

from __future__ import annotations

import time

import pytest

from moe_rl.agentic.environment import AssistantMessage, Tool, ToolCall, ToolResult
from moe_rl.agentic.formats import CompactFormat, Qwen3Format
from moe_rl.agentic.tools import CalcError, ToolRunner, calculate
from moe_rl.tasks.tokenizer import CharTokenizer

pytestmark = pytest.mark.unit


def test_calculator_evaluates_integer_arithmetic_only():
    assert calculate("12+7-3") == 16 and calculate("-(4*5)//3 % 7") == 0 and calculate(" 2*(3+4) ") == 14
    for bad, why in [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("2**64", "BinOp is not allowed"),  # a power is a BinOp with an op we do not take
        ("x+1", "Name is not allowed"),
        ("1.5+1", "Constant is not allowed"),
        ("7//0", "division by zero"),
        ("999999*999999*9", "a value beyond"),
        ("1+", "cannot parse"),
    ]:
        with pytest.raises(CalcError, match=why):
            calculate(bad)
    with pytest.raises(CalcError, match="2 operations in one call; at most 1"):
        calculate("1+2+3", max_ops=1)
    assert calculate("1+2", max_ops=1) == 3


def _hang(text: str) -> str:
    time.sleep(30)
    return text


TOOLS = (
    Tool("echo", "", "text", lambda text: text),
    Tool("boom", "", "text", lambda text: 1 / 0),
    Tool("num", "", "text", lambda text: 42),
    Tool("hang", "", "text", _hang),
)


def test_every_tool_failure_is_an_error_reply_with_its_kind():
    run = ToolRunner(
        TOOLS, timeout_s=0.3, max_tokens=5, count_tokens=CompactFormat(CharTokenizer()).count_tokens
    )
    assert run(ToolCall("echo", {"text": "abc"})) == ToolResult("echo", "abc")
    cases = [
        (ToolCall("boom", {"text": "a"}), "raised", "error: boom raised ZeroDivisionError: division by zero"),
        (ToolCall("num", {"text": "a"}), "not_string", "error: num returned a int, not a str"),
        (ToolCall("echo", {"text": "abcdef"}), "too_long", "error: echo returned 6 tokens; at most 5"),
        (
            ToolCall("echo", {"text": "A.b"}),
            "unencodable",
            "error: echo returned characters the tokenizer cannot encode",
        ),
        (
            ToolCall("nope", {"text": "a"}),
            "unknown_tool",
            "error: no tool 'nope'; tools: ['boom', 'echo', 'hang', 'num']",
        ),
    ]
    for call, kind, text in cases:
        assert run(call) == ToolResult(call.name, text, kind)
    bad = run(ToolCall("echo", {"txt": "a"}))
    assert bad.error == "bad_arguments" and "unexpected keyword argument 'txt'" in bad.content
    t0 = time.monotonic()
    assert run(ToolCall("hang", {"text": "a"})) == ToolResult(
        "hang", "error: hang took longer than 0.3 s", "timeout"
    )
    assert time.monotonic() - t0 < 2.0  # the wall-time limit, not the tool, decides


def test_compact_format_parses_calls_answers_and_malformed_turns():
    fmt, tools = CompactFormat(CharTokenizer()), (Tool("calc", "", "expression", str),)
    assert fmt.parse("calc:12+7", tools) == AssistantMessage("", (ToolCall("calc", {"expression": "12+7"}),))
    assert fmt.parse("=19", tools) == AssistantMessage("19") and fmt.parse("=19", tools).answer
    bad = fmt.parse("19", tools)
    assert bad.malformed == ("'19' is neither name:argument nor =answer",) and not bad.answer
    tok = CharTokenizer()
    replies = (ToolResult("calc", "19"), ToolResult("", "error: 'x' is neither", "malformed"))
    assert tok.decode(fmt.reply_ids(replies)) == ">19?>error malformed?"
    assert (
        tok.decode(
            fmt.prompt_ids(
                [{"role": "system", "content": "Prose."}, {"role": "user", "content": "1+2"}], tools
            )
        )
        == "1+2:"
    )


def test_qwen3_format_parses_json_calls_and_renders_replies_append_only(hf_qwen3_tok):
    fmt, tools = Qwen3Format(hf_qwen3_tok, {}), (Tool("calc", "Evaluate.", "expression", str),)
    text = 'Let me add.<tool_call>{"name": "calc", "arguments": {"expression": "12+7"}}</tool_call>'
    assert fmt.parse(text, tools) == AssistantMessage(
        "Let me add.", (ToolCall("calc", {"expression": "12+7"}),)
    )
    assert fmt.parse("The answer is 19.", tools).answer
    bad = fmt.parse('<tool_call>{"name": "calc", "arguments": </tool_call><tool_call>[1]</tool_call>', tools)
    assert bad.malformed == (
        "tool call is not JSON (Expecting value at char 30)",
        'a tool call is {"name": str, "arguments": object}',
    )
    assert fmt.parse("<tool_call>{", tools).malformed == ("<tool_call> without its </tool_call>",)
    prompt = hf_qwen3_tok.hf.decode(fmt.prompt_ids([{"role": "user", "content": "1+2"}], tools))
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and '"name": "calc"' in prompt
    reply = (ToolResult("calc", "19"), ToolResult("calc", "3"))
    # what follows the turn's <|im_end|>: the rest of the assistant turn, the replies, the next prompt
    assert fmt.reply_text(reply) == (
        "\n<|im_start|>user\n<tool_response>\n19\n</tool_response>\n<tool_response>\n3\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
