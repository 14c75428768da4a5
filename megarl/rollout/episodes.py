"""Multi-turn rollouts (``env.fn``): each sample an episode of turns with an environment.

One sampling round over prompts × samples per prompt, on rank 0. Every sample is an episode
with its own environment instance (``reset(row)`` first). Turns go in waves: every episode
still running generates its next turn (one fleet call for the wave, each episode seeded by
(step, round, episode, turn), so runs reproduce and resume exactly), then each environment
steps on its turn's text; an episode ends when its environment says done, at ``env.max_turns``,
when a turn hits its token limit, or when the next observation would pass the context budget
(``env.max_tokens`` ids after the prompt: generated and observation ids together).

The trained ids are the engine's, never re-tokenised, with each observation's ids rendered
alone and appended (``megarl.data.turns``, ``megarl.rollout.episode``). An episode's reward is
its final answer's score by ``reward.fn`` (the last turn's text) plus the environment's step
rewards; an environment that raises or returns something unusable ends its episode, which gets
``env.failed_reward`` as its whole reward, counted.

Not yet: environments run in the trainer's process (not in isolated workers with a timeout),
and a wave waits for every environment before the next generation (no overlap).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from megarl.data.prompts import PromptRecord
from megarl.data.turns import TurnRenderer
from megarl.fleet.fleet import Fleet
from megarl.rewards.env import EnvError, Step, as_observation, as_step, resolve
from megarl.rewards.runner import RewardReport, RewardRunner, RewardSample
from megarl.rollout.episode import Episode, Turn

log = logging.getLogger("megarl.rollout")


@dataclass(frozen=True)
class EpisodeSettings:
    """How episodes run (the ``env`` section and the sampling settings they use)."""

    env_cls: type
    max_turns: int
    turn_tokens: int
    """Generated ids per turn at most (``rollout.max_response_len``)."""
    max_tokens: int
    """Ids after the prompt at most: generated and observation ids together (the context budget)."""
    failed_reward: float
    temperature: float
    top_p: float
    stop_token_ids: list[int]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class EnvReport:
    """What a step's episodes did (rank 0), for its metrics."""

    episodes: int = 0
    turns: int = 0
    tool_calls: float = 0.0
    tool_errors: float = 0.0
    failures: int = 0
    truncated: int = 0
    env_s: float = 0.0
    examples: list[str] = field(default_factory=list)

    def merge(self, o: EnvReport) -> None:
        for f in ("episodes", "turns", "tool_calls", "tool_errors", "failures", "truncated", "env_s"):
            setattr(self, f, getattr(self, f) + getattr(o, f))
        self.examples = (self.examples + o.examples)[:2]

    def metrics(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        return {
            "env/turns_mean": self.turns / n,
            "env/tool_calls_mean": self.tool_calls / n,
            "env/tool_error_rate": self.tool_errors / max(self.tool_calls + self.tool_errors, 1.0),
            "env/failures": float(self.failures),
            "env/truncated_frac": self.truncated / n,
            "env/time_s": self.env_s,
        }


@dataclass
class _Live:
    """An episode and its environment while it runs."""

    index: int
    record: PromptRecord
    episode: Episode
    env: Any
    done: bool = False
    text: str = ""
    """The last turn's text as the environment read it."""


def run_episodes(
    fleet: Fleet,
    renderer: TurnRenderer,
    rewards: RewardRunner,
    prompts: list[tuple[PromptRecord, list[int]]],
    samples: int,
    s: EpisodeSettings,
    seed: int,
    logprobs: bool,
) -> tuple[list[list[Episode]], list[list[str]], list[list[float]], int, RewardReport, EnvReport]:
    """Rank 0: ``samples`` episodes per prompt. Returns per prompt: episodes, final texts (as
    rewards read them), rewards; the oldest policy version used; the reward and env reports."""
    report = EnvReport()
    live = [
        _start(i * samples + j, rec, ids, s, report) for i, (rec, ids) in enumerate(prompts) for j in range(samples)
    ]
    version = 10**9
    for turn in range(s.max_turns):
        running = [e for e in live if not e.done]
        if not running:
            break
        version = min(version, _generate(fleet, running, s, seed, turn, logprobs))
        t0 = time.perf_counter()
        for e in running:
            _step(e, renderer, s, turn, report)
        report.env_s += time.perf_counter() - t0
    for e in live:
        if not e.done:  # env.max_turns reached
            e.episode.truncated, e.done = True, True
    report.episodes = len(live)
    report.turns = sum(len(e.episode.turns) for e in live)
    report.truncated = sum(e.episode.sample()[2] for e in live)
    scores, reward_report = rewards.score([_final(e, renderer) for e in live])
    per_prompt = [live[i * samples : (i + 1) * samples] for i in range(len(prompts))]
    totals = [
        [s.failed_reward if e.episode.failed else scores[e.index] + sum(e.episode.rewards) for e in group]
        for group in per_prompt
    ]
    texts = [[_final(e, renderer).response for e in group] for group in per_prompt]
    return [[e.episode for e in group] for group in per_prompt], texts, totals, version, reward_report, report


def _start(index: int, rec: PromptRecord, ids: list[int], s: EpisodeSettings, report: EnvReport) -> _Live:
    e = _Live(index, rec, Episode(list(ids)), None)
    try:
        e.env = s.env_cls()
        first = as_observation(resolve(e.env.reset(_row(rec))), "reset()")
        if first:  # (the row's prompt stands unless reset gives another: not supported in waves yet)
            raise EnvError("reset() returned an observation; environments here start from the row's own prompt")
    except Exception as exc:
        _fail(e, f"reset: {type(exc).__name__}: {exc}", report)
    return e


def _generate(fleet: Fleet, running: list[_Live], s: EpisodeSettings, seed: int, turn: int, logprobs: bool) -> int:
    """One wave: every running episode's next turn, grouped by the tokens it may still take."""
    budgets: dict[int, list[_Live]] = {}
    for e in running:
        budgets.setdefault(min(s.turn_tokens, s.max_tokens - len(e.episode.ids())), []).append(e)
    version = 10**9
    for max_tokens, group in sorted(budgets.items()):
        outs, v = fleet.generate(
            [e.episode.context() for e in group],
            n=1,
            max_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            stop_token_ids=s.stop_token_ids,
            seeds=[(seed * 100_003 + e.index) * 1_009 + turn for e in group],
            logprobs=logprobs,
        )
        version = min(version, v)
        for e, out in zip(group, outs, strict=True):
            o = out[0]
            e.episode.turns.append(Turn(list(o["token_ids"]), list(o["logprobs"]), o["finish_reason"] == "length"))
    return version


def _step(e: _Live, renderer: TurnRenderer, s: EpisodeSettings, turn: int, report: EnvReport) -> None:
    """The environment's answer to the episode's last turn, appended as ids (or the end)."""
    last = e.episode.turns[-1]
    e.text = renderer.action_text(last.ids)
    try:
        step: Step = as_step(resolve(e.env.step(e.text)))
    except Exception as exc:
        _fail(e, f"step {turn + 1}: {type(exc).__name__}: {exc}", report)
        return
    e.episode.rewards.append(step.reward)
    report.tool_calls += float(step.info.get("tool_calls", 0))
    report.tool_errors += float(step.info.get("tool_errors", 0))
    if step.done or last.truncated:
        e.done = True
        return
    observation = renderer.observation_ids(step.observation)
    if len(e.episode.ids()) + len(observation) >= s.max_tokens or turn + 1 == s.max_turns:
        e.episode.truncated, e.done = True, True  # no room for another turn
        return
    last.observation = observation


def _fail(e: _Live, why: str, report: EnvReport) -> None:
    e.episode.failed, e.done = True, True
    report.failures += 1
    if len(report.examples) < 2:
        report.examples.append(f"{e.record.where} #{e.index}: {why}")


def _final(e: _Live, renderer: TurnRenderer) -> RewardSample:
    """The episode's final answer as ``reward.fn`` scores it: the last turn's text."""
    text = renderer.answer_text(e.episode.turns[-1].ids) if e.episode.turns else ""
    rec = e.record
    return RewardSample(
        response=text, prompt=rec.prompt, answer=rec.answer, messages=rec.messages, extra=rec.extra, where=rec.where
    )


def _row(rec: PromptRecord) -> dict[str, Any]:
    return {"prompt": rec.prompt, "answer": rec.answer, "messages": rec.messages, "extra": rec.extra}
