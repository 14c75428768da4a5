"""The ``calculator`` tool: exact arithmetic against Python's own on random expressions, and
every construct outside arithmetic refused by name before anything runs."""

from __future__ import annotations

import random
import time

import pytest

from megarl.rewards.calculator import CalculatorError, evaluate, format_value


def _expr(rng: random.Random, depth: int = 0) -> str:
    if depth > 3 or rng.random() < 0.3:
        return str(rng.randrange(0, 1000)) if rng.random() < 0.8 else f"{rng.uniform(0, 100):.3f}"
    op = rng.choice(["+", "-", "*", "//", "%", "/"])
    left, right = _expr(rng, depth + 1), _expr(rng, depth + 1)
    return rng.choice([f"{left} {op} {right}", f"({left}{op}{right})", f"-{left} {op} {right}"])


def test_matches_python_arithmetic() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(500):
        e = _expr(rng)
        try:
            want = eval(e, {"__builtins__": {}})  # the test's oracle, on expressions it built itself
        except ZeroDivisionError:
            with pytest.raises(CalculatorError, match="division by zero"):
                evaluate(e)
            continue
        assert evaluate(e) == want, e
        checked += 1
    assert checked > 400
    assert evaluate("123*456") == 56088 and format_value(evaluate("123*456")) == "56088"
    assert evaluate("2**10") == 1024 and evaluate("7/2") == 3.5 and format_value(evaluate("6/3")) == "2"
    assert format_value(evaluate("1/3")) == "0.333333333333"


@pytest.mark.parametrize(
    ("expression", "refusal"),
    [
        ("__import__('os').system('true')", "a function call is not allowed"),
        ("x + 1", "a name is not allowed"),
        ("(1).real", "an attribute is not allowed"),
        ("'a' * 3", "the constant 'a' is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("True + 1", "the constant True is not allowed"),
        ("[1, 2][0]", "Subscript is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 << 3", "the operator LShift is not allowed"),
        ("1 +", "not an arithmetic expression"),
        ("(-8) ** 0.5", "not a real number"),
        ("1" * 201, "longer than 200 characters"),
        ("+".join(["1"] * 60), "more than 100 parts"),
    ],
)
def test_refuses_what_is_not_arithmetic(expression: str, refusal: str) -> None:
    with pytest.raises(CalculatorError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        evaluate(expression)


@pytest.mark.parametrize("expression", ["9**9**9", "10**5000", "(10**50)*(10**60)", "2**10000", "1e308*10"])
def test_huge_results_are_refused_at_once(expression: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(CalculatorError, match="larger than|more than 100 digits|too large"):
        evaluate(expression)
    assert time.perf_counter() - t0 < 0.05  # refused before computing, not after
