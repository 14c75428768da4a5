"""How the fleet brings dead engines back (a base of :class:`megarl.fleet.fleet.Fleet`).

An engine is in one of three states::

    serving ──dies──► restarting ──answers /health──► joining ──commits an update──► serving
                      (its own thread)                (in the next weight update,
                                                       given no prompts until then)

**In the background** (``restart_in_background``, with a transport that sends whole weights at
every update): when one engine of several dies, the survivors keep generating — its prompts
go to them with the same per-prompt seeds, so every sample is the one it would have been —
while a thread respawns it (at nice 19, so that on a shared CPU the restart takes what the
step leaves idle; latency-bound collectives of a trainer that fills every core still slow, up
to ~2x on 2 cores: benchmarks/restart_contention.py) and waits until it answers. It then
*joins* the next weight update like any other engine and serves from the version that update
commits: no replay, no step waiting for it. Only when no serving engine is left does a step
wait: a joining engine is given the current weights at once (the replay of the last committed
update, ``Committed.replay``), and an engine still restarting is waited for.

**Blocking** (``restart_in_background`` False, a fleet of one, or a transport that cannot
bring a joining engine up to date): the dead engine is restarted and replayed before the
fleet does anything else (the step waits; remote engines cannot be restarted at all).

A restarted engine serves once it reports the committed version (:meth:`_at_committed`).
Every spawn counts in ``restarts``; every engine that comes back into service in ``rejoins``
(the publisher checks the fleet's integrity at the first sync after one). An engine that
dies again while it starts is spawned again, up to ``attempts`` times; the error then quotes
what *that* process wrote to the engine's log (all starts append to one file), or says it
wrote nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from megarl.errors import EngineDead, RolloutError
from megarl.fleet.client import EngineClient
from megarl.fleet.lifecycle import EngineProcesses
from megarl.fleet.protocol import Committed

log = logging.getLogger("megarl.fleet")

RESTART_NICE = 19
"""CPU niceness of an engine restarting in the background (back to the fleet's once it serves)."""


@dataclass
class _Restart:
    """One engine's restart in the background."""

    done: threading.Event = field(default_factory=threading.Event)
    error: RolloutError | None = None


def _renice(pid: int, nice: int) -> None:
    """Set the CPU niceness of ``pid``: of its autogroup, where the kernel groups by session
    (an engine runs in a session of its own, and between autogroups only the group's niceness
    counts), and of each of its threads (Linux niceness is per thread). Raising it back needs
    privilege; without it the engine keeps the low priority (one debug line)."""
    group = Path(f"/proc/{pid}/autogroup")
    try:
        if group.exists():
            group.write_text(f"{nice}\n")
    except OSError as e:
        log.debug("autogroup nice of %d to %d: %s", pid, nice, e)
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [pid]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (PermissionError, ProcessLookupError) as e:
            log.debug("renice %d (thread of %d) to %d: %s", tid, pid, nice, e)


class Restarts(EngineProcesses):
    def __init__(self, engines: list[EngineClient], request_timeout_s: float, start_timeout_s: float) -> None:
        super().__init__(engines, request_timeout_s, start_timeout_s)
        self.last_commit = Committed(-1)
        """The last committed update: the version the engines serve and its replay."""
        self.down: set[str] = set()
        """Engines that failed at the connection level during the current update."""
        self.fresh_s = 5.0
        """Seconds an engine's last answer vouches for it (:meth:`recover` skips its /health)."""
        self.restarts = 0
        """Engine processes spawned again after a death."""
        self.rejoins = 0
        """Restarted engines that came back into service."""
        self.restart_in_background = False
        """Restart a dead engine in the background while the others serve (module docstring)."""
        self.restarting: dict[str, _Restart] = {}
        self.joining: set[str] = set()
        self._nice = os.getpriority(os.PRIO_PROCESS, 0)
        self._restarts_lock = threading.Lock()
        self._closing = False  # set by shutdown: no more spawns

    @property
    def version(self) -> int:
        """Version of the last committed update (-1: none yet): what a serving engine serves."""
        return self.last_commit.version

    # ------------------------------------------------------------------ states

    def members(self) -> list[EngineClient]:
        """Engines a weight update goes to: serving and joining (not those restarting)."""
        return [e for e in self.engines if e.name not in self.restarting]

    def serving(self) -> list[EngineClient]:
        """Engines given prompts: those that serve the fleet's current weights."""
        return [e for e in self.members() if e.name not in self.joining]

    def committed(self, e: EngineClient, version: int) -> None:
        """``e`` applied update ``version``: a joining engine serves from now on."""
        if e.name in self.joining:
            self.joining.discard(e.name)
            self._in_service(e, version)

    def _in_service(self, e: EngineClient, version: int) -> None:
        self.rejoins += 1
        if e.proc is not None and self._nice != RESTART_NICE:
            _renice(e.proc.pid, self._nice)
        log.warning("%s serves again at version %d (restart #%d)", e.name, version, self.restarts)

    def _at_committed(self, e: EngineClient) -> tuple[bool, object]:
        """After a replay: whether ``e`` lives and serves the committed version (and what it
        says it serves)."""
        served = (e.health(timeout=30) or {}).get("version")
        return e.name not in self.down and served == self.version, served

    # ------------------------------------------------------------------ processes

    def _respawn(self, e: EngineClient, nice: int | None = None) -> None:
        """Kill what is left of ``e``'s process and start a new one (counted in ``restarts``)."""
        if e.proc is not None and e.proc.poll() is None:
            e.proc.kill()
            e.proc.wait()
        with self._restarts_lock:  # (shutdown sets _closing under it: no spawn after it)
            if self._closing:
                raise RolloutError(f"engine {e.name}: the fleet is shutting down")
            self._spawn(e)
            if nice is not None and e.proc is not None:
                _renice(e.proc.pid, nice)
            self.restarts += 1

    def stop_restarts(self) -> None:
        """No engine is spawned from now on (the fleet shuts down; restarts under way end)."""
        with self._restarts_lock:
            self._closing = True

    def shutdown(self) -> None:
        """No more restarts, then the engines stop (:meth:`EngineProcesses.shutdown`)."""
        self.stop_restarts()
        super().shutdown()

    def _start_again(self, e: EngineClient, attempts: int, nice: int | None = None) -> None:
        """Respawn ``e`` until it answers /health; it may die again while it starts."""
        for attempt in range(1, attempts + 1):
            self._respawn(e, nice)
            try:
                self.wait_healthy([e])
                return
            except RolloutError as err:  # EngineDead included
                if e.alive() and not isinstance(err, EngineDead):
                    raise
                log.warning("%s died again while restarting (attempt %d): %s", e.name, attempt, err)
        raise RolloutError(
            f"engine {e.name} ({e.address}) could not be restarted in {attempts} attempts; {e.last_words()}"
        )

    def restart(self, e: EngineClient, attempts: int = 3) -> None:
        """Restart ``e`` now and bring it to the fleet's current weights (the replay); the
        caller waits. A replay rejected by the live engine raises WeightSyncError."""
        if not e.launch:
            raise RolloutError(
                f"engine {e.name} ({e.address}) is down and remote (started outside megarl): cannot restart it"
            )
        for attempt in range(1, attempts + 1):
            self._respawn(e)
            self.down.discard(e.name)
            try:
                self.wait_healthy([e])
                if self.last_commit.replay is not None:
                    self.last_commit.replay([e])
            except RolloutError as err:  # EngineDead included: e.g. a request to a process that just died
                if e.alive() and not isinstance(err, EngineDead):
                    raise
                log.warning("%s died again while restarting (attempt %d): %s", e.name, attempt, err)
                continue
            current, served = self._at_committed(e)
            if current:
                self.joining.discard(e.name)
                self._in_service(e, self.version)
                return
            log.warning(
                "%s not at version %d after restart attempt %d (serves %s)", e.name, self.version, attempt, served
            )
        raise RolloutError(
            f"engine {e.name} ({e.address}) could not be restarted at version {self.version} in {attempts} "
            f"attempts; {e.last_words()}"
        )

    def restart_later(self, e: EngineClient, attempts: int = 3) -> None:
        """Restart ``e`` in its own thread; it joins the next update (module docstring)."""
        job = _Restart()
        self.restarting[e.name] = job
        self.joining.discard(e.name)
        self.down.discard(e.name)

        def run() -> None:
            try:
                self._start_again(e, attempts, nice=RESTART_NICE)
            except RolloutError as err:
                job.error = err
            finally:
                job.done.set()

        log.warning("%s is down; restarting it in the background (the others keep serving)", e.name)
        threading.Thread(target=run, name=f"restart-{e.name}", daemon=True).start()

    def lost(self, dead: list[EngineClient]) -> None:
        """Bring back engines found dead: in the background while another engine still serves
        (and the fleet may), else now."""
        if not dead:
            return
        names = {e.name for e in dead}
        survivors = [e for e in self.serving() if e.name not in names and e.alive()]
        if not survivors and self.restart_in_background and (self.joining or self.restarting):
            back = self._rescue()  # an engine about to join takes the current weights now: the quickest way
            dead = [e for e in dead if e.name not in back]
            survivors = [e for e in self.serving() if e.name not in names and e.alive()]
        for e in dead:
            if survivors and self.restart_in_background and e.launch:
                self.restart_later(e)
            else:
                log.warning("%s (%s) is down; restarting it", e.name, e.address)
                self.restart(e)

    def _collect(self, wait: bool = False) -> None:
        """Restarts that finished become joining engines; one that failed raises its error."""
        for name, job in list(self.restarting.items()):
            if wait:
                job.done.wait()
            if not job.done.is_set():
                continue
            del self.restarting[name]
            if job.error is not None:
                raise job.error
            self.joining.add(name)
            log.warning("%s restarted; it joins the next weight update", name)

    def recover(self) -> None:
        """Bring back every engine that is down (marked during an update, exited, or silent on
        /health) and check that the serving engines agree on the weight version.

        An engine whose process lives and that answered a request less than ``fresh_s`` ago
        is not pinged (it just proved it serves, and named its version): a steady step pays
        no health round trips. Any other is asked /health."""
        if self._starting:  # engines still loading are not dead: wait for them first
            self.ready()
        self._collect()
        now = time.monotonic()
        dead = []
        for e in self.members():
            fresh = e.alive() and now - e.answered_at < self.fresh_s and e.served_version is not None
            if e.name in self.down or not e.alive() or (not fresh and e.health(timeout=30) is None):
                dead.append(e)
        self.lost(dead)
        self.down.clear()
        if not self.serving():
            self._rescue()
        served = [e.served_version if e.served_version is not None else -2 for e in self.serving()]
        if len(set(served)) > 1:  # (not checked against self.version: another client may have updated them)
            have = ", ".join(f"{e.name}={v}" for e, v in zip(self.serving(), served))
            raise RolloutError(f"engines disagree on the weight version after recovery: {have}")

    def _rescue(self) -> set[str]:
        """No engine serves: wait for the restarts under way, then give the current weights to
        the engines waiting to join (they would otherwise wait for the next update). Returns
        the names of the engines it brought into service."""
        self._collect(wait=True)
        back = set()
        for e in [e for e in self.engines if e.name in self.joining]:
            back.add(e.name)
            if not e.alive():
                self.joining.discard(e.name)
                self.restart(e)  # (replays too)
                continue
            try:
                if self.last_commit.replay is not None:
                    self.last_commit.replay([e])
            except EngineDead:
                pass
            if not self._at_committed(e)[0]:  # it died meanwhile: now it waits
                self.joining.discard(e.name)
                self.restart(e)
                continue
            self.committed(e, self.version)  # (a no-op when the replay's commit already said so)
        return back
