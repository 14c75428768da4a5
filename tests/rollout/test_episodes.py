"""Scheduling multi-turn episodes (``megarl.rollout.episodes``): environments in the real worker
pool overlap generation, joined fleet calls over the episodes ready together, several in flight
at once (the engines' continuous batch is ``tests/engine/test_stepper.py``); the results
equal a slow serial reference whatever order calls finish in; failing environments end only
their episodes, counted. The fleet is a stand-in whose generate sleeps (it isolates the
scheduling: the engines are not what is tested here) and derives each turn from its seed."""

from __future__ import annotations

import random
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from megarl.config import DataConfig, RewardConfig
from megarl.data.prompts import PromptRecord
from megarl.rewards.env import as_step
from megarl.rewards.env_pool import EnvPool
from megarl.rewards.runner import RewardRunner
from megarl.rollout.episode import Episode, Turn
from megarl.rollout.episodes import EnvReport, EpisodeSettings, run_episodes

ENV = '''
import random, time


class Slow:
    """Answers each turn after ~50 ms with its episode's name, count and the turn's text; three
    steps. 'boom' raises at its second step, 'hang' sleeps past any timeout at its first."""

    def reset(self, row):
        self.name, self.n = row["prompt"], 0

    def step(self, action):
        time.sleep(random.uniform(0.03, 0.07))  # (unseeded: completion order differs run to run)
        self.n += 1
        if self.name == "boom" and self.n == 2:
            raise ValueError("boom")
        if self.name == "hang":
            time.sleep(60)
        return f"{self.name}{self.n}:{action}", 0.1 * self.n, self.n >= 3, {"tool_calls": 1}
'''

EOS = 2
GEN_S = 0.05
SETTINGS = EpisodeSettings(
    max_turns=3, turn_tokens=4, max_tokens=200, failed_reward=-1.0, temperature=1.0, top_p=1.0, stop_token_ids=[EOS]
)


def _turn_ids(seed: int, context: list[int]) -> list[int]:
    return [3 + seed % 5, 3 + sum(context) % 7, EOS]


class SleepyFleet:
    """Generates ``_turn_ids`` per prompt after ~``GEN_S`` (jittered), each joined call on its own
    (as an engine's continuous batch serves them); counts the calls in flight at once."""

    def __init__(self, jitter_seed: int) -> None:
        self.rng = random.Random(jitter_seed)
        self.lock = threading.Lock()
        self.batches: list[int] = []
        self.in_flight = self.most_in_flight = 0

    def generate(self, prompts: list[list[int]], **kw: Any) -> tuple[list[list[dict[str, Any]]], int]:
        assert kw["join"] is True
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            pause = GEN_S * self.rng.uniform(0.6, 1.4)
        try:
            time.sleep(pause)
            with self.lock:
                self.batches.append(len(prompts))
            outs = [_turn_ids(s, p) for s, p in zip(kw["seeds"], prompts, strict=True)]
            engines = [p or f"e{len(self.batches) % 2}" for p in kw["prefer"]]  # a first turn: either engine
            return [
                [{"token_ids": o, "logprobs": [-0.5] * len(o), "finish_reason": "stop", "engine": e}]
                for o, e in zip(outs, engines, strict=True)
            ], 7
        finally:
            with self.lock:
                self.in_flight -= 1


class Renderer:
    """Ids as text: a turn reads as its ids; an observation renders as one id per character."""

    def encode_prompt(self, rec: PromptRecord) -> list[int]:
        return [ord(c) for c in rec.prompt]

    def observation_ids(self, observation: Any) -> list[int]:
        text = observation if isinstance(observation, str) else "".join(m["content"] for m in observation)
        return [10 + ord(c) % 50 for c in text]

    def action_text(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    answer_text = action_text


def _env_file(tmp_path: Path) -> str:
    path = tmp_path / "slow_env.py"
    path.write_text(textwrap.dedent(ENV))
    return f"{path}:Slow"


def _prompts(names: list[str]) -> list[tuple[PromptRecord, list[int]]]:
    return [(PromptRecord(n, "", f"t:{i}"), [ord(c) for c in n]) for i, n in enumerate(names)]


def _round(fleet: SleepyFleet, pool: EnvPool, names: list[str], seed: int = 5) -> tuple[Any, ...]:
    rewards = RewardRunner(RewardConfig(fn=["exact_match"]), DataConfig())
    return run_episodes(fleet, Renderer(), rewards, pool, _prompts(names), 2, SETTINGS, seed, True)  # type: ignore[arg-type]


def _reference(names: list[str], samples: int, seed: int, env_cls: type) -> list[Episode]:
    """The slow obvious version: each episode alone, turn after turn, its environment in-process."""
    r, out = Renderer(), []
    for i, (rec, ids) in enumerate(_prompts(names)):
        for j in range(samples):
            index, ep, env = i * samples + j, Episode(list(ids)), env_cls()
            env.reset({"prompt": rec.prompt})
            for turn in range(SETTINGS.max_turns):
                gen = _turn_ids((seed * 100_003 + index) * 1_009 + turn, ep.context())
                ep.turns.append(Turn(gen, [-0.5] * len(gen)))
                step = as_step(env.step(r.action_text(gen)))
                ep.rewards.append(step.reward)
                if step.done:
                    break
                ep.turns[-1].observation = r.observation_ids(step.observation)
            out.append(ep)
    return out


def _load_env(tmp_path: Path) -> type:
    ns: dict[str, Any] = {}
    exec(textwrap.dedent(ENV), ns)  # (the same class, in this process, for the reference)
    return ns["Slow"]


def test_episodes_overlap_and_reproduce_whatever_the_timing(tmp_path: Path) -> None:
    names = ["a", "bb", "ccc", "dddd"]  # × 2 samples: 8 episodes of 3 turns
    serial_s = 8 * 3 * (GEN_S + 0.05)  # every generation and every environment step one after another
    reference = _reference(names, 2, 5, _load_env(tmp_path))
    results = []
    for workers, jitter in ((8, 1), (3, 2)):
        pool = EnvPool(_env_file(tmp_path), workers=workers, timeout_s=10.0)
        try:
            _round(SleepyFleet(0), pool, ["warm"])  # workers started and ready
            fleet = SleepyFleet(jitter)
            t0 = time.perf_counter()
            episodes, texts, totals, version, _, report = _round(fleet, pool, names)
            wall = time.perf_counter() - t0
        finally:
            pool.close()
        flat = [e for group in episodes for e in group]
        assert [e.turns for e in flat] == [e.turns for e in reference]
        assert [e.ids() for e in flat] == [e.ids() for e in reference]
        assert totals == [[pytest.approx(0.6)] * 2] * 4  # 0.1 + 0.2 + 0.3 from the environment, exact_match 0
        assert version == 7 and sum(fleet.batches) == 24
        assert max(fleet.batches) == 1  # ready episodes split over the free calls: each returns on its own
        assert (report.episodes, report.turns, report.tool_calls, report.failures) == (8, 24, 24.0, 0)
        assert (report.later_turns, report.metrics()["env/same_engine_frac"]) == (16, 1.0)  # asked for its engine
        assert 3 * 0.03 <= report.chain_s < wall  # three steps of 30-70 ms (and a reset), within the round
        assert report.chain_s + 3 * 0.6 * GEN_S <= report.critical_s <= wall  # + its three turns' calls
        results.append((flat, texts, totals))
        if workers == 8:  # every environment step in parallel: ~3 × (generation + step)
            assert wall < 0.4 * serial_s, (wall, fleet.batches)
            assert fleet.most_in_flight > 1  # episodes ready at other times do not wait for a call to end
    assert results[0][0] == results[1][0] and results[0][1:] == results[1][1:]


def test_failing_environments_end_only_their_episodes(tmp_path: Path) -> None:
    pool = EnvPool(_env_file(tmp_path), workers=8, timeout_s=0.5)  # one episode per worker
    try:
        _round(SleepyFleet(0), pool, ["warm"])
        t0 = time.perf_counter()
        episodes, _, totals, _, _, report = _round(SleepyFleet(3), pool, ["a", "boom", "hang", "b"])
        wall = time.perf_counter() - t0
    finally:
        pool.close()
    assert totals == [[pytest.approx(0.6)] * 2, [-1.0, -1.0], [-1.0, -1.0], [pytest.approx(0.6)] * 2]
    assert [len(e.turns) for e in episodes[1]] == [2, 2] and all(e.failed for e in episodes[1] + episodes[2])
    assert [len(e.turns) for e in episodes[2]] == [1, 1]
    assert (report.failures, report.timeouts, report.crashes, report.errors) == (4, 2, 0, 2)
    metrics = report.metrics()
    assert (metrics["env/failures"], metrics["env/timeouts"], metrics["env/errors"]) == (4.0, 2.0, 2.0)
    assert report.examples[0] == "t:1 #2: step 2: ValueError: boom"
    assert wall < 3 * (GEN_S + 0.07) + 0.5 + 1.0  # the hangs cost their timeout once, in parallel with the rest
    merged = EnvReport()
    merged.merge(report)
    merged.merge(report)
    assert (merged.failures, merged.timeouts, merged.errors, merged.examples) == (8, 4, 4, report.examples)


def test_ready_episodes_are_split_over_the_free_calls() -> None:
    from megarl.rollout.episodes import _chunks

    batch = list(range(10))
    assert _chunks(batch, 16) == [[i] for i in range(10)]  # type: ignore[arg-type]
    assert _chunks(batch, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # type: ignore[arg-type]
    assert _chunks(batch, 1) == [batch]  # type: ignore[arg-type]
    assert sum(_chunks(list(range(128)), 16), []) == list(range(128))  # type: ignore[arg-type]
