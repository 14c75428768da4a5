"""Continuous batching (``/generate`` with ``"join": true``): calls that arrive while others run
join vLLM's running batch, and each call returns as soon as its own requests end.

Why: a multi-turn episode's next turn is ready when its environment answers, at its own time.
Served one whole call at a time, every turn waits for the longest response of the call before
it and the engine idles while environments work (``benchmarks/agent_overlap.py``). Here one
thread (the *stepper*) owns vLLM's step loop: it adds each call's requests as they arrive and
steps the engine while anything runs; a finished request is handed back to its call at once.

Invariants (the engine's, kept here):

* **One weight version per call.** The stepper holds the engine's lock while any request runs,
  so updates, log-prob passes and whole-batch generations wait until the batch is empty. While
  one of them waits (:attr:`EngineLock.waiting`) no *new* call is admitted (a call already
  started is admitted to its end), so the batch drains and they are not starved.
* **Never preempted or chunked.** A request is admitted only when the worst case of every
  running request (each sample to ``max_tokens``) still fits the KV cache and, for seeded
  requests on CPU, when its prompt tokens and sequences fit the step's budget beside the
  running sequences — what :func:`megarl.engine.vllm_engine.waves` ensures for whole calls: a
  preempted or chunked seeded request rewinds a CPU generator, which vLLM's CPU build cannot.
* **The same samples.** Each request keeps its own seed; which requests share a step changes
  the batch's shape (logits may round differently in their last bits), never the seed stream.
* **A failure fails its calls.** An error inside vLLM's step fails every running call and
  aborts their requests; an engine that cannot abort them is marked failed (503 until the
  fleet restarts it), as a whole-batch generation does.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("megarl.engine")


class EngineLock:
    """The engine's lock, which also says how many wait for it (the stepper holds it without
    counting: :meth:`hold`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self.waiting = 0
        """Threads blocked in ``with lock:`` (updates, log-probs, whole-batch generations)."""

    def __enter__(self) -> None:
        with self._count:
            self.waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self.waiting -= 1

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def hold(self) -> threading.Lock:
        """The lock itself, for the stepper (not counted in :attr:`waiting`)."""
        return self._lock


@dataclass
class Call:
    """One joined ``/generate`` call: its requests and, once done, their outputs."""

    prompts: list[Any]
    params: list[Any]
    """vLLM's ``SamplingParams`` per prompt, asking for the final output only (``FINAL_ONLY``)."""
    needs: list[int]
    """KV-cache tokens each prompt may take (its samples, each to ``max_tokens``, in blocks)."""
    tokens: list[int]
    """Prompt tokens each prompt prefills (× its samples)."""
    seqs: int
    """Sequences each prompt runs (its ``n``)."""
    outputs: list[Any] = field(default_factory=list)
    version: int = -1
    """The weight version it ran under (set when its first request is admitted)."""
    admitted: int = 0
    finished: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    engine_s: float = 0.0
    """Seconds from its first admission to its last output."""
    t0: float = 0.0


class Stepper:
    """The engine's continuous batch (module docstring). ``engine`` provides ``llm``,
    ``lock`` (an :class:`EngineLock`), ``version``, ``kv_tokens``, ``cpu_prefill``,
    ``unhealthy()`` and ``abort_all(error)``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._queue: deque[Call] = deque()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.most_running = 0
        """The most requests that ran at once (for the tests: > one call's when calls joined)."""

    def run(self, call: Call) -> Call:
        """Queue ``call`` and wait for it (raises what failed it)."""
        call.outputs = [None] * len(call.prompts)
        with self._cv:
            self._queue.append(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="engine-stepper", daemon=True)
                self._thread.start()
            self._cv.notify()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
            while self.engine.lock.waiting:  # an update (or another exclusive request) goes first
                time.sleep(0.001)
            with self.engine.lock.hold():
                self._drain()

    def _drain(self) -> None:
        """Admit and step until nothing runs (under the engine's lock)."""
        running: dict[str, tuple[Call, int]] = {}
        engine = self.engine.llm.llm_engine
        while True:
            self._admit(running)
            if not running:
                return
            try:
                outputs = engine.step()
            except Exception as error:
                self._fail_running(running, error)
                return
            for out in outputs:
                if not out.finished or out.request_id not in running:
                    continue
                call, i = running.pop(out.request_id)
                call.outputs[i] = out
                call.finished += 1
                if call.finished == len(call.prompts):
                    call.engine_s = time.perf_counter() - call.t0
                    call.done.set()

    def _admit(self, running: dict[str, tuple[Call, int]]) -> None:
        """Add queued requests to ``running`` while they fit (module docstring)."""
        kv = self.engine.kv_tokens
        prefill: tuple[int, int] | None = self.engine.cpu_prefill
        reserved = sum(c.needs[i] for c, i in running.values())  # KV tokens the running requests may take
        seqs = sum(c.seqs for c, _ in running.values())  # sequences they run
        step_tokens = seqs  # each running sequence decodes one token in the next step
        with self._cv:
            while self._queue:
                call = self._queue[0]
                if call.admitted == 0:
                    if self.engine.lock.waiting:
                        break  # drain for whoever waits; a started call is admitted to its end
                    unhealthy = self.engine.unhealthy()
                    if unhealthy is not None:
                        self._queue.popleft()
                        call.error = unhealthy
                        call.done.set()
                        continue
                    call.version, call.t0 = self.engine.version, time.perf_counter()
                i = call.admitted
                fits = reserved + call.needs[i] <= kv
                if prefill is not None:
                    fits = fits and step_tokens + call.tokens[i] <= prefill[0] and seqs + call.seqs <= prefill[1]
                if running and not fits:
                    break  # it waits for running requests to end (an empty batch takes anything waves() allows)
                rid = f"j{next(self._ids)}"
                try:
                    self.engine.llm.llm_engine.add_request(rid, call.prompts[i], call.params[i])
                except Exception as error:  # a request vLLM refuses fails its call, not the batch
                    self._queue.popleft()
                    self._abort([r for r, (c, _) in running.items() if c is call], running)
                    call.error = error
                    call.done.set()
                    continue
                running[rid] = (call, i)
                reserved, seqs, step_tokens = reserved + call.needs[i], seqs + call.seqs, step_tokens + call.tokens[i]
                self.most_running = max(self.most_running, len(running))
                call.admitted += 1
                if call.admitted == len(call.prompts):
                    self._queue.popleft()

    def _abort(self, ids: list[str], running: dict[str, tuple[Call, int]]) -> None:
        if ids:
            self.engine.llm.llm_engine.abort_request(ids)
        for rid in ids:
            running.pop(rid, None)

    def _fail_running(self, running: dict[str, tuple[Call, int]], error: Exception) -> None:
        """vLLM's step raised: every running call fails with it; their requests are aborted, and
        an engine that still holds some is marked failed."""
        self.engine.abort_all(error)
        for call in {id(c): c for c, _ in running.values()}.values():
            call.error = error
            call.done.set()
        with self._cv:  # the rest of a started call cannot run under its version any more
            for call in [c for c in self._queue if c.admitted]:
                self._queue.remove(call)
                call.error = error
                call.done.set()
        running.clear()
