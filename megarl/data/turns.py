"""How an episode's turns become ids: the first prompt (with the tools), each observation, and the
text an environment reads from a generated turn.

Generated ids are never re-tokenised: the engine's ids stay as they came, and each observation
is rendered alone and appended (``megarl.rollout.episode``). What an observation's ids are
depends on the tokenizer:

* :class:`ChatTurns` (an HF tokenizer with a chat template): the template's own rendering of the
  observation turn, found by difference. A fixed two-turn conversation is rendered without and
  with the observation (and the next assistant turn's opening); the ids the second adds are the
  observation's, preceded by whatever the template writes after an assistant turn's stop id
  (ChatML's newline after ``<|im_end|>``), since the engine's turn ends at that stop id. The
  first rendering must be a prefix of the second, or the template rewrites earlier turns when
  one is added and :class:`TemplateError` says so (docs: Agents and tools).
* :class:`PlainTurns` (the built-in SentencePiece tokenizer, no template): a tool result is
  ``<tool_response>\\n…\\n</tool_response>\\n``, a user turn its text and a newline.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from megarl.data.prompts import PromptRecord

Observation = str | list[dict[str, Any]]
PROBE: list[dict[str, Any]] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]
"""The fixed conversation observations are rendered after (its content does not matter)."""


class TemplateError(ValueError):
    """The chat template cannot render turns one at a time (it is not prefix-stable)."""


class TurnRenderer(Protocol):
    def encode_prompt(self, rec: PromptRecord) -> list[int]: ...

    def observation_ids(self, observation: Observation) -> list[int]: ...

    def action_text(self, ids: list[int]) -> str: ...

    def answer_text(self, ids: list[int]) -> str: ...


def renderer(tok: Any, tools: list[dict[str, Any]]) -> TurnRenderer:
    """:class:`ChatTurns` for a tokenizer with a chat template, else :class:`PlainTurns`."""
    if getattr(tok, "template", None) is not None:
        return ChatTurns(tok, tools)
    return PlainTurns(tok)


def as_messages(observation: Observation) -> list[dict[str, Any]]:
    """An observation as chat turns: a text is one user turn."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}] if observation else []
    return list(observation)


class ChatTurns:
    """Turns through an HF tokenizer's chat template (``megarl.data.hf_tokenizer.HFTokenizer``)."""

    def __init__(self, tok: Any, tools: list[dict[str, Any]]) -> None:
        if tok.template is None:
            raise TemplateError(f"{tok.folder}: multi-turn episodes need a chat template (data.chat_template)")
        self.tok, self.tools = tok, tools
        before = self._ids(PROBE, add_generation_prompt=False)
        stops = [i for i, t in enumerate(before) if t in tok.eos_ids]
        self.closing = before[stops[-1] + 1 :] if stops else []
        """What the template writes after an assistant turn's stop id (the engine stops on it)."""
        self.before = before

    def _ids(self, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
        rendered = self.tok.hf.apply_chat_template(
            messages, tools=self.tools or None, chat_template=self.tok.template, tokenize=True, return_dict=False, **kw
        )
        return [int(i) for i in cast("list[int]", rendered)]

    def encode_prompt(self, rec: PromptRecord) -> list[int]:
        """The row's conversation with the tools, opening the first assistant turn."""
        return self._ids(self.tok.messages(rec), add_generation_prompt=True)

    def observation_ids(self, observation: Observation) -> list[int]:
        after = self._ids([*PROBE, *as_messages(observation)], add_generation_prompt=True)
        if after[: len(self.before)] != self.before:
            raise TemplateError(
                f"{self.tok.template_source} rewrites the earlier turns when a "
                f"{'/'.join(sorted({m['role'] for m in as_messages(observation)}))} turn follows them "
                "(not prefix-stable): its turns cannot be appended one at a time"
            )
        return self.closing + after[len(self.before) :]

    def action_text(self, ids: list[int]) -> str:
        """The turn as the environment reads it: special tokens kept (tool-call markers may be
        special), the trailing stop id dropped."""
        if ids and ids[-1] in self.tok.eos_ids:
            ids = ids[:-1]
        return str(self.tok.hf.decode(ids, skip_special_tokens=False))

    def answer_text(self, ids: list[int]) -> str:
        """The final turn as ``reward.fn`` reads it: special tokens stripped, as single-turn responses."""
        return str(self.tok.decode(ids))


class PlainTurns:
    """Turns through a tokenizer without a chat template (the built-in SentencePiece one)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode_prompt(self, rec: PromptRecord) -> list[int]:
        """The row's prompt as single-turn rollouts take it (no tool schemas: a model taught the
        format by its warm start knows its tools)."""
        return [int(i) for i in self.tok.encode_prompt(rec)]

    def observation_ids(self, observation: Observation) -> list[int]:
        text = "".join(
            f"<tool_response>\n{m['content']}\n</tool_response>\n" if m["role"] == "tool" else f"{m['content']}\n"
            for m in as_messages(observation)
        )
        return [int(i) for i in self.tok.encode(text, bos=False)] if text else []

    def action_text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))

    def answer_text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))
