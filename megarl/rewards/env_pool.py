"""Where episodes' environments live: worker processes (:class:`EnvPool`), or this process for
the trusted built-ins (:class:`InlineEnvs`); both behind one asynchronous interface, :class:`Envs`.

An episode's environment is one instance, made by its ``reset`` and used by every ``step`` after
it, so calls are **sticky**: ``reset`` places the instance in the worker holding the fewest
episodes (ties: the lowest worker), and each later call of that episode goes to that worker's
queue. A worker serves one call at a time (:func:`megarl.rewards.pool.worker_main`, the reward
workers' loop: spawned clean, a ready handshake, SIGKILLed when its parent dies); calls run
concurrently across workers. The caller submits calls and :meth:`Envs.poll` returns outcomes
as they finish, so environments work while the fleet generates (``megarl.rollout.episodes``).

How a call ends (:class:`megarl.rewards.pool.Outcome`): ``ok`` (the first observation or a
checked :class:`megarl.rewards.env.Step`, validated in the worker); ``error`` (the method raised
or returned something unusable); ``timeout`` (past ``env.timeout_s``, counted from the moment
the call reached a ready worker: the worker is killed and replaced); ``crash`` (the worker died).
A worker that dies, however, loses every instance it held: each of those episodes ends with a
``crash`` outcome, at once if it has a call queued there, else at its next call. An episode's
``reset`` still queued on a dead worker just waits for its replacement.

Invariants: every submitted ``reset``/``step`` gets exactly one outcome; ``poll`` never raises
for a bad environment. The one exception: workers that cannot start at all (the environment's
module fails to import in a fresh interpreter) raise :class:`RolloutError`. Not here: turn
limits, rendering and rewards (``megarl.rollout.episodes``); recycling workers after N calls
(a worker holds live instances, so it is only replaced when it fails).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Literal, Protocol

from megarl.config import EnvConfig
from megarl.errors import RolloutError
from megarl.rewards.env import EnvError, as_observation, as_step, resolve
from megarl.rewards.env_spec import import_env
from megarl.rewards.pool import MAX_START_FAILURES, START_TIMEOUT_S, Outcome, Worker, kill_all, worker_main
from megarl.rewards.specs import absolute_spec
from megarl.rewards.tool_env import ENVS

log = logging.getLogger("megarl.rewards")

Call = tuple[str, int, Any]
"""(``reset`` | ``step`` | ``drop``, the episode's key, the data row or the turn's text)."""


class Envs(Protocol):
    """Episodes' environments, called asynchronously (module docstring)."""

    def reset(self, row: dict[str, Any]) -> int:
        """Make an episode's environment and reset it on ``row``; returns the episode's key."""
        ...

    def step(self, key: int, action: str) -> None:
        """Step episode ``key``'s environment on its turn's text."""
        ...

    def drop(self, key: int) -> None:
        """Forget episode ``key``'s environment (it ended); no outcome."""
        ...

    def poll(self, wake: list[Any]) -> list[tuple[int, Outcome]]:
        """Outcomes of finished calls (episode key, outcome); waits for at least one, or for a
        ``wake`` waitable (a file descriptor) to be readable, or returns [] when nothing is pending."""
        ...

    def abandon(self) -> None:
        """Forget every call and instance (a round that ended in an exception)."""
        ...

    def close(self) -> None: ...


class EnvHost:
    """One process's environments: the class, and the instance of each episode it holds."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.instances: dict[int, Any] = {}

    def __call__(self, call: Call) -> Any:
        op, key, arg = call
        if op == "reset":
            env = self.cls()
            first = as_observation(resolve(env.reset(arg)), "reset()")
            self.instances[key] = env
            return first
        if op == "drop":
            self.instances.pop(key, None)
            return None
        if key not in self.instances:  # (the parent routes a step only where its reset succeeded)
            raise EnvError(f"no environment for episode {key} in this process")
        return as_step(resolve(self.instances[key].step(arg)))


def load_host(spec: str) -> EnvHost:
    """A worker's host for ``spec`` (module-level: sent to the worker by name)."""
    return EnvHost(import_env(spec))


def call_host(host: EnvHost, call: Call) -> Any:
    return host(call)


def start_envs(cfg: EnvConfig) -> Envs:
    """Rank 0's environments for ``env.fn``: a built-in in-process (unless ``env.isolate_builtins``),
    anything else in ``env.workers`` worker processes (started now; they import it meanwhile)."""
    if cfg.fn in ENVS and not cfg.isolate_builtins:
        return InlineEnvs(ENVS[cfg.fn])
    return EnvPool(cfg.fn, workers=cfg.workers, timeout_s=cfg.timeout_s)


class InlineEnvs:
    """The built-in environments in this process: trusted and cheap, each call runs when it is made
    (an exception is its episode's ``error``; no timeout)."""

    def __init__(self, cls: type) -> None:
        self.host = EnvHost(cls)
        self._keys = itertools.count()
        self._done: list[tuple[int, Outcome]] = []

    def _run(self, call: Call) -> None:
        try:
            self._done.append((call[1], Outcome("ok", value=self.host(call))))
        except Exception as e:  # the episode's failure, counted by the caller
            self._done.append((call[1], Outcome("error", error=f"{type(e).__name__}: {e}")))

    def reset(self, row: dict[str, Any]) -> int:
        key = next(self._keys)
        self._run(("reset", key, row))
        return key

    def step(self, key: int, action: str) -> None:
        self._run(("step", key, action))

    def drop(self, key: int) -> None:
        self.host(("drop", key, None))

    def poll(self, wake: list[Any]) -> list[tuple[int, Outcome]]:
        if not self._done and wake:
            wait(wake)
        out, self._done = self._done, []
        return out

    def abandon(self) -> None:
        self.host.instances.clear()
        self._done.clear()

    def close(self) -> None:
        self.abandon()


@dataclass
class _Slot:
    """A worker and the episodes it serves."""

    worker: Worker
    queue: deque[Call] = field(default_factory=deque)
    held: set[int] = field(default_factory=set)
    """Episodes whose instance lives here, or whose reset is queued or running here."""
    call: Call | None = None
    """The call running now."""


class EnvPool:
    """``workers`` processes holding episodes' environments, with a per-call timeout (module docstring)."""

    def __init__(self, spec: str, *, workers: int, timeout_s: float) -> None:
        self.spec, self.timeout_s = absolute_spec(spec), timeout_s
        self._ctx = mp.get_context("spawn")
        self._keys = itertools.count()
        self._next_task = 0
        self._start_failures = 0
        self.replaced = 0
        """Workers killed or found dead and replaced (timeouts, crashes, failed starts)."""
        self._procs: list[Any] = []  # every process started, for the finalizer
        self._slots = [_Slot(self._spawn()) for _ in range(workers)]
        self._home: dict[int, int] = {}  # episode key -> slot index
        self._lost: dict[int, Outcome] = {}  # episodes whose worker died while they waited elsewhere
        self._done: list[tuple[int, Outcome]] = []
        self._finalizer = weakref.finalize(self, kill_all, self._procs)

    def _spawn(self) -> Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=worker_main, args=(child, [self.spec], load_host, call_host, 0), name="megarl-env"
        )
        proc.start()
        child.close()
        self._procs[:] = [p for p in self._procs if p.is_alive()] + [proc]
        return Worker(proc, parent)

    # ------------------------------------------------------------------ calls

    def reset(self, row: dict[str, Any]) -> int:
        key = next(self._keys)
        k = min(range(len(self._slots)), key=lambda i: (len(self._slots[i].held), i))
        self._home[key] = k
        self._slots[k].held.add(key)
        self._slots[k].queue.append(("reset", key, row))
        return key

    def step(self, key: int, action: str) -> None:
        if key in self._lost:
            self._done.append((key, self._lost.pop(key)))
            return
        self._slots[self._home[key]].queue.append(("step", key, action))

    def drop(self, key: int) -> None:
        self._lost.pop(key, None)
        k = self._home.pop(key, None)
        if k is not None and key in self._slots[k].held:
            self._slots[k].held.discard(key)
            self._slots[k].queue.append(("drop", key, None))

    def poll(self, wake: list[Any]) -> list[tuple[int, Outcome]]:
        self._dispatch()
        if not self._done and (wake or self._pending()):
            now = time.monotonic()
            deadlines = [
                s.worker.task[2] if s.worker.task else s.worker.started + START_TIMEOUT_S
                for s in self._slots
                if s.worker.task or (not s.worker.ready and s.queue)
            ]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            waitables = [s.worker.conn for s in self._slots] + [s.worker.proc.sentinel for s in self._slots]
            wait(waitables + wake, timeout=timeout)
            self._collect()
            self._dispatch()
        out, self._done = self._done, []
        return out

    def _pending(self) -> bool:
        return any(s.call is not None or s.queue for s in self._slots)

    def _dispatch(self) -> None:
        for s in self._slots:
            w = s.worker
            while w.ready and s.call is None and s.queue:
                call = s.queue.popleft()
                self._next_task += 1
                try:
                    w.conn.send((self._next_task, 0, call))  # pickled whole before anything is written
                except OSError:  # the worker just died: the next wait sees it
                    pass
                except Exception as e:  # the row does not pickle: this call fails, the worker is fine
                    if call[0] != "drop":
                        self._done.append((call[1], Outcome("error", error=f"not picklable: {type(e).__name__}: {e}")))
                    continue
                s.call, w.task = call, (self._next_task, call[1], time.monotonic() + self.timeout_s)

    def _collect(self) -> None:
        for k, s in enumerate(self._slots):
            w = s.worker
            if not self._drain(s):
                w.proc.join(timeout=5)
                code = w.proc.exitcode
                if not w.ready:
                    self._failed_start(k, w.dead_reason or f"exit code {code}")
                    continue
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                self._lose(k, "crash", f"environment worker died ({how})")
            elif s.call is not None and w.task is not None and time.monotonic() > w.task[2]:
                self._lose(k, "timeout", f"timed out after {self.timeout_s:g}s (worker killed)")
            elif not w.ready and s.queue and time.monotonic() > w.started + START_TIMEOUT_S:
                self._failed_start(k, f"not ready after {START_TIMEOUT_S:g}s")

    def _drain(self, s: _Slot) -> bool:
        """Read what ``s``'s worker sent (:meth:`Worker.drain`); False if it died."""

        def answered(outcome: Outcome) -> None:
            if s.call is None:
                return
            op, key, _ = s.call
            s.call = None
            if op == "reset" and outcome.kind != "ok":
                s.held.discard(key)  # (the instance was not kept)
            if op != "drop":
                self._done.append((key, outcome))

        alive = s.worker.drain(answered)
        if s.worker.ready:
            self._start_failures = 0
        return alive

    def _lose(self, k: int, kind: Literal["timeout", "crash"], why: str) -> None:
        """Slot ``k``'s worker is dead or hangs: its running call ends as ``kind``, every episode it
        held ends as a crash (now, or at its next call), and a fresh worker takes its place."""
        s = self._slots[k]
        running = s.call
        if running is not None and running[0] != "drop":
            self._done.append((running[1], Outcome(kind, error=why)))
        cause = f"episode {running[1]}'s call" if running is not None else "no call"
        lost = Outcome("crash", error=f"its environment worker was lost ({why}, during {cause})")
        resets = [c for c in s.queue if c[0] == "reset"]  # not started: the replacement takes them
        queued = {c[1] for c in s.queue if c[0] == "step"}
        for key in sorted(s.held - {c[1] for c in resets}):
            if running is not None and key == running[1]:
                continue
            self._home.pop(key, None)
            if key in queued:
                self._done.append((key, lost))
            else:
                self._lost[key] = lost
        s.held = {c[1] for c in resets}
        s.queue = deque(resets)
        s.call = None
        if running is not None:
            self._home.pop(running[1], None)
        self._replace(k)
        self.replaced += 1

    def _replace(self, k: int) -> None:
        w = self._slots[k].worker
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5)
        w.conn.close()
        self._slots[k].worker = self._spawn()

    def _failed_start(self, k: int, reason: str) -> None:
        self._start_failures += 1
        if self._start_failures >= MAX_START_FAILURES:
            raise RolloutError(
                f"environment workers fail to start ({self._start_failures} in a row) loading {self.spec}: {reason}"
            )
        log.warning("environment worker failed to start (%s); starting another", reason)
        self._replace(k)
        self.replaced += 1

    def abandon(self) -> None:
        for k, s in enumerate(self._slots):
            if s.call is not None or s.held:  # stale replies or instances: a fresh interpreter
                self._replace(k)
            self._slots[k] = _Slot(self._slots[k].worker)
        self._home.clear()
        self._lost.clear()
        self._done.clear()

    def close(self) -> None:
        """Ask idle workers to exit, then kill whatever is left."""
        for s in self._slots:
            try:
                if s.call is None:
                    s.worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for s in self._slots:
            s.worker.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()
