"""How tool calls and tool replies are written as tokens (docs/agentic.md 4).

Both formats are append-only: the prompt is rendered once, and each tool reply is rendered and
tokenized alone and appended after the assistant turn's stop token. No earlier turn is ever
rendered or tokenized again, so token (and route) rows of earlier turns never move.

- ``qwen3`` (an HF tokenizer with a chat template): the prompt is
  ``apply_chat_template(messages, tools=[schemas], add_generation_prompt=True)``; a call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the turn (several
  allowed); a turn without one is the final answer. A reply is what the template writes for the
  tool message(s) and the next generation prompt, found as the difference of two renderings of a
  fixed two-message conversation (with and without the replies); a template that does not render
  the replies as an appended suffix is refused when the run is built.
- ``compact`` (the embedded 50-token char tokenizer, which has no ``<``, ``{`` or ``"``): the whole
  turn is ``name:argument`` (one call) or ``=answer`` (the final answer); anything else is a
  malformed call. The prompt is bos, the user's words and ``:``; a reply is ``>content?``. Neither
  the system message nor the tools are in the prompt: the model learns them (docs/agentic.md 4).
"""

from __future__ import annotations

import json
import re
from typing import Any

from moe_rl.agentic.environment import AssistantMessage, Tool, ToolCall, ToolResult
from moe_rl.errors import ConfigError
from moe_rl.tasks.hf_tokenizer import HFTokenizer
from moe_rl.tasks.tokenizer import CharTokenizer

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_BASE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


class CompactFormat:
    name = "compact"

    def __init__(self, tok: CharTokenizer) -> None:
        self.tok = tok

    def prompt_ids(self, messages: list[dict[str, str]], tools: tuple[Tool, ...]) -> list[int]:
        # the user's words only (the system text is English prose the 50 tokens cannot write), then
        # ":" as the embedded tasks end their prompts
        return self.tok.encode(
            " ".join(m["content"] for m in messages if m["role"] == "user") + ":", bos=True
        )

    def parse(self, text: str, tools: tuple[Tool, ...]) -> AssistantMessage:
        if text.startswith("="):
            return AssistantMessage(text[1:])
        name, colon, arg = text.partition(":")
        if not colon:
            return AssistantMessage(text, malformed=(f"{text!r} is neither name:argument nor =answer",))
        params = {t.name: t.parameter for t in tools}
        return AssistantMessage("", calls=(ToolCall(name, {params.get(name, "input"): arg}),))

    def count_tokens(self, content: str) -> int | None:
        try:
            return len(self.tok.encode(content))
        except ValueError:
            return None

    def reply_ids(self, replies: tuple[ToolResult, ...]) -> list[int]:
        # an error's text quotes the model and Python (quotes, dots, capitals): the 50 tokens write
        # only its kind, e.g. ">error too long?"
        return self.tok.encode(
            "".join(f">{'error ' + r.error.replace('_', ' ') if r.error else r.content}?" for r in replies)
        )


class Qwen3Format:
    name = "qwen3"

    def __init__(self, tok: HFTokenizer, template_kwargs: dict[str, Any]) -> None:
        if not tok.has_chat_template:
            raise ConfigError(
                f"config key 'agent.tool_format': qwen3 needs a chat template; {tok.directory} has none"
            )
        self.tok, self.kwargs = tok, dict(template_kwargs)
        base = tok.chat_text(_BASE, False, self.kwargs)
        eos = tok.hf.decode([tok.eos_id])
        if eos not in base:
            raise ConfigError(
                f"config key 'agent.tool_format': the chat template of {tok.directory} does not end an "
                f"assistant turn with the eos token {eos!r}, so a turn's stop token cannot start a reply"
            )
        self._base, self._after_eos = base, base[base.rindex(eos) + len(eos) :]
        self.reply_text((ToolResult("t", "probe"),))  # a template that is not append-only fails now

    def prompt_ids(self, messages: list[dict[str, str]], tools: tuple[Tool, ...]) -> list[int]:
        text = self.tok.hf.apply_chat_template(
            messages,
            tools=[t.schema() for t in tools],
            tokenize=False,
            add_generation_prompt=True,
            **self.kwargs,
        )
        return self.tok.encode(text)

    def parse(self, text: str, tools: tuple[Tool, ...]) -> AssistantMessage:
        calls, bad = [], []
        for body in _CALL.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                bad.append(f"tool call is not JSON ({e.msg} at char {e.pos})")
                continue
            if not (
                isinstance(obj, dict)
                and isinstance(obj.get("name"), str)
                and isinstance(obj.get("arguments"), dict)
            ):
                bad.append('a tool call is {"name": str, "arguments": object}')
                continue
            calls.append(ToolCall(obj["name"], obj["arguments"]))
        if "<tool_call>" in text and text.count("<tool_call>") != text.count("</tool_call>"):
            bad.append("<tool_call> without its </tool_call>")
        return AssistantMessage(_CALL.sub("", text).strip(), tuple(calls), tuple(bad))

    def count_tokens(self, content: str) -> int | None:
        return len(self.tok.encode(content))

    def reply_text(self, replies: tuple[ToolResult, ...]) -> str:
        msgs = [{"role": "tool", "name": r.name, "content": r.content} for r in replies]
        full = self.tok.chat_text(_BASE + msgs, True, self.kwargs)
        if not full.startswith(self._base):
            raise ConfigError(
                f"config key 'agent.tool_format': the chat template of {self.tok.directory} re-renders "
                "earlier turns when a tool message is added; qwen3 needs an append-only template"
            )
        return self._after_eos + full[len(self._base) :]

    def reply_ids(self, replies: tuple[ToolResult, ...]) -> list[int]:
        return self.tok.encode(self.reply_text(replies))


ToolFormat = CompactFormat | Qwen3Format


def tool_format(name: str, tok: CharTokenizer | HFTokenizer, template_kwargs: dict[str, Any]) -> ToolFormat:
    """``agent.tool_format`` for the run's tokenizer (auto: compact for the char tokenizer, qwen3
    for an HF one); a format the tokenizer cannot write is a ConfigError naming the key."""
    char = isinstance(tok, CharTokenizer)
    if name == "auto":
        name = "compact" if char else "qwen3"
    if (name == "compact") != char:
        want = "the built-in char tokenizer" if name == "compact" else "an HF tokenizer with a chat template"
        raise ConfigError(
            f"config key 'agent.tool_format': {name} is for {want}; "
            f"this run's tokenizer is {'the char tokenizer' if char else 'an HF tokenizer'}"
        )
    return CompactFormat(tok) if char else Qwen3Format(tok, template_kwargs)
