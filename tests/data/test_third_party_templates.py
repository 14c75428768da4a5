"""Episodes against chat templates megarl did not write (#43): for each template file in the
folder ``MEGARL_THIRD_PARTY_TEMPLATES`` names (e.g. vLLM's ``examples/tool_chat_template_hermes.jinja``
— Qwen-style ChatML with tools — and ``examples/tool_chat_template_llama3.1_json.jinja``, or a
model's ``tokenizer_config.json`` template saved as ``.jinja``), an episode built turn by turn
(engine ids ⊕ each observation rendered alone ⊕ ...) equals transformers'
``apply_chat_template(conversation, tools=...)`` of the whole conversation, id for id, after every
turn; a template that rewrites earlier turns when one is added is refused by name
(:class:`TemplateError`), and the refusal is checked against transformers' own renderings.

The templates are not shipped with megarl (they are other projects' files); without the folder
these tests skip. ``docs/agents.md`` says how to run them and what they found."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from megarl.data.hf_tokenizer import HFTokenizer
from megarl.data.prompts import PromptRecord
from megarl.data.turns import PROBE, ChatTurns, TemplateError, as_messages
from tests.helpers import tiny_hf_tokenizer

FOLDER = os.environ.get("MEGARL_THIRD_PARTY_TEMPLATES", "")
TEMPLATES = sorted(Path(FOLDER).glob("*.jinja")) if FOLDER else []
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12*34"}},
                "required": ["expression"],
            },
        },
    }
]


def _steps(chatml: bool) -> list[tuple[str, Any]]:
    """(the engine's text for a turn, the observation after it): a tool call and its result,
    two results at once, then a user turn."""
    call = {"name": "calculator", ("arguments" if chatml else "parameters"): {"expression": "12+30"}}
    text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>" if chatml else json.dumps(call)
    tool = {"role": "tool", "name": "calculator", "content": "42"}
    return [
        (text, [tool]),
        ("Let me check that twice.", [tool, {**tool, "content": "42.0"}]),
        ("It is 42.", "Are you sure?"),
    ]


def _render(tok: HFTokenizer, messages: list[dict[str, Any]], generation: bool = True) -> list[int]:
    out = tok.hf.apply_chat_template(
        messages, tools=TOOLS, chat_template=tok.template, add_generation_prompt=generation, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    return [int(i) for i in out]


@pytest.mark.skipif(not TEMPLATES, reason="MEGARL_THIRD_PARTY_TEMPLATES: no folder of .jinja templates (docs/agents.md)")
@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_episode_equals_the_template_rendering_or_is_refused(path: Path, tmp_path: Path) -> None:
    chatml = "<|im_start|>" in path.read_text()
    tok = HFTokenizer(tiny_hf_tokenizer(tmp_path / "tok", "chatml" if chatml else "llama3"), chat_template=str(path))
    stop = tok.hf.convert_tokens_to_ids("<|im_end|>" if chatml else "<|eot_id|>")
    assert stop in tok.eos_ids
    turns = ChatTurns(tok, TOOLS)
    rec = PromptRecord("what is 12 + 30", "42", "r0")
    conversation: list[dict[str, Any]] = [{"role": "user", "content": rec.prompt}]
    ids = turns.encode_prompt(rec)
    assert ids == _render(tok, conversation)
    for text, observation in _steps(chatml):
        ids += [*tok.encode(text, bos=False), stop]  # what an engine writing ``text`` returns
        conversation += [{"role": "assistant", "content": text}, *as_messages(observation)]
        try:
            ids += turns.observation_ids(observation)
        except TemplateError:  # refused: transformers must show the rewrite too
            before = _render(tok, PROBE, generation=False)
            assert _render(tok, [*PROBE, *as_messages(observation)])[: len(before)] != before
            return
        assert ids == _render(tok, conversation), path.name
