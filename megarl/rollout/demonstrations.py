"""Demonstrated episodes for the warm start: an environment's expert turns as targets.

With ``env.fn`` set and an environment class that defines ``demonstration(row)`` (the built-in
``calculator`` does), the warm start learns whole episodes instead of bare answers: each
demonstrated turn is encoded as the engine would have generated it (its ids and the stop id),
the environment answers it for real (``step``), and its observation is rendered alone and
appended exactly as in a rollout (``megarl.data.turns``) — given, not learned (mask 0). The
warm-started policy thus meets in RL the very ids it was taught on.
"""

from __future__ import annotations

from typing import Any

from megarl.data.prompts import TOKENIZER_CORPUS_ROWS, PromptRecord, tokenizer_corpus
from megarl.data.turns import TurnRenderer
from megarl.rewards.env import as_step, resolve
from megarl.rewards.env_spec import import_env


def can_demonstrate(env_cls: type) -> bool:
    return callable(getattr(env_cls, "demonstration", None))


def demonstrated(
    env_cls: type, renderer: TurnRenderer, tok: Any, rec: PromptRecord
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, episode ids after the prompt, trained mask) of the row's demonstration."""
    row = {"prompt": rec.prompt, "answer": rec.answer, "messages": rec.messages, "extra": rec.extra}
    env = env_cls()
    resolve(env.reset(row))
    turns = list(resolve(env.demonstration(row)))
    ids: list[int] = []
    trained: list[int] = []
    for i, text in enumerate(turns):
        generated = [*tok.encode(text, bos=False), tok.eos_id]  # as the engine stops: on the stop id
        ids += generated
        trained += [1] * len(generated)
        if i == len(turns) - 1:
            break
        step = as_step(resolve(env.step(renderer.action_text(generated))))
        if step.done:
            break
        observation = renderer.observation_ids(step.observation)
        ids += observation
        trained += [0] * len(observation)
    return renderer.encode_prompt(rec), ids, trained


def demonstration_texts(env_cls: type, rows: list[PromptRecord]) -> list[str]:
    """The demonstrated turns of ``rows`` as text (for the built-in tokenizer's training corpus,
    so the tool-call syntax is in its vocabulary)."""
    out = []
    for rec in rows:
        row = {"prompt": rec.prompt, "answer": rec.answer, "messages": rec.messages, "extra": rec.extra}
        out.append(rec.prompt + "".join(resolve(env_cls().demonstration(row))) + "<tool_response></tool_response>")
    return out


def tokenizer_texts(env_fn: str, rows: list[PromptRecord]) -> list[str]:
    """What the built-in tokenizer is trained on: the task's prompts and answers, and with an
    environment that demonstrates, its demonstrated turns (the launcher's data check and the
    trainer train the same tokenizer from this)."""
    texts = tokenizer_corpus(rows)
    if env_fn:
        env_cls = import_env(env_fn)
        if can_demonstrate(env_cls):
            texts += demonstration_texts(env_cls, rows[:TOKENIZER_CORPUS_ROWS])
    return texts
