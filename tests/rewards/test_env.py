"""Environments (``megarl.rewards.env``): resolving ``env.fn``, the checks before launch, what a
step may return, async methods; and the built-in ``calculator`` tool environment driven turn by
turn with the text a model would write."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from megarl.rewards.env import EnvError, EnvSpecError, Step, as_step, resolve
from megarl.rewards.env_spec import import_env
from megarl.rewards.tool_calls import HermesParser, ToolCall
from megarl.rewards.tool_env import CalculatorEnv


def _file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_user_env_from_a_file_sync_and_async(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        """
        class Guess:
            def reset(self, row):
                self.target = int(row["answer"])
                return f"guess a number below 10 ({row['prompt']})"

            def step(self, action):
                done = action.strip() == str(self.target)
                return ("right" if done else "try again"), float(done), done, {"guesses": 1}

        class AsyncGuess(Guess):
            async def step(self, action):
                return Guess.step(self, action)
        """,
    )
    for name in ("Guess", "AsyncGuess"):
        env = import_env(f"{path}:{name}")()
        assert resolve(env.reset({"prompt": "p", "answer": "7"})) == "guess a number below 10 (p)"
        assert as_step(resolve(env.step("3"))) == Step("try again", 0.0, False, {"guesses": 1})
        assert as_step(resolve(env.step("7"))) == Step("right", 1.0, True, {"guesses": 1})


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        ("class E:\n    def step(self, action): ...\n", r"E has no method reset\(row\)"),
        ("class E:\n    def reset(self, row): ...\n    def step(self): ...\n", r"E step\(self\) cannot be called as step\(action\)"),
        ("class E:\n    def __init__(self, n): ...\n    def reset(self, row): ...\n    def step(self, a): ...\n",
         "E cannot be made with no arguments"),
        ("class E:\n    tools = 'calculator'\n    def reset(self, row): ...\n    def step(self, a): ...\n",
         "E tools is str 'calculator', not a list of function schemas"),
        ("def E(row): ...\n", "is a function, not a class"),
    ],
)
def test_unusable_classes_are_refused_naming_the_problem(tmp_path: Path, body: str, refusal: str) -> None:
    with pytest.raises(EnvSpecError, match=refusal):
        import_env(f"{_file(tmp_path, body)}:E")


def test_unknown_specs() -> None:
    with pytest.raises(EnvSpecError, match="is not a built-in environment \\(calculator, python\\)"):
        import_env("calculatr")
    with pytest.raises(EnvSpecError, match="environment file .*nope.py does not exist"):
        import_env("nope.py:Env")


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        ("just text", "not \\(observation, reward, done, info\\)"),
        (("obs", "1", False, {}), "reward '1', not a finite number"),
        (("obs", float("nan"), False, {}), "reward nan, not a finite number"),
        (("obs", True, False, {}), "reward True, not a finite number"),
        (("obs", 0.0, 1, {}), "done 1, not True or False"),
        (("obs", 0.0, False, [1]), "info list \\[1\\], not a dict"),
        (({"role": "tool"}, 0.0, False, {}), "observation dict .* want a text or a list"),
        (([{"role": "tool", "content": 3}], 0.0, False, {}), "observation list"),
    ],
)
def test_malformed_steps_are_named(value: object, refusal: str) -> None:
    with pytest.raises(EnvError, match=refusal):
        as_step(value)


def test_calculator_env_turn_by_turn() -> None:
    env, p = import_env("calculator")(), HermesParser()
    assert isinstance(env, CalculatorEnv) and env.tools[0]["function"]["name"] == "calculator"
    assert env.reset({"prompt": "123*456=", "answer": "56088"}) is None
    s = env.step("I will compute." + p.render(ToolCall("calculator", {"expression": "123*456"})))
    assert s == Step([{"role": "tool", "name": "calculator", "content": "56088"}], 0.0, False, {"tool_calls": 1, "tool_errors": 0})
    two = p.render(ToolCall("calculator", {"expression": "2**3"})) + p.render(ToolCall("search", {"q": "x"}))
    s = env.step(two)
    assert [m["content"] for m in s.observation] == ["8", "error: no tool named 'search' (tools: calculator)"]
    assert s.info == {"tool_calls": 2, "tool_errors": 1} and not s.done
    s = env.step(p.render(ToolCall("calculator", {"expression": "__import__('os')"})))
    assert s.observation[0]["content"].startswith("error: a function call is not allowed")
    s = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>')
    assert s.observation[0]["content"].startswith("error: tool call 1: invalid JSON") and s.info["tool_errors"] == 1
    assert env.step("56088") == Step("", 0.0, True, {"tool_calls": 0, "tool_errors": 0})
