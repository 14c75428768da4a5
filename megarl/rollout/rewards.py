"""Reward functions: ``fn(prompt, response, answer) -> float``, selected by name.

:func:`score_all` never lets one reward kill the run (training and validation samples alike):
a function that raises marks that sample as failed (reward = ``failed_reward``); failures are
counted and summarised in one log line per step (:func:`failure_summary`).
"""

from __future__ import annotations

from collections.abc import Callable

RewardFn = Callable[[str, str, str], float]


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
    fn: RewardFn,
    prompts: list[str],
    responses: list[str],
    answers: list[str],
    failed_reward: float = 0.0,
    failures: list[str] | None = None,
    where: str = "",
) -> tuple[list[float], int]:
    """(rewards, number of failed samples). Each failure's reason is appended to ``failures``
    (``where``: the prompt's file:line) for the caller's one summary line per step, not logged
    one by one (a broken reward fails on most samples)."""
    rewards, failed = [], 0
    for i, (p, r, a) in enumerate(zip(prompts, responses, answers)):
        try:
            value = float(fn(p, r, a))
            if value != value:  # NaN
                raise ValueError("reward is NaN")
        except Exception as e:  # a broken reward must not kill the run; it is counted
            failed += 1
            if failures is not None:
                failures.append(f"{where or repr(p)} sample {i}: {type(e).__name__}: {e}")
            value = failed_reward
        rewards.append(value)
    return rewards, failed


def failure_summary(failures: list[str], total: int, what: str = "samples") -> str:
    """One log line for a step's failed rewards ('' if none): the count and two examples."""
    if not failures:
        return ""
    more = f"; and {len(failures) - 2} more" if len(failures) > 2 else ""
    return f"reward failed on {len(failures)} of {total} {what} (scored 0): {'; '.join(failures[:2])}{more}"
