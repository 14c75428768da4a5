"""The built-in rewards, selected by name in ``reward.fn``.

Each is a per-sample reward in the calling convention of
:mod:`megarl.rewards.runner`: parameters are passed by name (``prompt``, ``response``,
``answer``, ...). They are pure and fast, so by default they run in the trainer's rank 0
process; user rewards run in the worker pool.

* ``exact_match`` — the stripped response equals the stripped answer;
* ``arithmetic`` — the response is exactly the integer answer (the built-in task);
* ``answer_prefix`` — the response starts with the answer (long responses on purpose);
* ``math`` — the last ``\\boxed{...}`` of the response equals the answer mathematically
  (math-verify: LaTeX, fractions, decimals, sets, expressions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., float]


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


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    starts = [i for tag in ("\\boxed{", "\\fbox{") for i in _find_all(text, tag)]
    for start in sorted(starts, reverse=True):
        i = text.index("{", start) + 1
        depth, j = 1, i
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            return text[i : j - 1]
    return None


def _find_all(text: str, tag: str) -> list[int]:
    out, i = [], text.find(tag)
    while i >= 0:
        out.append(i)
        i = text.find(tag, i + 1)
    return out


def math(prompt: str, response: str, answer: str) -> float:
    """1.0 iff the last ``\\boxed{}`` of the response is mathematically equal to ``answer``.

    Both sides go through math-verify's ``parse`` and ``verify`` (so ``\\frac{1}{2}`` = 0.5 =
    ``\\dfrac12``, ``\\{1,2\\}`` = ``\\{2,1\\}``). A response without a boxed answer, or whose
    boxed answer does not parse, scores 0.0: that is a wrong answer, not a failed reward. An
    ``answer`` that math-verify cannot parse raises (a data problem: the sample is counted as
    a failed reward and named in the log)."""
    from math_verify import LatexExtractionConfig, parse, verify

    gold = _parse_gold(answer)
    boxed = last_boxed(response)
    if boxed is None or not boxed.strip():
        return 0.0
    latex_only = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    pred = parse(f"\\boxed{{{boxed}}}", extraction_config=latex_only)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


def _parse_gold(answer: str) -> list[Any]:
    from math_verify import parse

    text = answer.strip()
    boxed = last_boxed(text)
    if boxed is not None:  # a solution text as the answer: its boxed part
        text = boxed
    # as LaTeX math first ('1+x^2' whole, not its first number), then math-verify's defaults
    gold = parse(f"${text}$") or parse(text)
    if not gold:
        raise ValueError(f"math reward: math-verify cannot parse the reference answer {answer!r}")
    return list(gold)


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "arithmetic": arithmetic,
    "answer_prefix": answer_prefix,
    "math": math,
}

NEEDS_PACKAGE = {"math": "math_verify"}
"""Built-ins that need an optional package (import name), checked before launch."""
