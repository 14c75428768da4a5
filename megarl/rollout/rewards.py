"""Reward functions: ``fn(prompt, response, answer) -> float``, selected by name.

:func:`score_all` never lets one reward kill the run: a function that raises marks that
sample as failed (reward = ``failed_reward``), and the reason is logged and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

RewardFn = Callable[[str, str, str], float]
log = logging.getLogger("megarl.rewards")


def exact_match(prompt: str, response: str, answer: str) -> float:
    """1.0 iff the stripped response equals the stripped answer."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def arithmetic(prompt: str, response: str, answer: str) -> float:
    """1.0 iff the response is exactly the integer answer (no extra text)."""
    text = response.strip()
    if not text or not text.lstrip("-").isdigit():
        return 0.0
    return 1.0 if int(text) == int(answer) else 0.0


def answer_prefix(prompt: str, response: str, answer: str) -> float:
    """1.0 iff the response starts with the answer (text after it is ignored).

    For runs whose responses are kept long on purpose (``rollout.min_response_len``)."""
    return 1.0 if response.strip().startswith(answer.strip()) else 0.0


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "arithmetic": arithmetic, "answer_prefix": answer_prefix}


def get_reward_fn(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward function '{name}' (known: {sorted(REWARDS)})")
    return REWARDS[name]


def score_all(
    fn: RewardFn, prompts: list[str], responses: list[str], answers: list[str], failed_reward: float = 0.0
) -> tuple[list[float], int]:
    """(rewards, number of failed samples)."""
    rewards, failed = [], 0
    for i, (p, r, a) in enumerate(zip(prompts, responses, answers)):
        try:
            value = float(fn(p, r, a))
            if value != value:  # NaN
                raise ValueError("reward is NaN")
        except Exception as e:  # a broken reward must not kill the run; it is counted
            failed += 1
            log.warning("reward failed on sample %d (prompt %r): %s: %s", i, p, type(e).__name__, e)
            value = failed_reward
        rewards.append(value)
    return rewards, failed
