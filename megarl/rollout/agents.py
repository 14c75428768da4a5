"""``env.agent`` rollouts: the user's agent code as episodes, token-exact through the endpoint.

One sampling round on rank 0: every sample runs ``function(client, row)`` in a thread of its own
(``env.workers`` at a time), with an OpenAI client on the run's endpoint
(:mod:`megarl.rewards.agent_endpoint`) and an API key for its session. The endpoint renders each
request with the run's chat template and records the prompt ids and the engine's completion ids
of every call; the calls chain into one episode when each request continues the previous call's
ids (prompt ⊕ generated ⊕ observation). The agent's return value is the episode's reward.

Generation: the agents' requests are gathered into joined fleet calls by :class:`BatchedGenerate`
(every request waiting when the dispatcher looks, in one call), several in flight at once: the
engines run them in one continuous batch (``megarl.engine.stepper``), so no request waits for
another call to end. Each request keeps its own seed (the session's seed and its call number),
so a run reproduces whatever the threads' timing.

What trains: an episode whose agent rewrote its history (a request that does not continue the
ids before it) trains on its last segment — the ids that led to its final answer — and the
break is counted (``env/history_breaks``). An agent that raises or returns no finite number gets
``env.failed_reward``, counted in ``env/failures``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from megarl.data.prompts import PromptRecord
from megarl.fleet.fleet import Fleet
from megarl.rewards.agent import AgentResult, run_agent
from megarl.rewards.agent_endpoint import AgentEndpoint, EndpointSettings
from megarl.rollout.episode import Episode
from megarl.rollout.episodes import MAX_CALLS, EnvReport

log = logging.getLogger("megarl.rollout")

_Request = tuple[list[int], int, float, float, int, int]
"""(prompt ids, max_tokens, temperature, top_p, seed, episode)"""

_REMEMBERED = 65_536
"""Episodes whose engine :class:`BatchedGenerate` remembers (the first to call forgotten first:
far more than a round's episodes, so none still running is forgotten)."""


class BatchedGenerate:
    """``generate(prompt_ids, max_tokens, temperature, top_p, seed, episode)`` for many threads:
    requests wait in a queue; a dispatcher thread sends every waiting request in one joined fleet
    call (grouped by their sampling settings) without waiting for the calls before it. An
    episode's calls after its first ask for the engine that served the one before (its prefix
    cache)."""

    def __init__(self, fleet: Fleet, stop_token_ids: list[int], logprobs: bool = True) -> None:
        self.fleet, self.stop_token_ids, self.logprobs = fleet, stop_token_ids, logprobs
        self._waiting: list[tuple[_Request, Future[tuple[list[int], list[float], str]]]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._engine_of: dict[int, str] = {}
        """The engine of each episode's last call (under ``_cv``)."""
        self._calls = ThreadPoolExecutor(max_workers=MAX_CALLS, thread_name_prefix="agent-call")
        self.calls = 0
        """Fleet calls made (requests waiting together share one)."""
        self._thread = threading.Thread(target=self._dispatch, name="agent-generate", daemon=True)
        self._thread.start()

    def __call__(
        self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float, seed: int, episode: int
    ) -> tuple[list[int], list[float], str]:
        done: Future[tuple[list[int], list[float], str]] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the agent generator is closed")
            self._waiting.append(((list(prompt_ids), max_tokens, temperature, top_p, seed, episode), done))
            self._cv.notify()
        return done.result()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)
        self._calls.shutdown(wait=True)

    def _dispatch(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed and not self._waiting:
                    return
                batch, self._waiting = self._waiting, []
            groups: dict[tuple[int, float, float], list[tuple[_Request, Future[Any]]]] = {}
            for item in batch:
                _, max_tokens, temperature, top_p, _, _ = item[0]
                groups.setdefault((max_tokens, temperature, top_p), []).append(item)
            for (max_tokens, temperature, top_p), items in groups.items():
                self._calls.submit(self._send, items, max_tokens, temperature, top_p)

    def _send(
        self, items: list[tuple[_Request, Future[Any]]], max_tokens: int, temperature: float, top_p: float
    ) -> None:
        with self._cv:
            prefer = [self._engine_of.get(req[5]) for req, _ in items]
        try:
            outs, _ = self.fleet.generate(
                [req[0] for req, _ in items],
                n=1,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop_token_ids=self.stop_token_ids,
                seeds=[req[4] for req, _ in items],
                logprobs=self.logprobs,
                prefer=prefer,
                join=True,
            )
        except BaseException as e:  # every waiting agent gets the fleet's error
            for _, done in items:
                done.set_exception(e)
            return
        with self._cv:
            self.calls += 1
            for (req, _), out in zip(items, outs, strict=True):
                self._engine_of[req[5]] = str(out[0]["engine"])
                if len(self._engine_of) > _REMEMBERED:
                    del self._engine_of[next(iter(self._engine_of))]
        for (_, done), out in zip(items, outs, strict=True):
            o = out[0]
            done.set_result((list(o["token_ids"]), list(o["logprobs"]), str(o["finish_reason"])))


def run_agent_episodes(
    endpoint: AgentEndpoint,
    agent: Callable[..., Any],
    prompts: list[tuple[PromptRecord, list[int]]],
    samples: int,
    seed: int,
    failed_reward: float,
    threads: int,
) -> tuple[list[list[Episode]], list[list[float]], EnvReport]:
    """Rank 0: ``samples`` agent episodes per prompt (the agent's own rendering of the row
    replaces the prompt ids); per prompt the episodes and their rewards, and the round's report."""
    jobs = [(i, j, rec) for i, (rec, _) in enumerate(prompts) for j in range(samples)]
    with ThreadPoolExecutor(max_workers=max(threads, 1), thread_name_prefix="agent") as pool:
        futures = [
            pool.submit(
                run_agent, endpoint, agent, _row(rec), (seed * 100_003 + i * samples + j) * 1_009, failed_reward
            )
            for i, j, rec in jobs
        ]
        results: list[AgentResult] = [f.result() for f in futures]
    report = EnvReport(episodes=len(results))
    episodes: list[list[Episode]] = [[] for _ in prompts]
    rewards: list[list[float]] = [[] for _ in prompts]
    for (i, _, rec), r in zip(jobs, results, strict=True):
        episodes[i].append(_episode(r, prompts[i][1]))
        rewards[i].append(r.reward)
        report.turns += len(episodes[i][-1].turns)
        report.history_breaks += len(r.episode.breaks)
        if r.error:
            report.failures += 1
            report.errors += 1
            if len(report.examples) < 2:
                report.examples.append(f"{rec.where}: {r.error}")
    report.truncated = sum(e.sample()[2] for group in episodes for e in group)
    return episodes, rewards, report


def _episode(r: AgentResult, row_prompt: list[int]) -> Episode:
    """The agent's last segment as an episode (its own prompt ids); an agent that never called
    the model is an empty episode after the row's prompt."""
    if not r.episode.segments:
        return Episode(list(row_prompt), failed=bool(r.error))
    seg = r.episode.segments[-1]
    return Episode(list(seg.prompt_ids), list(seg.turns), failed=bool(r.error))


def _row(rec: PromptRecord) -> dict[str, Any]:
    return {"prompt": rec.prompt, "answer": rec.answer, "messages": rec.messages, "extra": rec.extra}


class AgentRollouts:
    """Rank 0's side of ``env.agent``: the endpoint (and one pinned to greedy decoding for
    validation), the batched generator over the fleet, and the agent function."""

    def __init__(
        self, agent: Callable[..., Any], fleet: Fleet, tok: Any, settings: EndpointSettings, threads: int
    ) -> None:
        self.agent, self.tok, self.threads = agent, tok, threads
        self.generate = BatchedGenerate(fleet, list(tok.eos_ids))
        self.endpoint = AgentEndpoint(tok, self.generate, settings)
        self.greedy = AgentEndpoint(tok, self.generate, dataclasses.replace(settings, temperature=0.0, top_p=1.0))
        self.endpoint.start()
        self.greedy.start()

    def sample(
        self, prompts: list[tuple[PromptRecord, list[int]]], samples: int, seed: int, failed_reward: float
    ) -> tuple[list[list[Episode]], list[list[str]], list[list[float]], EnvReport]:
        """One round: per prompt the episodes, their final texts (as rewards read them) and rewards."""
        eps, rewards, report = run_agent_episodes(
            self.endpoint, self.agent, prompts, samples, seed, failed_reward, self.threads
        )
        texts = [[self.tok.decode(e.turns[-1].ids) if e.turns else "" for e in group] for group in eps]
        return eps, texts, rewards, report

    def validate(self, rows: list[tuple[PromptRecord, list[int]]], failed_reward: float) -> tuple[float, EnvReport]:
        """The mean reward of one greedy agent episode per validation row."""
        _, rewards, report = run_agent_episodes(self.greedy, self.agent, rows, 1, 0, failed_reward, self.threads)
        return sum(r[0] for r in rewards) / max(len(rewards), 1), report

    def close(self) -> None:
        self.endpoint.stop()
        self.greedy.stop()
        self.generate.close()
