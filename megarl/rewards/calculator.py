"""The ``calculator`` tool: arithmetic on numbers, evaluated from its syntax tree, never ``eval``.

An expression is parsed with :mod:`ast` (``mode="eval"``) and only these nodes are evaluated:
integer and decimal literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses. Anything
else — names, calls, attributes, subscripts, strings, comparisons, lambdas — is refused with
the construct named, before anything runs. Bounds keep a hostile expression cheap: at most
``MAX_CHARS`` characters and ``MAX_NODES`` syntax nodes, exponents up to ``MAX_EXPONENT`` and
results up to ``MAX_DIGITS`` digits (a power or product past them is refused before it is
computed, so ``9**9**9`` costs nothing). Integer arithmetic stays exact; ``/`` gives a float.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 1000
MAX_DIGITS = 100

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or too big; the message says which part."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (see the module docstring for what is allowed)."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression with more than {MAX_NODES} parts")
    return _eval(tree.body)


def format_value(value: int | float) -> str:
    """A result as the tool returns it: integers exactly, floats to 12 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
        assert isinstance(value, (int, float))
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        _check_size(node.op, left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result too large")
        return value
    raise CalculatorError(f"{_name(node)} is not allowed (numbers and + - * / // % ** only)")


def _digits(x: int | float) -> float:
    return math.log10(abs(x)) + 1 if x else 1.0


def _check_size(op: ast.operator, left: int | float, right: int | float) -> None:
    """Refuse a power or product whose result would pass ``MAX_DIGITS``, before computing it."""
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} larger than {MAX_EXPONENT}")
        if right > 0 and abs(left) > 1 and _digits(left) * right > MAX_DIGITS + 1:
            raise CalculatorError(f"result with more than {MAX_DIGITS} digits")
    elif isinstance(op, ast.Mult) and _digits(left) + _digits(right) > MAX_DIGITS + 1:
        raise CalculatorError(f"result with more than {MAX_DIGITS} digits")


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    return {"Name": "a name", "Call": "a function call", "Attribute": "an attribute"}.get(
        type(node).__name__, f"{type(node).__name__}"
    )
