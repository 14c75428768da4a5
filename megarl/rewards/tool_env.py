"""Built-in tool environments: the model calls tools until it answers without one.

``calculator`` offers one tool, ``calculator(expression)`` (:mod:`megarl.rewards.calculator`);
``python`` one tool, ``python(code)``: the code runs in a sandboxed subprocess and its output is
the result (:mod:`megarl.rewards.python_tool`, limits: :attr:`PythonEnv.limits`).
Each of the model's turns is read with the run's tool-call parser (``env.tool_parser``,
:mod:`megarl.rewards.tool_calls`):

* calls that read → each runs, and the observation is one ``tool`` message per call with its
  result, or ``error: ...`` for a call that failed (an unknown tool, bad arguments, a refused
  expression): the model sees its mistake and the episode goes on;
* a turn whose tool-call blocks do not read (invalid JSON...) → one ``tool`` message
  ``error: ...`` naming each problem;
* a turn without a tool call → done: it is the answer, scored by ``reward.fn`` like a
  single-turn response.

Turn limits (``env.max_turns``, the context budget) are the collector's; ``info`` counts
``tool_calls`` and ``tool_errors`` for the step's metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megarl.rewards.calculator import CalculatorError, evaluate, format_value
from megarl.rewards.env import Step
from megarl.rewards.python_tool import PythonLimits, run_python
from megarl.rewards.tool_calls import PARSERS, ToolCall, ToolParser

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 123*456"}},
            "required": ["expression"],
        },
    },
}

PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a Python 3 program (standard library only, no network, no input) and return what it "
            "prints to stdout and stderr. Each call starts afresh: nothing is kept between calls."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "e.g. print(sum(range(10)))"}},
            "required": ["code"],
        },
    },
}


class ToolEnv:
    """Runs the tools the model calls; the episode ends at a turn with no tool call."""

    tools: list[dict[str, Any]] = []
    """The tools' schemas, for the chat template."""
    functions: dict[str, Callable[[dict[str, Any]], str]] = {}
    """Each tool by name: its arguments → its result text (``error: ...`` when it fails)."""
    parser: ToolParser = PARSERS["hermes"]()

    def reset(self, row: dict[str, Any]) -> None:
        return None  # the row's own prompt (and the tools, through the chat template)

    def step(self, action: str) -> Step:
        turn = self.parser.parse(action)
        if turn.errors:
            message = {"role": "tool", "content": "error: " + "; ".join(turn.errors)}
            return Step([message], info={"tool_calls": 0, "tool_errors": len(turn.errors)})
        if not turn.calls:
            return Step("", done=True, info={"tool_calls": 0, "tool_errors": 0})
        results = [self.call(c) for c in turn.calls]
        errors = sum(r.startswith("error: ") for r in results)
        messages = [{"role": "tool", "name": c.name, "content": r} for c, r in zip(turn.calls, results, strict=True)]
        return Step(messages, info={"tool_calls": len(turn.calls), "tool_errors": errors})

    def call(self, call: ToolCall) -> str:
        """One call's result text (``error: ...`` when it fails)."""
        fn = self.functions.get(call.name)
        if fn is None:
            return f"error: no tool named {call.name!r} (tools: {', '.join(sorted(self.functions))})"
        return fn(call.arguments)


def calculator(arguments: dict[str, Any]) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str) or set(arguments) != {"expression"}:
        return 'error: calculator takes one argument, "expression" (a string)'
    try:
        return format_value(evaluate(expression))
    except CalculatorError as e:
        return f"error: {e}"


class CalculatorEnv(ToolEnv):
    tools = [CALCULATOR]
    functions = {"calculator": calculator}

    def demonstration(self, row: dict[str, Any]) -> list[str]:
        """An expert's turns: the calculator called on the row's expression (``extra["expression"]``,
        else the prompt without its trailing '='), then the answer."""
        expression = (row.get("extra") or {}).get("expression") or str(row["prompt"]).strip().rstrip("=").strip()
        call = self.parser.render(ToolCall("calculator", {"expression": expression}))
        return [call, str(row["answer"])]


class PythonEnv(ToolEnv):
    """The ``python`` tool. Its limits are a class attribute: for others, subclass and point
    ``env.fn`` at the subclass (``class Mine(PythonEnv): limits = PythonLimits(timeout_s=10)``)."""

    tools = [PYTHON]
    limits = PythonLimits()

    def __init__(self) -> None:
        self.functions = {"python": self.python}

    def python(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) != {"code"}:
            return 'error: python takes one argument, "code" (a string)'
        return run_python(code, self.limits)


ENVS: dict[str, type] = {"calculator": CalculatorEnv, "python": PythonEnv}
"""Built-in environments by the name ``env.fn`` gives."""
