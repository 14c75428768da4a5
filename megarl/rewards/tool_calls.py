"""Tool calls read out of a generated turn, in the format the chat template defines.

``env.tool_parser`` picks the parser: ``hermes`` (the Hermes / Qwen form the Qwen2.5 and Qwen3
templates teach, one JSON object per call)::

    Let me compute that.<tool_call>
    {"name": "calculator", "arguments": {"expression": "123*456"}}
    </tool_call>

or ``package.module:Class`` / ``path/to/file.py:Class``, a class with ``parse(text) ->
ParsedTurn``. A parser reads text only; the ids the engine generated are what the trainer
trains on, whatever the parser makes of them.

The ``hermes`` parser reads calls as vLLM's ``Hermes2ProToolParser`` does (the oracle in
tests/rewards/test_tool_calls.py): every ``<tool_call>…</tool_call>`` block, plus an unclosed
last one running to the end of the turn (a turn cut at its token limit), each a JSON object
with ``name`` and ``arguments``; the text before the first block is the turn's content. A turn
with any block that does not read — invalid JSON, no name, arguments not an object — calls no
tool (vLLM then returns the turn as plain content); megarl keeps why in ``errors``, so the
environment can answer with the error and the run can count it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """What a generated turn says: its content (text before the first call) and its calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Why the turn's tool-call blocks did not read (then ``calls`` is empty)."""

    @property
    def tried(self) -> bool:
        """The turn tried to call a tool (read or not)."""
        return bool(self.calls or self.errors)


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...

    def render(self, call: ToolCall) -> str:
        """The text of one call as the model writes it (for demonstrations)."""
        ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Hermes 2 Pro, Qwen2.5, Qwen3."""

    start, end = "<tool_call>", "</tool_call>"
    _blocks = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        if self.start not in text:
            return ParsedTurn(content=text)
        content = text[: text.find(self.start)]
        calls, errors = [], []
        for i, (closed, unclosed) in enumerate(self._blocks.findall(text)):
            call, error = _read_call(closed or unclosed)
            if error:
                errors.append(f"tool call {i + 1}: {error}")
            elif call is not None:
                calls.append(call)
        if errors:
            return ParsedTurn(content=text, errors=errors)
        return ParsedTurn(content=content, calls=calls)

    def render(self, call: ToolCall) -> str:
        """The text of one call as the model writes it (synthetic transcripts for warm starts)."""
        return (
            f'{self.start}\n{{"name": {json.dumps(call.name)}, "arguments": {json.dumps(call.arguments)}}}\n{self.end}'
        )


def _read_call(body: str) -> tuple[ToolCall | None, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at character {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, 'not an object with a "name"'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # (OpenAI's wire form: the arguments as a JSON string)
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f'"arguments" of {obj["name"]} is a string that is not JSON'
    if not isinstance(args, dict):
        return None, f'"arguments" of {obj["name"]} is not an object'
    return ToolCall(obj["name"], args), ""


PARSERS: dict[str, type] = {"hermes": HermesParser}
"""Built-in parsers by the name ``env.tool_parser`` gives."""
