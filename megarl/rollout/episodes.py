"""Multi-turn rollouts (``env.fn``): each sample an episode of turns with an environment.

One sampling round over prompts × samples per prompt, on rank 0. Every sample is an episode
with its own environment instance (``reset(row)`` first), held by the run's :class:`Envs`
(:mod:`megarl.rewards.env_pool`: worker processes with a per-call timeout, or in-process for
trusted built-ins). An episode ends when its environment says done, at ``env.max_turns``, when a
turn hits its token limit, or when the next observation would pass the context budget
(``env.max_tokens`` ids after the prompt: generated and observation ids together).

**Scheduling.** Episodes advance independently: an episode whose environment has answered joins
the next generation; one generation is in flight at a time (a fleet call, in a thread, over
every episode ready when it starts, grouped by the tokens each may still take) while the
environments of the others work in their workers. Engines run one generation at a time each
and batch its prompts, so gathering the ready episodes into one call keeps vLLM's batching;
one call per episode would run them one by one. Each turn is seeded by (step, round, episode,
turn), and an episode's course depends only on its own turns and environment, so a run
reproduces whatever order calls finish in; results are laid out by episode index. (An
episode's turns are not pinned to one engine: the fleet balances each call by load.)

The trained ids are the engine's, never re-tokenised, with each observation's ids rendered
alone and appended (``megarl.data.turns``, ``megarl.rollout.episode``). An episode's reward is
its final answer's score by ``reward.fn`` (the last turn's text) plus the environment's step
rewards; an environment that raises, returns something unusable, runs past ``env.timeout_s``
or loses its worker ends its episode, which gets ``env.failed_reward`` as its whole reward,
counted by kind (``env/errors``, ``env/timeouts``, ``env/crashes``).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from megarl.data.prompts import PromptRecord
from megarl.data.turns import TurnRenderer
from megarl.fleet.fleet import Fleet
from megarl.rewards.env import Step
from megarl.rewards.env_pool import Envs
from megarl.rewards.pool import Outcome
from megarl.rewards.runner import RewardReport, RewardRunner, RewardSample
from megarl.rollout.episode import Episode, Turn

log = logging.getLogger("megarl.rollout")


@dataclass(frozen=True)
class EpisodeSettings:
    """How episodes run (the ``env`` section and the sampling settings they use)."""

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
    """Episodes ended by their environment (the next three together)."""
    timeouts: int = 0
    """Episodes whose environment call ran past ``env.timeout_s`` (its worker killed)."""
    crashes: int = 0
    """Episodes whose worker died under them (their own call's crash, or another episode's
    crash or timeout in the same worker)."""
    errors: int = 0
    """Episodes whose environment raised or returned something unusable."""
    truncated: int = 0
    history_breaks: int = 0
    """``env.agent``: requests that did not continue the ids before them (a new segment)."""
    env_s: float = 0.0
    """Seconds the round waited on environments with no generation in flight (what overlap did
    not hide)."""
    examples: list[str] = field(default_factory=list)

    def merge(self, o: EnvReport) -> None:
        for f in ("episodes", "turns", "tool_calls", "tool_errors", "failures", "truncated", "history_breaks", "env_s"):
            setattr(self, f, getattr(self, f) + getattr(o, f))
        self.timeouts, self.crashes, self.errors = (
            self.timeouts + o.timeouts,
            self.crashes + o.crashes,
            self.errors + o.errors,
        )
        self.examples = (self.examples + o.examples)[:2]

    def metrics(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        return {
            "env/turns_mean": self.turns / n,
            "env/tool_calls_mean": self.tool_calls / n,
            "env/tool_error_rate": self.tool_errors / max(self.tool_calls + self.tool_errors, 1.0),
            "env/failures": float(self.failures),
            "env/timeouts": float(self.timeouts),
            "env/crashes": float(self.crashes),
            "env/errors": float(self.errors),
            "env/truncated_frac": self.truncated / n,
            "env/history_breaks": float(self.history_breaks),
            "env/time_s": self.env_s,
        }

    def summary(self, failed_reward: float) -> str:
        """One line for the log ('' when no episode failed)."""
        if not self.failures:
            return ""
        return (
            f"{self.failures} of {self.episodes} episodes failed in their environment and got "
            f"env.failed_reward={failed_reward:g} ({self.timeouts} timed out, {self.crashes} lost their worker, "
            f"{self.errors} raised or returned something unusable); e.g. {'; '.join(self.examples)}"
        )


@dataclass
class _Live:
    """An episode while it runs."""

    index: int
    record: PromptRecord
    episode: Episode
    key: int = -1
    """Its environment's key in the run's :class:`Envs`."""
    done: bool = False
    text: str = ""
    """The last turn's text as the environment read it."""
    failure: tuple[str, str] | None = None
    """(kind, what happened) when the environment ended it."""
    tool_calls: float = 0.0
    tool_errors: float = 0.0


def run_episodes(
    fleet: Fleet,
    renderer: TurnRenderer,
    rewards: RewardRunner,
    envs: Envs,
    prompts: list[tuple[PromptRecord, list[int]]],
    samples: int,
    s: EpisodeSettings,
    seed: int,
    logprobs: bool,
) -> tuple[list[list[Episode]], list[list[str]], list[list[float]], int, RewardReport, EnvReport]:
    """Rank 0: ``samples`` episodes per prompt. Returns per prompt: episodes, final texts (as
    rewards read them), rewards; the oldest policy version used; the reward and env reports."""
    live = [
        _Live(i * samples + j, rec, Episode(list(ids))) for i, (rec, ids) in enumerate(prompts) for j in range(samples)
    ]
    report = EnvReport()
    version = _Rounds(fleet, renderer, envs, s, seed, logprobs, report).run(live)
    _tally(live, report)
    scores, reward_report = rewards.score([_final(e, renderer) for e in live])
    per_prompt = [live[i * samples : (i + 1) * samples] for i in range(len(prompts))]
    totals = [
        [s.failed_reward if e.episode.failed else scores[e.index] + sum(e.episode.rewards) for e in group]
        for group in per_prompt
    ]
    texts = [[_final(e, renderer).response for e in group] for group in per_prompt]
    return [[e.episode for e in group] for group in per_prompt], texts, totals, version, reward_report, report


class _Rounds:
    """The turns of one round's episodes, scheduled as they become ready (module docstring)."""

    def __init__(
        self,
        fleet: Fleet,
        renderer: TurnRenderer,
        envs: Envs,
        s: EpisodeSettings,
        seed: int,
        logprobs: bool,
        report: EnvReport,
    ) -> None:
        self.fleet, self.renderer, self.envs, self.s = fleet, renderer, envs, s
        self.seed, self.logprobs, self.report = seed, logprobs, report
        self.version = 10**9

    def run(self, live: list[_Live]) -> int:
        """Every episode to its end; returns the oldest policy version that generated a turn."""
        by_key: dict[int, _Live] = {}
        for e in live:
            e.key = self.envs.reset(_row(e.record))
            by_key[e.key] = e
        waiting = len(live)  # episodes with an environment call outstanding
        ready: list[_Live] = []
        gen: Future[list[tuple[_Live, Turn]]] | None = None
        wake_r, wake_w = os.pipe()
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="episodes-generate")
        try:
            while waiting or ready or gen is not None:
                if gen is None and ready:
                    gen = thread.submit(self._generate, sorted(ready, key=lambda e: e.index))
                    gen.add_done_callback(lambda _: os.write(wake_w, b"."))
                    ready = []
                t0 = time.perf_counter()
                generating = gen is not None
                outcomes = self.envs.poll([wake_r] if generating else [])
                if not generating:
                    self.report.env_s += time.perf_counter() - t0
                if gen is not None and gen.done():
                    os.read(wake_r, 1)
                    for e, turn in gen.result():  # (a fleet error propagates)
                        self._turn(e, turn)
                        waiting += 1
                    gen = None
                for key, outcome in outcomes:
                    e = by_key[key]
                    waiting -= 1
                    self._answer(e, outcome)
                    if e.done:
                        self.envs.drop(e.key)
                    else:
                        ready.append(e)
        except BaseException:
            self.envs.abandon()
            raise
        finally:
            thread.shutdown(wait=True)
            os.close(wake_r)
            os.close(wake_w)
        return self.version

    def _generate(self, batch: list[_Live]) -> list[tuple[_Live, Turn]]:
        """(In the generation thread.) Each episode's next turn, one fleet call per token budget."""
        s = self.s
        budgets: dict[int, list[_Live]] = {}
        for e in batch:
            budgets.setdefault(min(s.turn_tokens, s.max_tokens - len(e.episode.ids())), []).append(e)
        out: list[tuple[_Live, Turn]] = []
        for max_tokens, group in sorted(budgets.items()):
            outs, v = self.fleet.generate(
                [e.episode.context() for e in group],
                n=1,
                max_tokens=max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                stop_token_ids=s.stop_token_ids,
                seeds=[(self.seed * 100_003 + e.index) * 1_009 + len(e.episode.turns) for e in group],
                logprobs=self.logprobs,
            )
            self.version = min(self.version, v)
            for e, o in zip(group, outs, strict=True):
                first = o[0]
                out.append(
                    (e, Turn(list(first["token_ids"]), list(first["logprobs"]), first["finish_reason"] == "length"))
                )
        return out

    def _turn(self, e: _Live, turn: Turn) -> None:
        """A generated turn: appended, and its text sent to the episode's environment."""
        e.episode.turns.append(turn)
        e.text = self.renderer.action_text(turn.ids)
        self.envs.step(e.key, e.text)

    def _answer(self, e: _Live, o: Outcome) -> None:
        """The environment's answer to ``reset`` or to the episode's last turn: the episode ends,
        or the observation's ids are appended for its next turn."""
        turn = len(e.episode.turns)
        where = f"step {turn}" if turn else "reset"
        if o.kind != "ok":
            _fail(e, o.kind, f"{where}: {o.error}")
            return
        if not turn:
            if o.value:  # (the row's prompt stands unless reset gives another: not supported yet)
                _fail(e, "error", "reset: returned an observation; environments here start from the row's own prompt")
            return
        step: Step = o.value
        e.episode.rewards.append(step.reward)
        e.tool_calls += _number(step.info.get("tool_calls", 0))
        e.tool_errors += _number(step.info.get("tool_errors", 0))
        last = e.episode.turns[-1]
        if step.done or last.truncated:
            e.done = True
            return
        observation = self.renderer.observation_ids(step.observation)
        if len(e.episode.ids()) + len(observation) >= self.s.max_tokens or turn == self.s.max_turns:
            e.episode.truncated, e.done = True, True  # no room for another turn
            return
        last.observation = observation


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _fail(e: _Live, kind: str, why: str) -> None:
    e.episode.failed, e.done = True, True
    e.failure = (kind, f"{e.record.where} #{e.index}: {why}")


def _tally(live: list[_Live], report: EnvReport) -> None:
    """The round's counts, summed in episode order (not in the order calls finished)."""
    report.episodes = len(live)
    report.turns = sum(len(e.episode.turns) for e in live)
    report.truncated = sum(e.episode.sample()[2] for e in live)
    report.tool_calls = sum(e.tool_calls for e in live)
    report.tool_errors = sum(e.tool_errors for e in live)
    failed = [e.failure for e in live if e.failure is not None]
    report.failures = len(failed)
    report.timeouts = sum(kind == "timeout" for kind, _ in failed)
    report.crashes = sum(kind == "crash" for kind, _ in failed)
    report.errors = sum(kind == "error" for kind, _ in failed)
    report.examples = [why for _, why in failed[:2]]


def _final(e: _Live, renderer: TurnRenderer) -> RewardSample:
    """The episode's final answer as ``reward.fn`` scores it: the last turn's text."""
    text = renderer.answer_text(e.episode.turns[-1].ids) if e.episode.turns else ""
    rec = e.record
    return RewardSample(
        response=text, prompt=rec.prompt, answer=rec.answer, messages=rec.messages, extra=rec.extra, where=rec.where
    )


def _row(rec: PromptRecord) -> dict[str, Any]:
    return {"prompt": rec.prompt, "answer": rec.answer, "messages": rec.messages, "extra": rec.extra}
