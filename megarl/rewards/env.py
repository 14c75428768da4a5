"""Environments: what a multi-turn episode acts in (``env.fn``).

**Spec** (``env.fn``): a built-in name (``calculator``, ``python``: :mod:`megarl.rewards.tool_env`), or
``package.module:Class`` / ``path/to/file.py:Class`` resolved as ``reward.fn`` is. One instance
per episode, made with no arguments. Its two methods, plain or ``async``::

    class MyEnv:
        tools = [...]                    # optional: OpenAI-style function schemas for the template

        def reset(self, row: dict):      # row: prompt, answer, messages, extra (the data row)
            return None                  # the first observation: None (the row's own prompt),
                                         # a text (one user turn) or chat messages

        def step(self, action: str):     # the model's turn, decoded
            return observation, reward, done, info

An environment may also define ``demonstration(self, row) -> list[str]``: the turns an expert
would write for the row (a tool call, then the answer...). With it, the warm start learns whole
tool-using episodes — the demonstrated turns as targets, the environment's answers to them as
given context — before RL (``megarl.rollout.demonstrations``).

``observation`` is the environment's turn: a text (one user turn), a list of chat messages
(``{"role": "tool" | "user", "content": ...}``), or empty when ``done``; ``reward`` a number
added to the episode's return (``algo.gamma`` discounts per-turn rewards where the estimator
uses them); ``done`` ends the episode; ``info`` a dict whose numeric entries are summed into
the step's metrics (``tool_calls``, ``tool_errors`` are counted by the built-ins). A
:class:`Step` may be returned instead of the tuple.

Anything else an environment returns, raises, or a method that does not exist, ends its
episode with ``env.failed_reward`` and is counted; :func:`check_env` refuses a class without
usable ``reset``/``step`` before launch.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

Observation = str | list[dict[str, Any]]


class EnvError(ValueError):
    """An environment returned something that is not an observation, reward, done, info."""


class EnvSpecError(ValueError):
    """``env.fn`` names no usable environment class."""


@dataclass
class Step:
    """One environment step's outcome."""

    observation: Observation = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def resolve(value: Any) -> Any:
    """``value``, awaited to completion when a method was ``async``."""
    if inspect.isawaitable(value):
        return asyncio.run(_await(value))
    return value


async def _await(value: Awaitable[Any]) -> Any:
    return await value


def as_step(value: Any) -> Step:
    """What ``step`` returned, checked: a :class:`Step` or (observation, reward, done, info)."""
    if isinstance(value, Step):
        parts: tuple[Any, ...] = (value.observation, value.reward, value.done, value.info)
    elif isinstance(value, tuple) and len(value) == 4:
        parts = value
    else:
        raise EnvError(f"step() returned {_what(value)}, not (observation, reward, done, info)")
    observation, reward, done, info = parts
    observation = as_observation(observation, "step()")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvError(f"step() returned reward {reward!r}, not a finite number")
    if not isinstance(done, bool):
        raise EnvError(f"step() returned done {done!r}, not True or False")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise EnvError(f"step() returned info {_what(info)}, not a dict")
    return Step(observation, float(reward), done, info)


def as_observation(value: Any, where: str) -> Observation:
    """A text, or chat messages with a role and string content; None is no observation."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return value
    raise EnvError(f"{where} returned observation {_what(value)}: want a text or a list of {{'role', 'content'}} dicts")


def check_env(cls: Any) -> None:
    """TypeError saying what makes ``cls`` unusable as an environment class."""
    if not inspect.isclass(cls):
        raise TypeError(f"is a {type(cls).__name__}, not a class")
    for method, args in (("reset", ("row",)), ("step", ("action",))):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise TypeError(f"has no method {method}({', '.join(args)})")
        try:
            inspect.signature(fn).bind(None, *args)  # (self, ...)
        except TypeError as e:
            raise TypeError(
                f"{method}{inspect.signature(fn)} cannot be called as {method}({', '.join(args)}): {e}"
            ) from e
    try:
        inspect.signature(cls).bind()
    except TypeError as e:
        raise TypeError(f"cannot be made with no arguments: {e}") from e
    tools = getattr(cls, "tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise TypeError(f"tools is {_what(tools)}, not a list of function schemas (dicts)")


def _what(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"
