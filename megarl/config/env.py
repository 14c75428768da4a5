"""The ``env`` section: multi-turn episodes with an environment (agents and tools). Unset
(``env.fn: ""``) a rollout is one prompt → one completion, as before. The environment class is
imported and its methods checked before the run starts (:func:`megarl.rewards.env.import_env`,
called by :func:`megarl.prelaunch.check_run`), not here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megarl.config.rules import fail


@dataclass(kw_only=True)
class EnvConfig:
    fn: str = ""
    """The environment of each episode: a built-in name (calculator, python), 'package.module:Class' or
    'path/to/file.py:Class' with reset(row) and step(action) (megarl/rewards/env.py documents
    them). Empty = single-turn rollouts, no environment."""
    agent: str = ""
    """Existing agent code as the episode, instead of env.fn: 'package.module:function' or
    'path/to/file.py:function', called as function(client, row) -> reward with an openai.OpenAI
    client on the run's OpenAI-compatible endpoint (any OpenAI client works with its base_url
    and api_key; megarl/rewards/agent.py). Empty = none."""
    max_turns: int = 4
    """Generated turns per episode at most; an episode still running after them is truncated."""
    max_tokens: int = 0
    """Ids after the prompt per episode at most, generated and observation ids together (the
    context budget); each turn generates at most rollout.max_response_len of them.
    0 = max_turns × rollout.max_response_len."""
    failed_reward: float = 0.0
    """Reward of an episode whose environment raised, timed out, lost its worker or returned
    something unusable (its whole reward; the episode ends there)."""
    workers: int = 2
    """Environment worker processes on rank 0; each episode's environment lives in one of them
    (started only for environments that run isolated)."""
    timeout_s: float = 30.0
    """Per-call limit of an environment's reset or step in a worker, seconds; past it the worker
    is killed, ending every episode it held."""
    isolate_builtins: bool = False
    """Run the built-in environments (calculator) in worker processes too (default: in-process,
    they are trusted)."""
    tool_parser: str = "hermes"
    """How the built-in tool environments read tool calls from a turn: hermes
    (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Qwen2.5/Qwen3)."""

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("max_tokens",)

    def validate(self) -> None:
        if self.agent and self.fn:
            fail("env.agent", self.agent, f"and env.fn={self.fn!r} are alternatives: set one")
        if self.agent and ":" not in self.agent:
            fail("env.agent", self.agent, "must be 'package.module:function' or 'path/to/file.py:function'")
        if self.timeout_s <= 0:
            fail("env.timeout_s", self.timeout_s, "must be > 0 (seconds)")
        if self.tool_parser != "hermes":
            fail("env.tool_parser", self.tool_parser, "is not a known parser (hermes)")

    def check_single_turn(self, sampling_seed: str, val_metric: str) -> None:
        """``rollout.sampling_seed: prompt`` keys single-turn samples (an episode's turns are not
        keyed so); ``train.val_metric: answer_prob`` scores an answer right after the prompt."""
        which = f"env.fn={self.fn!r}" if self.fn else f"env.agent={self.agent!r}"
        if sampling_seed == "prompt" and (self.fn or self.agent):
            fail("rollout.sampling_seed", "prompt", f"is for single-turn rollouts; {which} runs episodes (use round)")
        if val_metric == "answer_prob" and (self.fn or self.agent):
            fail("train.val_metric", "answer_prob", f"is for single-turn rollouts; {which} runs episodes (use reward)")

    def budget(self, max_response_len: int) -> int:
        """``max_tokens``, its default resolved."""
        return self.max_tokens or self.max_turns * max_response_len
