"""Episodes: a prompt and the turns that followed it, as the exact ids the trainer trains on.

A turn is what the engine generated (its ids and their log-probs, kept as they came: never
decoded and re-tokenised) followed by the environment's answer rendered as ids (the
observation: a tool result, a user turn, and the template's opening of the next assistant
turn). Laid out after the prompt::

    prompt ⊕ generated₁ ⊕ observation₁ ⊕ generated₂ ⊕ observation₂ ⊕ … ⊕ generated_n

Only generated ids are trained (``trained`` = 1 on them, 0 on observation ids); their engine
log-probs sit beside them (0 under observation ids, where the mask is 0). An episode of one turn
with no observation is exactly today's single-turn sample: response = generated₁, all trained
(:meth:`Episode.sample` gives the same tuple ``sample_groups`` builds, bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.types import Turn

__all__ = ["Episode", "Turn"]


@dataclass
class Episode:
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """The environment's reward after each step (added to the final answer's score)."""
    truncated: bool = False
    """The episode was cut: a turn hit its limit, or ``env.max_turns`` / the context budget ended it."""
    failed: bool = False
    """The environment raised, timed out or returned something unusable: the episode ended there."""

    def ids(self) -> list[int]:
        """Every id after the prompt, in order: generated and observation ids alternating."""
        return [x for t in self.turns for x in (*t.ids, *t.observation)]

    def context(self) -> list[int]:
        """What the engine is given for the next turn: the prompt and every id since."""
        return self.prompt_ids + self.ids()

    def trained(self) -> list[int]:
        """1 on each generated id, 0 on each observation id (aligned with :meth:`ids`)."""
        return [x for t in self.turns for x in (*([1] * len(t.ids)), *([0] * len(t.observation)))]

    def logprobs(self) -> list[float]:
        """Engine log-probs aligned with :meth:`ids` (0 under observation ids); empty if not asked for."""
        if any(len(t.logprobs) != len(t.ids) for t in self.turns):
            return []
        return [x for t in self.turns for x in (*t.logprobs, *([0.0] * len(t.observation)))]

    def turn_ends(self) -> list[int | None]:
        """Per turn, the index in :meth:`ids` of its last generated id (None: it generated none)."""
        out: list[int | None] = []
        at = 0
        for t in self.turns:
            at += len(t.ids)
            out.append(at - 1 if t.ids else None)
            at += len(t.observation)
        return out

    def generated(self) -> int:
        """Generated (trained) ids over all turns."""
        return sum(len(t.ids) for t in self.turns)

    def sample(self) -> tuple[list[int], list[float], bool]:
        """(response ids, engine log-probs, truncated): the shape of one sample in a ``Group``."""
        return self.ids(), self.logprobs(), self.truncated or any(t.truncated for t in self.turns)

    def single_turn(self) -> bool:
        """One turn and no observation: a plain sample, all of it trained."""
        return len(self.turns) == 1 and not self.turns[0].observation
