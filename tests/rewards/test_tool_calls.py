"""Tool calls read out of generated text (``megarl.rewards.tool_calls``), against vLLM's own
``Hermes2ProToolParser`` as the oracle on random turns: well-formed, several calls, text around
them, an unclosed last block (a turn cut at its token limit), and malformed ones."""

from __future__ import annotations

import json
import random

import pytest

from megarl.rewards.tool_calls import HermesParser, ToolCall


@pytest.fixture(scope="module")
def vllm_parser():
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    class _Tok:  # the parser only keeps the tokenizer for streaming
        def get_vocab(self) -> dict[str, int]:
            return {}

    return Hermes2ProToolParser(_Tok())


def _turn(rng: random.Random) -> str:
    parts = [rng.choice(["", "Let me compute.", "I'll use a tool:\n", "x = 12 * 3?"])]
    for _ in range(rng.randrange(0, 4)):
        args = {rng.choice(["expression", "code", "q"]): rng.choice(["123*456", "print(1)", "é ünïcode", 7, [1, 2]])}
        body = json.dumps({"name": rng.choice(["calculator", "python", "search"]), "arguments": args})
        kind = rng.randrange(10)
        if kind == 0:
            body = body[: rng.randrange(len(body))]  # broken JSON
        elif kind == 1:
            body = json.dumps({"arguments": args})  # no name
        elif kind == 2:
            body = json.dumps({"name": "calculator", "arguments": json.dumps(args)})  # arguments as a string
        parts.append(f"<tool_call>\n{body}\n</tool_call>" + rng.choice(["", "\n", " trailing words"]))
    if rng.random() < 0.2:
        parts.append('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}')  # cut off
    return "".join(parts)


def test_hermes_parser_matches_vllm(vllm_parser) -> None:
    rng = random.Random(0)
    ours = HermesParser()
    checked = {"calls": 0, "refused": 0, "plain": 0}
    for _ in range(400):
        text = _turn(rng)
        got, want = ours.parse(text), vllm_parser.extract_tool_calls(text, None)
        if not want.tools_called:
            # vLLM returns the whole turn as content when a block does not read; so do we, with why
            assert got.calls == [] and got.content == text
            assert got.tried == ("<tool_call>" in text)
            checked["refused" if got.tried else "plain"] += 1
            continue
        if any(isinstance(json.loads(c.function.arguments), str) for c in want.tool_calls):
            # (vLLM passes a string-valued "arguments" through as a JSON string; megarl reads it
            # as OpenAI's wire form and decodes it) — compare decoded
            assert [c.name for c in got.calls] == [c.function.name for c in want.tool_calls]
            continue
        assert [(c.name, c.arguments) for c in got.calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in want.tool_calls
        ]
        assert got.content == (want.content or "")
        assert got.errors == []
        checked["calls"] += 1
    assert min(checked.values()) >= 20, checked  # every kind of turn was met


def test_errors_name_the_call_and_the_problem() -> None:
    p = HermesParser()
    bad = p.parse('ok<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call><tool_call>{oops</tool_call>')
    assert bad.calls == [] and bad.tried
    assert len(bad.errors) == 1 and bad.errors[0].startswith("tool call 2: invalid JSON")
    assert p.parse('<tool_call>{"name": "f", "arguments": [1]}</tool_call>').errors == [
        'tool call 1: "arguments" of f is not an object'
    ]
    plain = p.parse("The answer is 42.")
    assert (plain.content, plain.calls, plain.tried) == ("The answer is 42.", [], False)


def test_render_reads_back() -> None:
    p = HermesParser()
    call = ToolCall("calculator", {"expression": "123*456"})
    assert p.parse("Compute." + p.render(call)).calls == [call]
