"""Worker processes for reward calls that may hang, crash the interpreter or leak memory.

Each worker is started with multiprocessing's ``spawn`` method: a clean interpreter, so it
inherits no torch threads, gloo sockets or CUDA state from the trainer rank (forking such a
process can deadlock). A worker imports the reward functions once, says it is ready, then
serves one call at a time over its pipe. The parent gives each idle worker a call and waits on
every worker's pipe and process sentinel at once:

* a value or the reward's exception comes back → that call's :class:`Outcome`;
* the call runs past ``timeout_s`` → the worker is killed (SIGKILL) and replaced: ``timeout``;
* the worker dies (``os._exit``, a segfault, the OOM killer) → replaced: ``crash``;
* a worker that served ``max_tasks`` calls is retired and replaced (bounds slow leaks).

Invariant: :meth:`RewardPool.run` returns one outcome per call and never raises for a bad
reward; the step goes on. The one exception: workers that cannot even start (the reward
module fails to import in a fresh interpreter) raise :class:`RolloutError`, since no call
could ever succeed. The timeout clock starts when a call is handed to a ready worker, so a
replacement's start-up is not charged to the next call.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from megarl.errors import RolloutError

log = logging.getLogger("megarl.rewards")

START_TIMEOUT_S = 120.0
"""A worker that has not imported its rewards after this long is replaced (a failed start)."""
MAX_START_FAILURES = 3
"""Consecutive failed starts after which the pool gives up (RolloutError)."""


@dataclass
class Outcome:
    """How one call ended: ``kind`` 'ok' (``value`` set), 'error' (the reward raised),
    'timeout' or 'crash' (``error`` says what happened)."""

    kind: Literal["ok", "error", "timeout", "crash"]
    value: Any = None
    error: str = ""


Loader = Callable[[str], Any]
"""Spec text → what ``invoke`` gets; a module-level function (sent to the worker by name)."""
Invoke = Callable[[Any, Any], Any]
"""(loaded entry, call payload) → picklable result; a module-level function."""


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent dies, even mid-call (no orphaned rewards)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not glibc: the parent's kill on close still applies
        pass


def worker_main(conn: Connection, specs: list[str], loader: Loader, invoke: Invoke, memory_mb: int) -> None:
    """A worker process: load ``specs``, say ready, then serve ``(task id, k, payload)`` calls one
    at a time (also the environment workers', :mod:`megarl.rewards.env_pool`)."""
    # the parent ends its workers; Ctrl-C and SLURM's SIGUSR1 reach the whole process group
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    _die_with_parent()
    try:
        entries = [loader(s) for s in specs]
    except BaseException as e:  # reported to the parent, which decides
        conn.send(("dead", f"{type(e).__name__}: {e}"))
        return
    if memory_mb:
        import resource

        limit = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        task_id, k, payload = msg
        try:
            result = invoke(entries[k], payload)
        except BaseException as e:  # the reward's failure is this call's outcome
            conn.send(("err", task_id, f"{type(e).__name__}: {e}"))
            continue
        try:
            conn.send(("ok", task_id, result))
        except Exception as e:  # unpicklable result: nothing was written yet
            conn.send(("err", task_id, f"result not picklable: {type(e).__name__}: {e}"))


class Worker:
    """One worker process and what its parent knows of it."""

    def __init__(self, proc: Any, conn: Connection) -> None:
        self.proc, self.conn = proc, conn
        self.ready = False
        self.started = time.monotonic()
        self.task: tuple[int, int, float] | None = None
        """(task id, index of the call in the current run, deadline)."""
        self.served = 0
        self.dead_reason = ""
        """What a worker that failed to start reported."""

    def drain(self, answered: Callable[[Outcome], None]) -> bool:
        """Read what the worker sent: ``ready``, ``dead`` (with why), or the answer to its task,
        handed to ``answered`` (the task still set) before the task is cleared. False if it died
        (pipe closed or process gone)."""
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                if msg[0] == "ready":
                    self.ready = True
                elif msg[0] == "dead":
                    self.ready, self.dead_reason = False, msg[1]
                    return False
                elif self.task is not None and msg[1] == self.task[0]:
                    answered(Outcome("ok", value=msg[2]) if msg[0] == "ok" else Outcome("error", error=msg[2]))
                    self.task = None
                    self.served += 1
        except (EOFError, OSError):
            return False
        return bool(self.proc.is_alive())


def kill_all(procs: list[Any]) -> None:
    """SIGKILL whatever of ``procs`` still runs (a pool's finalizer)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


class RewardPool:
    """``workers`` processes serving calls ``(spec index, payload)`` with a per-call timeout."""

    def __init__(
        self,
        specs: list[str],
        loader: Loader,
        invoke: Invoke,
        *,
        workers: int,
        timeout_s: float,
        max_tasks: int = 0,
        memory_mb: int = 0,
    ) -> None:
        self.specs, self.loader, self.invoke = specs, loader, invoke
        self.timeout_s, self.max_tasks, self.memory_mb = timeout_s, max_tasks, memory_mb
        self._ctx = mp.get_context("spawn")
        self._next_task = 0
        self._start_failures = 0
        self.replaced = 0
        """Workers killed or found dead and replaced (timeouts, crashes, failed starts)."""
        self.retired = 0
        """Workers replaced after ``max_tasks`` calls."""
        self._procs: list[Any] = []  # every process started, for the finalizer
        self._workers = [self._spawn() for _ in range(workers)]
        self._finalizer = weakref.finalize(self, kill_all, self._procs)

    def _spawn(self) -> Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=worker_main,
            args=(child, self.specs, self.loader, self.invoke, self.memory_mb),
            name="megarl-reward",
        )
        proc.start()
        child.close()
        self._procs[:] = [p for p in self._procs if p.is_alive()] + [proc]
        return Worker(proc, parent)

    def _replace(self, w: Worker, failure: bool = True) -> Worker:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5)
        w.conn.close()
        if failure:
            self.replaced += 1
        else:
            self.retired += 1
        return self._spawn()

    def run(self, calls: list[tuple[int, Any]]) -> list[Outcome]:
        """One outcome per call ``(index into specs, payload)``, in order."""
        out: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        try:
            while pending or any(w.task is not None for w in self._workers):
                for k, w in enumerate(self._workers):
                    if w.ready and w.task is None and pending:
                        if self.max_tasks and w.served >= self.max_tasks:
                            # retire: a fresh interpreter bounds what the rewards leaked
                            self._workers[k] = self._replace(w, failure=False)
                            continue
                        self._send(w, pending.popleft(), calls, out)
                if any(w.task is not None or not w.ready for w in self._workers):  # else: nothing to wait for
                    self._wait_and_collect(out)
        finally:  # interrupted mid-run: busy workers hold stale calls, replace them
            for k, w in enumerate(self._workers):
                if w.task is not None:
                    self._workers[k] = self._replace(w)
        assert all(o is not None for o in out)
        return [o for o in out if o is not None]

    def _wait_and_collect(self, out: list[Outcome | None]) -> None:
        """Wait for a message, a death or the nearest deadline (some worker is busy or starting)."""
        now = time.monotonic()
        deadlines = [
            w.task[2] if w.task else w.started + START_TIMEOUT_S for w in self._workers if w.task or not w.ready
        ]
        timeout = max(0.0, min(deadlines) - now)
        waitables: list[Any] = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
        wait(waitables, timeout=timeout)
        for k, w in enumerate(self._workers):
            if not self._drain(w, out):
                self._workers[k] = self._dead(w, out)
            elif w.task is not None and time.monotonic() > w.task[2]:
                out[w.task[1]] = Outcome("timeout", error=f"timed out after {self.timeout_s:g}s (worker killed)")
                self._workers[k] = self._replace(w)
            elif not w.ready and time.monotonic() > w.started + START_TIMEOUT_S:
                self._workers[k] = self._failed_start(w, f"not ready after {START_TIMEOUT_S:g}s")

    def _send(self, w: Worker, i: int, calls: list[tuple[int, Any]], out: list[Outcome | None]) -> None:
        self._next_task += 1
        try:
            w.conn.send((self._next_task, *calls[i]))  # pickled whole before anything is written
        except OSError:  # the worker just died: the next wait sees it and reports a crash
            pass
        except Exception as e:  # the payload does not pickle: this call fails, the worker is fine
            out[i] = Outcome("error", error=f"sample not picklable: {type(e).__name__}: {e}")
            return
        w.task = (self._next_task, i, time.monotonic() + self.timeout_s)

    def _drain(self, w: Worker, out: list[Outcome | None]) -> bool:
        """Read what ``w`` sent (:meth:`Worker.drain`); False if it died."""

        def answered(outcome: Outcome) -> None:
            assert w.task is not None
            out[w.task[1]] = outcome

        alive = w.drain(answered)
        if w.ready:
            self._start_failures = 0
        return alive

    def _dead(self, w: Worker, out: list[Outcome | None]) -> Worker:
        w.proc.join(timeout=5)
        code = w.proc.exitcode
        if not w.ready:
            return self._failed_start(w, w.dead_reason or f"exit code {code}")
        if w.task is not None:
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            out[w.task[1]] = Outcome("crash", error=f"reward worker died ({how})")
        return self._replace(w)

    def _failed_start(self, w: Worker, reason: str) -> Worker:
        self._start_failures += 1
        if self._start_failures >= MAX_START_FAILURES:
            raise RolloutError(
                f"reward workers fail to start ({self._start_failures} in a row) loading {self.specs}: {reason}"
            )
        log.warning("reward worker failed to start (%s); starting another", reason)
        return self._replace(w)

    def close(self) -> None:
        """Ask idle workers to exit, then kill whatever is left."""
        for w in self._workers:
            try:
                if w.task is None:
                    w.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()
