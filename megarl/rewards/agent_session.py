"""One agent run's calls through the endpoint, and the episode they make, token-exact.

Every chat-completions call of a session is recorded as it was served: the prompt ids the
endpoint rendered from the request's messages (and tools) and the ids and log-probs the engine
returned (cut at a stop string when the request had one). Nothing is re-tokenised.

Calls chain into an episode the way :mod:`megarl.rollout.episode` lays one out::

    prompt ⊕ generated₁ ⊕ observation₁ ⊕ generated₂ ⊕ … ⊕ generated_n

A call continues the episode when its prompt ids start with the previous call's prompt ids ⊕
completion ids; the rest of its prompt is the observation between the two turns (the
template's closing of the assistant turn, the tool results or user turn, the next turn's
opening). A call whose prompt does not — the agent rewrote or dropped history, or the chat
template does not render an assistant turn back as the ids the engine generated — starts a new
*segment*, and :attr:`AgentEpisode.breaks` says where and why; how such sessions train is the
trainer's choice, not this module's.

``rewards`` sits below ``rollout`` in the import layers, so the episode is a record of its own
(:class:`AgentEpisode`) with the fields of ``rollout.episode.Episode`` / ``Turn``; the
collector converts it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from megarl.types import Turn


@dataclass(frozen=True)
class Call:
    """One served chat-completions call, as the engine saw it."""

    prompt_ids: list[int]
    """The request's messages (and tools) rendered with the run's chat template, generation
    prompt included."""
    ids: list[int]
    """The engine's generated ids, as returned to the agent (up to a stop string, if one hit)."""
    logprobs: list[float]
    """The engine's log-prob of each id in ``ids``."""
    finish_reason: str
    """The engine's: ``stop`` (a stop id or string) or ``length`` (the token limit)."""
    temperature: float
    top_p: float
    seed: int


@dataclass
class Segment:
    """Calls that chain token-exactly: one prompt and the turns after it."""

    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    """Which of the session's served calls made these turns (1-based, as ``breaks`` count them)."""

    def ids(self) -> list[int]:
        """Every id after the prompt: generated and observation ids alternating."""
        return [x for t in self.turns for x in (*t.ids, *t.observation)]


@dataclass
class AgentEpisode:
    """A session's calls chained into segments (one segment when the agent never rewrote history)."""

    segments: list[Segment] = field(default_factory=list)
    breaks: list[str] = field(default_factory=list)
    """Why each segment after the first began, one line per break."""

    @property
    def token_exact(self) -> bool:
        """The whole session is one episode: every call continued the one before."""
        return len(self.segments) <= 1


def chain(calls: list[Call]) -> AgentEpisode:
    """The calls, in the order they were served, as an :class:`AgentEpisode`."""
    episode = AgentEpisode()
    head: list[int] = []
    for n, call in enumerate(calls):
        turn = Turn(list(call.ids), list(call.logprobs), call.finish_reason == "length")
        if n and call.prompt_ids[: len(head)] == head:
            segment = episode.segments[-1]
            segment.turns[-1].observation = call.prompt_ids[len(head) :]
        else:
            if n:
                episode.breaks.append(f"call {n + 1}: {_why(call.prompt_ids, head, n)}; a new segment starts")
            segment = Segment(list(call.prompt_ids))
            episode.segments.append(segment)
        segment.turns.append(turn)
        segment.calls.append(n + 1)
        head = call.prompt_ids + call.ids
    return episode


def _why(prompt: list[int], head: list[int], previous: int) -> str:
    """Where ``prompt`` leaves call ``previous``'s prompt ⊕ completion (``head``)."""
    at = next((i for i, (a, b) in enumerate(zip(prompt, head, strict=False)) if a != b), min(len(prompt), len(head)))
    if at == len(prompt):
        return f"its prompt ({len(prompt)} ids) is shorter than call {previous}'s prompt and completion ({len(head)})"
    return (
        f"its prompt differs from call {previous}'s prompt and completion at id {at} of {len(head)} "
        f"({prompt[at]} ≠ {head[at]}): the agent rewrote the conversation, or the chat template does not "
        "render the assistant turn back as the engine's ids"
    )


class Session:
    """One agent run: its API key (the credential of its requests) and its calls."""

    def __init__(self, key: str, seed: int) -> None:
        self.key, self.seed = key, seed
        self._calls: list[Call] = []
        self._started = 0
        self._lock = threading.Lock()  # an agent may send calls from several threads

    def begin(self) -> tuple[int, int]:
        """A new call's number in the session (1-based, in the order requests arrive) and its
        engine seed (distinct per call, fixed by the session's seed)."""
        with self._lock:
            self._started += 1
            return self._started, self.seed * 1_009 + self._started

    def record(self, call: Call) -> None:
        """Keep a served call (in the order calls are served)."""
        with self._lock:
            self._calls.append(call)

    def calls(self) -> list[Call]:
        with self._lock:
            return list(self._calls)

    def episode(self) -> AgentEpisode:
        """The calls so far as an episode (segments where history was rewritten)."""
        return chain(self.calls())
