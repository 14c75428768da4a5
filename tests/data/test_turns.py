"""Observation turns rendered alone (``megarl.data.turns``) against transformers rendering the
whole conversation: with a prefix-stable ChatML template that takes ``tools``, an episode built
turn by turn (engine ids ⊕ rendered observation ⊕ ...) equals ``apply_chat_template`` of the
final conversation, id for id; a template that rewrites earlier turns is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.data.hf_tokenizer import HFTokenizer
from megarl.data.prompts import PromptRecord
from megarl.data.turns import ChatTurns, TemplateError
from tests.helpers import tiny_hf_tokenizer

TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call these tools:\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML with tools in the Hermes way (schemas in a system turn, results as <tool_response>
blocks inside one user turn), written for this test."""
REWRITING = TOOLS_TEMPLATE.replace(
    "{%- else %}", "{%- elif m['role'] == 'assistant' and not loop.last %}{{- '<|im_start|>assistant\\n<|im_end|>\\n' }}{%- else %}"
)
"""The same, but earlier assistant turns are rewritten empty (as templates that strip reasoning do)."""
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    folder = tiny_hf_tokenizer(tmp_path_factory.mktemp("chatml"), "chatml")
    (folder / "tools.jinja").write_text(TOOLS_TEMPLATE)
    return HFTokenizer(folder, chat_template=str(folder / "tools.jinja"))


def _engine_turn(tok: HFTokenizer, text: str) -> list[int]:
    """What an engine writing ``text`` returns: its ids and the stop id it stopped on."""
    return [*tok.encode(text, bos=False), tok.hf.convert_tokens_to_ids("<|im_end|>")]


def test_episode_built_turn_by_turn_equals_the_rendered_conversation(tok: HFTokenizer) -> None:
    turns = ChatTurns(tok, TOOLS)
    rec = PromptRecord("what is 12 + 30", "42", "r0")
    conversation = [{"role": "user", "content": rec.prompt}]
    ids = turns.encode_prompt(rec)
    steps = [
        ("I will add.<tool_call>" + json.dumps({"name": "calculator", "arguments": {"x": "12+30"}}) + "</tool_call>",
         [{"role": "tool", "content": "42"}]),
        ("Check twice.", [{"role": "tool", "content": "42"}, {"role": "tool", "content": "42.0"}]),
        ("Let me ask.", "are you sure?"),  # a text observation: a user turn
    ]
    for text, observation in steps:
        ids += _engine_turn(tok, text)
        ids += turns.observation_ids(observation)
        conversation.append({"role": "assistant", "content": text})
        conversation += observation if isinstance(observation, list) else [{"role": "user", "content": observation}]
        want = tok.hf.apply_chat_template(
            conversation, tools=TOOLS, chat_template=tok.template, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ids == list(want)
    assert turns.action_text(_engine_turn(tok, steps[0][0])) == steps[0][0]  # markers kept, stop id dropped


def test_a_template_that_rewrites_earlier_turns_is_refused(tok: HFTokenizer, tmp_path: Path) -> None:
    (tmp_path / "rewriting.jinja").write_text(REWRITING)
    rewriting = HFTokenizer(tok.folder, chat_template=str(tmp_path / "rewriting.jinja"))
    turns = ChatTurns(rewriting, TOOLS)
    with pytest.raises(TemplateError, match=r"rewriting.jinja rewrites the earlier turns when a tool turn follows"):
        turns.observation_ids([{"role": "tool", "content": "1"}])
