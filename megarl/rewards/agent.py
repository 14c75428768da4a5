"""``env.agent``: existing agent code as an episode. The function is called once per episode::

    def my_agent(client, row) -> float:       # or async def, with an AsyncOpenAI client
        reply = client.chat.completions.create(model="megarl", messages=[...], tools=[...])
        ...                                   # any loop of calls, tool runs, parsing
        return reward                         # the episode's reward, a finite number

``client`` is an ``openai.OpenAI`` client pointed at the run's endpoint
(:mod:`megarl.rewards.agent_endpoint`) with the session's API key; an agent may make its own
OpenAI-compatible client instead from ``client.base_url`` and ``client.api_key``. ``row`` is
the data row (prompt, answer, messages, extra). Every call is recorded token-exact; the episode
is what the calls made (:class:`megarl.rewards.agent_session.AgentEpisode`).

:func:`import_agent` resolves the spec as ``reward.fn`` is resolved ('package.module:function'
or 'path/to/file.py:function') and refuses, before launch, what cannot be called as
``function(client, row)``. :func:`run_agent` runs one episode; an agent that raises or returns
no finite number ends its episode with ``env.failed_reward``, and the error is kept. Not here:
running many agents at once, and turning the episode into training data (the collector's).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megarl.rewards.agent_endpoint import AgentEndpoint
from megarl.rewards.agent_session import AgentEpisode
from megarl.rewards.env import EnvSpecError, resolve
from megarl.rewards.specs import RewardSpecError, import_reward


def import_agent(spec: str) -> Callable[..., Any]:
    """The agent function ``spec`` names, checked; EnvSpecError saying what is wrong."""
    if ":" not in spec:
        raise EnvSpecError("must be 'package.module:function' or 'path/to/file.py:function'")
    try:
        fn = import_reward(spec)  # (the same resolution as reward.fn: sys.path, or a file)
    except RewardSpecError as e:
        raise EnvSpecError(str(e).replace("reward file", "agent file")) from None
    name = getattr(fn, "__name__", spec)
    if inspect.isclass(fn) or not callable(fn):
        raise EnvSpecError(f"{name} is a {type(fn).__name__}, not a function(client, row)")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as e:
        raise EnvSpecError(f"{name}{inspect.signature(fn)} cannot be called as {name}(client, row): {e}") from None
    return fn


@dataclass
class AgentResult:
    """One agent episode: its reward, the calls it made, and why it failed ('' if it did not)."""

    reward: float
    episode: AgentEpisode
    error: str = ""


def run_agent(
    endpoint: AgentEndpoint, fn: Callable[..., Any], row: dict[str, Any], seed: int, failed_reward: float
) -> AgentResult:
    """Run ``fn(client, row)`` in a session of its own; the session is closed (its key refused)
    when the agent returns, whatever it did."""
    session = endpoint.open_session(seed)
    error, reward = "", failed_reward
    try:
        value = resolve(_call(endpoint.client(session, inspect.iscoroutinefunction(fn)), fn, row))
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise TypeError(f"the agent returned {value!r}, not a finite number (its reward)")
        reward = float(value)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        episode = endpoint.close_session(session)
    return AgentResult(reward, episode, error)


def _call(client: Any, fn: Callable[..., Any], row: dict[str, Any]) -> Any:
    """``fn(client, row)`` with the client closed after it (awaitable for an async agent)."""
    if inspect.iscoroutinefunction(fn):

        async def run() -> Any:
            async with client:
                return await fn(client, row)

        return run()
    with client:
        return fn(client, row)
