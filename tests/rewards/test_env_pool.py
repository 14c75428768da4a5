"""User environments in the real worker pool (``megarl.rewards.env_pool``): one batch holding an
environment that raises, one that hangs past the timeout, one that kills its interpreter, one
that returns garbage and normal ones; the episodes a dying worker held; stickiness under
interleaved calls (sync and async environments); workers that cannot start; the in-process
built-ins."""

from __future__ import annotations

import random
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from megarl.config import EnvConfig
from megarl.errors import RolloutError
from megarl.rewards.env import Step
from megarl.rewards.env_pool import EnvPool, Envs, InlineEnvs, start_envs
from megarl.rewards.pool import Outcome

ENVS = '''
import asyncio, os, time


class Flaky:
    """Does what the row's prompt says on its first step; 'ok' answers with its history."""

    def reset(self, row):
        self.mode, self.seen = row["prompt"], []

    def step(self, action):
        self.seen.append(action)
        if self.mode == "raise":
            raise RuntimeError("tool backend down")
        if self.mode == "hang":
            time.sleep(60)
        if self.mode == "exit":
            os._exit(3)
        if self.mode == "garbage":
            return "not a tuple"
        return "|".join(self.seen), float(len(self.seen)), len(self.seen) >= 3, {"pid": os.getpid()}


class Tally:
    """Remembers its episode's name and every action; answers with all of them."""

    def reset(self, row):
        self.name, self.seen = row["prompt"], []

    async def step(self, action):
        await asyncio.sleep(0.001)
        self.seen.append(action)
        return f"{self.name}:{','.join(self.seen)}", float(len(self.seen)), False, {"pid": os.getpid()}
'''


def _spec(tmp_path: Path, cls: str) -> str:
    path = tmp_path / "my_envs.py"
    path.write_text(textwrap.dedent(ENVS))
    return f"{path}:{cls}"


def _row(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "answer": "", "messages": None, "extra": {}}


def _collect(envs: Envs, keys: set[int]) -> dict[int, Outcome]:
    """Poll until every key in ``keys`` answered once."""
    out: dict[int, Outcome] = {}
    while keys - set(out):
        for key, o in envs.poll([]):
            assert key not in out, f"two outcomes for episode {key}"
            out[key] = o
    return out


def test_one_batch_with_every_kind_of_failure(tmp_path: Path) -> None:
    modes = ["ok", "raise", "hang", "exit", "garbage", "ok"]
    pool = EnvPool(_spec(tmp_path, "Flaky"), workers=len(modes), timeout_s=1.0)  # one episode per worker
    try:
        keys = [pool.reset(_row(m)) for m in modes]
        resets = _collect(pool, set(keys))
        assert all(o.kind == "ok" and o.value == "" for o in resets.values())
        t0 = time.monotonic()
        for k in keys:
            pool.step(k, "a1")
        first = _collect(pool, set(keys))
        wall = time.monotonic() - t0
        assert wall < 1.0 + 1.5, wall  # the hang costs its timeout, nothing else waits for more
        kinds = [first[k].kind for k in keys]
        assert kinds == ["ok", "error", "timeout", "crash", "error", "ok"]
        assert first[keys[1]].error == "RuntimeError: tool backend down"
        assert first[keys[2]].error == "timed out after 1s (worker killed)"
        assert first[keys[3]].error == "environment worker died (exit code 3)"
        assert first[keys[4]].error.startswith("EnvError: step() returned str 'not a tuple'")
        ok = first[keys[0]].value
        assert isinstance(ok, Step) and (ok.observation, ok.reward, ok.done) == ("a1", 1.0, False)
        assert pool.replaced == 2
        # the survivors go on where they were; the replaced workers serve new episodes
        for k in (keys[0], keys[5]):
            pool.step(k, "a2")
        second = _collect(pool, {keys[0], keys[5]})
        assert [second[k].value.observation for k in (keys[0], keys[5])] == ["a1|a2", "a1|a2"]
        fresh = [pool.reset(_row("ok")) for _ in modes]
        assert all(o.kind == "ok" for o in _collect(pool, set(fresh)).values())
        for k in fresh:
            pool.step(k, "b")
        assert {o.value.observation for o in _collect(pool, set(fresh)).values()} == {"b"}
    finally:
        pool.close()


def test_a_dying_worker_ends_every_episode_it_held(tmp_path: Path) -> None:
    pool = EnvPool(_spec(tmp_path, "Flaky"), workers=2, timeout_s=10.0)
    try:
        keys = [pool.reset(_row(m)) for m in ["ok", "ok", "exit", "ok"]]  # worker 0: keys 0, 2; worker 1: 1, 3
        history: dict[int, list[Outcome]] = {k: [] for k in keys}
        outstanding = set(keys)
        while outstanding:
            for key, o in pool.poll([]):
                history[key].append(o)
                outstanding.discard(key)
                if o.kind == "ok" and not (isinstance(o.value, Step) and o.value.done):
                    pool.step(key, f"a{len(history[key])}")
                    outstanding.add(key)
        kinds = {k: [o.kind for o in h] for k, h in history.items()}
        assert kinds[keys[1]] == kinds[keys[3]] == ["ok", "ok", "ok", "ok"]  # reset + 3 steps, done
        assert history[keys[1]][-1].value.observation == "a1|a2|a3"
        assert kinds[keys[2]] == ["ok", "crash"]
        assert kinds[keys[0]][0] == "ok" and kinds[keys[0]][-1] == "crash"  # its instance died with the worker
        assert "its environment worker was lost (environment worker died (exit code 3)" in history[keys[0]][-1].error
        assert pool.replaced == 1
    finally:
        pool.close()


def test_calls_are_sticky_under_interleaving(tmp_path: Path) -> None:
    pool = EnvPool(_spec(tmp_path, "Tally"), workers=2, timeout_s=10.0)
    try:
        names = [f"ep{i}" for i in range(6)]
        keys = dict(zip([pool.reset(_row(n)) for n in names], names, strict=True))
        assert all(o.kind == "ok" for o in _collect(pool, set(keys)).values())
        pids: dict[str, set[int]] = {n: set() for n in names}
        order = list(keys)
        for turn in range(4):
            random.Random(turn).shuffle(order)  # each round's calls in another order
            for k in order:
                pool.step(k, f"{keys[k]}t{turn}")
            for k, o in _collect(pool, set(order)).items():
                assert o.kind == "ok", o.error
                n = keys[k]
                assert o.value.observation == f"{n}:" + ",".join(f"{n}t{t}" for t in range(turn + 1))
                assert o.value.reward == turn + 1
                pids[n].add(o.value.info["pid"])
        assert all(len(p) == 1 for p in pids.values())  # every step of an episode in one worker
        assert len(set.union(*pids.values())) == 2  # spread over both
        for k in keys:
            pool.drop(k)
        fresh = pool.reset(_row("x"))  # dropped episodes are forgotten; the pool goes on
        assert _collect(pool, {fresh})[fresh].kind == "ok"
        pool.step(fresh, "y")
        assert _collect(pool, {fresh})[fresh].value.observation == "x:y"
    finally:
        pool.close()


def test_workers_that_cannot_start_stop_the_run_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "parent_only.py"
    path.write_text(
        textwrap.dedent(
            """
            import multiprocessing
            if multiprocessing.current_process().name == "megarl-env":
                raise ImportError("needs a GPU driver")
            class E:
                def reset(self, row): pass
                def step(self, action): return "", 0.0, True, {}
            """
        )
    )
    pool = EnvPool(f"{path}:E", workers=1, timeout_s=5.0)
    try:
        pool.reset(_row("x"))
        with pytest.raises(RolloutError, match="environment workers fail to start .3 in a row.*needs a GPU driver"):
            _collect(pool, {0})
    finally:
        pool.close()


def test_builtins_run_in_process_unless_isolated() -> None:
    envs = start_envs(EnvConfig(fn="calculator"))
    assert isinstance(envs, InlineEnvs)
    key = envs.reset(_row("2+2"))
    envs.step(key, '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    (_, reset), (_, step) = envs.poll([])
    assert reset.kind == "ok" and step.kind == "ok"
    assert step.value.observation == [{"role": "tool", "name": "calculator", "content": "42"}]
    envs.step(12345, "no such episode")
    assert envs.poll([])[0][1].error == "EnvError: no environment for episode 12345 in this process"
    pool = start_envs(EnvConfig(fn="calculator", isolate_builtins=True, workers=1))
    try:
        assert isinstance(pool, EnvPool)
        key = pool.reset(_row("2+2"))
        assert _collect(pool, {key})[key].kind == "ok"
        pool.step(key, "the answer is 4")  # no tool call: the answer, done
        o = _collect(pool, {key})[key]
        assert o.kind == "ok" and o.value.done and o.value.observation == ""
    finally:
        pool.close()
