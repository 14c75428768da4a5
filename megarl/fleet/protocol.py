"""The weight-update protocol: the one interface the weight-sync transports speak to the fleet.

The fleet (:class:`megarl.fleet.fleet.Fleet`, rank 0) implements it; every transport in
``megarl.weight_sync.transports`` drives it and nothing else of the fleet's. An update of
version ``v`` goes through these phases::

  open_update(v)       recover dead engines, then every member engine opens update v
  stage                load_files (shm paths) | load_bytes (http bytes) | post_all (a route:
                       CUDA announcements, checks); each engine stages and validates
  close_update(v, r)   commit engine by engine; the fleet now serves v, and ``r`` (the
                       transport's replay) brings a restarted engine to v; recover
  cancel_update()      on failure: every engine drops what it staged; recover

Invariants:

* All or nothing: a rejection by any live engine aborts the update on every engine (the
  previous version keeps serving) and raises ``WeightSyncError``.
* A death is not a rejection: an engine that fails at the connection level (``EngineDead``)
  is marked down and left out of the rest of the update; ``recover`` (in ``close_update`` or
  ``cancel_update``) restarts it and replays the committed version.
* The fleet keeps no version counter of its own: each update names its version (the policy
  version numbered by ``megarl.weight_sync.publisher.PolicyPublisher``, the one counter), and
  the fleet records the version of the last committed update together with its replay
  (:class:`Committed`), so a restarted engine is checked against exactly what it replays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from megarl.fleet.client import EngineClient

Replay = Callable[[list[EngineClient]], None]
"""Brings the given (restarted) engines to the committed weights: begin → load → commit."""


@dataclass(frozen=True)
class Committed:
    """The last update the fleet committed: what its engines serve, and how to give it to an
    engine that restarts."""

    version: int
    """Policy version of the weights (-1: none committed yet)."""
    replay: Replay | None = None
    """The transport's way to re-send these weights (None: a restarted engine is not replayed)."""


class WeightUpdateProtocol(Protocol):
    """What a transport may ask of the fleet (module docstring: the phases and invariants)."""

    engines: list[EngineClient]
    """Every engine of the fleet (members or not)."""
    timeout: float
    """Seconds a request to an engine may take."""

    @property
    def version(self) -> int:
        """Version of the last committed update (-1: none)."""
        ...

    def members(self) -> list[EngineClient]:
        """The engines an update goes to (not those still restarting)."""
        ...

    def recover(self) -> None:
        """Restart every engine that is down and bring it to the committed version."""
        ...

    def open_update(self, version: int, begin: bool = True) -> None:
        """``recover``, then (``begin``) every member opens update ``version``; False: the first
        load request opens it (shm)."""
        ...

    def begin_update(self, version: int, engines: list[EngineClient] | None = None) -> None:
        """Every engine (default: the members) opens update ``version``, nothing staged yet."""
        ...

    def load_files(
        self,
        version: int,
        files: list[str],
        engines: list[EngineClient] | None = None,
        begin: bool = False,
        commit: bool = False,
    ) -> bool:
        """Every engine stages safetensors ``files``; True when no separate commit is needed."""
        ...

    def load_bytes(self, version: int, data: bytes, engines: list[EngineClient] | None = None) -> None:
        """Every engine stages one bucket given as safetensors bytes."""
        ...

    def post_all(
        self, path: str, body: dict[str, Any] | bytes, version: int, engines: list[EngineClient] | None = None
    ) -> list[dict[str, Any] | None]:
        """One request to every engine, concurrently; a rejection becomes ``WeightSyncError``."""
        ...

    def commit_update(self, version: int, engines: list[EngineClient] | None = None) -> None:
        """Engine by engine, apply what was staged."""
        ...

    def close_update(self, version: int, replay: Replay | None, commit: bool = True) -> None:
        """(``commit``: commit_update), record ``version`` and its ``replay``, recover."""
        ...

    def abort_update(self, engines: list[EngineClient] | None = None) -> None:
        """Every engine drops what it staged (best effort)."""
        ...

    def cancel_update(self) -> None:
        """abort_update on every member, then recover (at the previous version)."""
        ...

    def update_engines(self, engines: list[EngineClient], version: int, files: list[str]) -> None:
        """begin → load(files) → commit on ``engines`` (a replay from shm files)."""
        ...

    def engine_tps(self) -> list[int]:
        """Tensor-parallel size (= vLLM worker count) of each engine."""
        ...
