"""The generation fleet: N vLLM engine servers (local subprocesses or remote addresses).

The trainer's rank 0 owns the fleet. Prompts are dispatched to balance outstanding tokens
across engines (not round-robin); each engine's share is sent concurrently. If an engine
dies mid-generation, its prompts are re-issued to the surviving engines (or to the engine
after it is restarted and given the current weights), so a step always completes with the
planned number of samples; the event is logged and counted in ``fleet.restarts``.

Engines can die at any other moment too. One found dead before a generation or an update
(``recover``: process exited, or silent on /health when it has not answered for ``fresh_s``)
is restarted first. During an update (begin / load / commit) a connection-level failure
(``EngineDead``) does not fail the update: the engine is marked down, the others carry on,
and when the update commits the dead ones are restarted and replay *that* version (or, if
the update was rejected, the previous one); then every engine must report the same version.
A rejection (engine alive, says no) still aborts everywhere and raises ``WeightSyncError``.
Remote engines (no launch command) cannot be restarted: their death is an error naming the
engine and its address.

Weight updates (``megarl.fleet.updates``) follow the weight-update protocol
(``megarl.fleet.protocol``): begin → load (all engines) → commit (all engines), all or
nothing; from safetensors files (shm) the load request also opens the update, and with one
engine it commits too (one round trip instead of three). A restarted engine is brought to
the committed weights by the replay recorded with that update.

Starting, attaching, health waits, the lease heartbeat and shutdown are
``megarl.fleet.lifecycle``; restarts are ``megarl.fleet.restarts``. The class is built up in
that order: ``EngineProcesses`` → ``Restarts`` → ``WeightUpdates`` → ``Fleet`` (generation,
integrity log-probs, colocation).

Colocated runs (``rollout.colocate``) put the engines to sleep while the trainer uses the
GPUs and wake them in two steps around a sync (``sleep`` / ``wake_up``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from megarl.engine import routes
from megarl.errors import EngineDead, RolloutError
from megarl.fleet import faults
from megarl.fleet.client import EngineClient
from megarl.fleet.updates import WeightUpdates, concurrently

log = logging.getLogger("megarl.fleet")


class Fleet(WeightUpdates):
    """The engines a run generates with (module docstring)."""

    def __init__(self, engines: list[EngineClient], request_timeout_s: float, start_timeout_s: float) -> None:
        super().__init__(engines, request_timeout_s, start_timeout_s)
        self.reissued_prompts = 0
        self.timings: dict[str, float] = {}
        """Seconds of the generations since :meth:`pop_timings` (see there)."""
        self._calls = threading.RLock()
        """Taken by a generation around recovery and its counts: joined calls run concurrently."""
        self._in_flight, self._busy_since = 0, 0.0
        """Generations under way, and since when one has been (``fleet/generate_s`` is the wall
        time with at least one under way: concurrent calls are not counted twice)."""

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        seeds: list[int | None] | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        logprobs: bool = True,
        prefer: list[str | None] | None = None,
        join: bool = False,
    ) -> tuple[list[list[dict[str, Any]]], int]:
        """Sample ``n`` responses per prompt. Returns (outputs per prompt, min policy version);
        each sample's ``"logprobs"`` are the sampled tokens' (empty when ``logprobs`` is False)
        and its ``"engine"`` the name of the engine that generated it. ``prefer``: per prompt,
        the engine to send it to when that engine serves (an episode's earlier turns are in its
        prefix cache); the others are balanced around them.

        ``join``: the engines run the call in their continuous batch (``megarl.engine.stepper``)
        beside the joined calls already running, and it returns when its own requests end. Joined
        calls may come from several threads at once (multi-turn episodes: each turn as its
        environment answers); recovery from a dead engine is then done once, by the first call
        that finds it dead, and the others re-issue their prompts to the engines serving."""
        seeds = seeds or [None] * len(prompts)  # None: the engine's own RNG
        prefer = prefer or [None] * len(prompts)
        with self._busy():
            return self._generate(prompts, n, max_tokens, temperature, top_p, stop_token_ids, seeds, ignore_eos,
                                  min_tokens, logprobs, prefer, join)  # fmt: skip

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Around a generation: ``fleet/generate_s`` counts the time with at least one under way."""
        with self._calls:
            self._in_flight += 1
            if self._in_flight == 1:
                self._busy_since = time.perf_counter()
        try:
            yield
        finally:
            with self._calls:
                self._in_flight -= 1
                if not self._in_flight:
                    self._count("generate_s", time.perf_counter() - self._busy_since)

    def _generate(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, top_p: float,
                  stop_token_ids: list[int], seeds: list[int | None], ignore_eos: bool, min_tokens: int,
                  logprobs: bool, prefer: list[str | None], join: bool) -> tuple[list[list[dict[str, Any]]], int]:  # fmt: skip
        with self._calls:
            self.recover()  # an engine that died while idle is restarted before it is given prompts
        results: list[list[dict[str, Any]] | None] = [None] * len(prompts)
        versions: list[int] = []
        todo = list(range(len(prompts)))
        while todo:
            with self._calls:
                live = [e for e in self.serving() if e.alive()]
                if not live:
                    self.recover()
                    live = [e for e in self.serving() if e.alive()]
            if not live:
                raise RolloutError("no live engine in the fleet")
            shares = [(e, i) for e, i in self._balance(todo, prompts, n, max_tokens, live, prefer) if i]
            processes = {e.name: e.proc for e, _ in shares}
            faults.inject("generate", self.version, [e for e, _ in shares])
            failed: list[int] = []

            def run(engine: EngineClient, idx: list[int]) -> tuple[EngineClient, list[int], Any]:
                body = {
                    "prompts": [prompts[i] for i in idx],
                    "n": n,
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "top_p": top_p,
                    "stop_token_ids": stop_token_ids,
                    "seeds": [seeds[i] for i in idx],
                    "ignore_eos": ignore_eos,
                    "min_tokens": min_tokens,
                    "logprobs": logprobs,
                }
                if join:
                    body["join"] = True
                try:
                    return engine, idx, engine.generate(body, self.timeout)
                except EngineDead as err:
                    return engine, idx, err

            dead = []
            for engine, idx, out in concurrently(lambda kv: run(*kv), shares):
                if isinstance(out, Exception):
                    log.warning("%s died mid-generation (%s); re-issuing %d prompts", engine.name, out, len(idx))
                    failed.extend(idx)
                    dead.append(engine)
                    continue
                version, groups, timings = out
                versions.append(version)
                for i, group in zip(idx, groups):
                    for sample in group:
                        sample["engine"] = engine.name
                    results[i] = group
                if not join:  # (joined calls overlap in the engine: their seconds do not add up)
                    with self._calls:
                        self._count("engine_s", timings.get("engine_s", 0.0), engine.name)
                        self._count("model_s", timings.get("model_s", 0.0), engine.name)
            with self._calls:
                self.reissued_prompts += len(failed)
                # (a concurrent call may have restarted it already, or be restarting it)
                self.lost([e for e in dead if e.proc is processes[e.name] and e.name not in self.restarting])
            todo = sorted(failed)  # the same seeds on another engine: the same samples
        return [r for r in results if r is not None], min(versions) if versions else -1

    def _count(self, key: str, seconds: float, engine: str = "") -> None:
        key = f"{key}/{engine}" if engine else key
        self.timings[key] = self.timings.get(key, 0.0) + seconds

    def pop_timings(self) -> dict[str, float]:
        """Metrics of the generations since the last call, then reset: ``fleet/generate_s`` (the
        fleet's wall time, requests included), ``fleet/engine_s`` (inside vLLM's generate, the
        slowest engine) and ``fleet/model_s`` (its model forward; engines started with
        MEGARL_ENGINE_TIME_MODEL=1, else 0)."""
        t, self.timings = self.timings, {}
        out = {"fleet/generate_s": t.get("generate_s", 0.0)}
        for key in ("engine_s", "model_s"):
            out[f"fleet/{key}"] = max([v for k, v in t.items() if k.startswith(key + "/")], default=0.0)
        return out

    @staticmethod
    def _balance(
        todo: list[int],
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        engines: list[EngineClient],
        prefer: list[str | None],
    ) -> list[tuple[EngineClient, list[int]]]:
        """Prompts with a preferred engine among ``engines`` go to it; the rest by greedy
        longest-first assignment of outstanding tokens (prompt + n × max response)."""
        load = {e.name: 0 for e in engines}
        shares: dict[str, list[int]] = {e.name: [] for e in engines}
        free = []
        for i in todo:
            pinned = prefer[i]
            if pinned is not None and pinned in shares:
                shares[pinned].append(i)
                load[pinned] += len(prompts[i]) + n * max_tokens
            else:
                free.append(i)
        for i in sorted(free, key=lambda j: -len(prompts[j])):
            target = min(engines, key=lambda e: load[e.name])
            shares[target.name].append(i)
            load[target.name] += len(prompts[i]) + n * max_tokens
        return [(e, sorted(shares[e.name])) for e in engines]

    def logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[list[float]]]:
        """Prompt log-probs of each sequence on every engine (integrity check); an engine
        that died is restarted at the current version and asked again (bounded)."""
        faults.inject("integrity", self.version, self.serving())
        body = {"sequences": sequences, "temperature": temperature}
        out = []
        for e in self.serving():
            for attempt in range(3):
                try:
                    out.append(e.post(routes.LOGPROBS, body, self.timeout)["logprobs"])
                    break
                except EngineDead as err:
                    if attempt == 2:
                        raise
                    log.warning("%s died before the integrity check (%s); restarting it", e.name, err)
                    self.lost([e])
                    if e.name in self.restarting:
                        break  # checked at the first sync after it serves again
        return out

    # ------------------------------------------------------------------ colocation

    def sleep(self, level: int = 1) -> None:
        """Free the engines' GPU memory for the trainer (vLLM sleep mode, level 1)."""
        self._post_each(routes.SLEEP, {"level": level})

    def wake_up(self, tags: list[str]) -> None:
        """Re-allocate ``weights`` (before a sync) or ``kv_cache`` (after it)."""
        self._post_each(routes.WAKE_UP, {"tags": tags})

    def _post_each(self, path: str, body: dict[str, Any]) -> None:
        concurrently(lambda e: e.post(path, body, self.timeout), self.members())

    def versions(self) -> list[int]:
        return [int((e.health() or {}).get("version", -2)) for e in self.engines]
