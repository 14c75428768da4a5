"""Test-only fault injection: SIGKILL a real engine process at a named phase of a real run.

Engine recovery (``Fleet.recover`` / ``Fleet.restart``) is proved by killing engines in
``megarl train`` runs; the moment of death must be exact for the run to be compared with an
uninterrupted one, so the trainer and the fleet call :func:`inject` at each phase boundary.
Without ``MEGARL_FAULT`` in the environment :func:`inject` does nothing.

    MEGARL_FAULT="kill_engine_at=<phase>:version=<V>[:engine=<i>];kill_engine_at=..."

Each entry fires once, on engine ``engine<i>`` (default 0), when weight version ``V`` is at
that phase (step ``s`` samples with version ``s``; its sync pushes version ``s + 1``):

  generate     the /generate request of a generation at version V is in flight to the
               engine: frozen (SIGSTOP), then SIGKILLed after 0.1 s (its prompts go elsewhere)
  logprobs     the trainer computes log-probs of the batch sampled with V (engine idle)
  sync_begin   every engine has opened update V, nothing loaded yet (shm: the load
               request opens the update, so this is just before it)
  sync_load    the load request of update V is in flight to the engine: it is frozen
               (SIGSTOP) so the request is sent but unanswered, then SIGKILLed after 1 s
               (the trainer sees "Connection reset", as from a death mid-load)
  sync_commit  just before the engine's commit of V (engines before it have committed;
               shm with one engine: the load request commits, so just before it)
  integrity    just before the integrity check's /logprobs request at version V

The death is real (SIGKILL of the engine's process); what follows is the ordinary code path.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megarl.fleet.client import EngineClient

log = logging.getLogger("megarl.fleet")

ENV = "MEGARL_FAULT"
PHASES = ("generate", "logprobs", "sync_begin", "sync_load", "sync_commit", "integrity")


@dataclass
class Fault:
    phase: str
    version: int
    engine: int = 0


def parse(spec: str) -> list[Fault]:
    """``MEGARL_FAULT``'s entries; ValueError naming the entry that does not parse."""
    faults = []
    for entry in filter(None, (s.strip() for s in spec.split(";"))):
        fields = dict(kv.split("=", 1) for kv in entry.split(":") if "=" in kv)
        phase = fields.get("kill_engine_at", "")
        if phase not in PHASES or "version" not in fields:
            raise ValueError(
                f"{ENV} entry {entry!r}: expected kill_engine_at=<phase>:version=<V>[:engine=<i>] "
                f"with phase in {list(PHASES)}"
            )
        faults.append(Fault(phase, int(fields["version"]), int(fields.get("engine", 0))))
    return faults


_fired: set[tuple[str, int, int]] = set()
"""Entries already injected in this process (each kills once, not again after the restart)."""


def inject(phase: str, version: int, engines: Sequence[EngineClient]) -> None:
    """SIGKILL the engine among ``engines`` that ``MEGARL_FAULT`` names for (phase, version)."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return
    for f in parse(spec):
        key = (f.phase, f.version, f.engine)
        victim = next((e for e in engines if e.name == f"engine{f.engine}"), None)
        if f.phase != phase or f.version != version or key in _fired or victim is None:
            continue
        if victim.proc is None:
            raise ValueError(f"{ENV}: {victim.name} ({victim.address}) is remote; only local engines can be killed")
        _fired.add(key)
        pid = victim.proc.pid
        log.warning("fault injection: SIGKILL %s (pid %d) at %s of version %d", victim.name, pid, phase, version)
        if phase in ("generate", "sync_load"):
            os.kill(pid, signal.SIGSTOP)  # the request is accepted by the kernel, never answered
            threading.Timer(0.1 if phase == "generate" else 1.0, os.kill, (pid, signal.SIGKILL)).start()
        else:
            victim.proc.kill()
            victim.proc.wait()
