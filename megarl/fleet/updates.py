"""The fleet's side of the weight-update protocol (``megarl.fleet.protocol``: the phases and
their invariants); a base of :class:`megarl.fleet.fleet.Fleet`, built on its restarts.

Weight updates go to every engine as begin → load (all engines) → commit (all engines); a
load rejected by any engine aborts the update everywhere, so the whole fleet keeps serving
the previous version (``WeightSyncError``). An engine that does not answer at all during an
update is marked down and left out of the rest of it; ``recover`` restarts it and the replay
recorded with the committed update (:meth:`close_update`) brings it to that version.
:meth:`update_weights` is the whole sequence from safetensors files; the weight-sync
transports (``megarl.weight_sync.transports``) drive the phases one by one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from megarl.engine import routes
from megarl.errors import EngineDead, RolloutError, WeightSyncError
from megarl.fleet import faults
from megarl.fleet.client import EngineClient
from megarl.fleet.protocol import Committed, Replay
from megarl.fleet.restarts import Restarts

log = logging.getLogger("megarl.fleet")

T = TypeVar("T")
R = TypeVar("R")


def concurrently(fn: Callable[[T], R], items: list[T]) -> list[R]:
    """``[fn(x) for x in items]``, one thread per item; a single item runs in this thread (a
    pool's threads cost ~0.5 ms a call: a one-engine fleet pays it on every request)."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


class WeightUpdates(Restarts):
    """Implements :class:`megarl.fleet.protocol.WeightUpdateProtocol`."""

    def update_weights(self, version: int, files: list[str]) -> dict[str, float]:
        """begin → load(files) → commit on every engine; a restarted engine replays it."""
        t0 = time.perf_counter()
        self.open_update(version, begin=False)  # the load request opens the update
        try:
            self.update_engines(self.members(), version, files)
        except WeightSyncError:
            self.recover()  # engines that died meanwhile come back at the previous version
            raise

        def replay(engines: list[EngineClient]) -> None:
            self.update_engines(engines, version, files)

        self.close_update(version, replay, commit=False)  # (update_engines committed)
        return {"fleet_update_s": time.perf_counter() - t0}

    def open_update(self, version: int, begin: bool = True) -> None:
        """Engines found dead are restarted at the previous version, then (``begin``) every
        member opens update ``version``."""
        self.recover()
        if begin:
            self.begin_update(version)

    def close_update(self, version: int, replay: Replay | None, commit: bool = True) -> None:
        """(``commit``) every member applies what it staged; the fleet now serves ``version``,
        which ``replay`` gives to a restarted engine; engines that died during the update come
        back at it."""
        if commit:
            self.commit_update(version)
        self.last_commit = Committed(version, replay)
        self.recover()

    def cancel_update(self) -> None:
        """Every member drops what it staged; engines that died come back at the previous version."""
        self.abort_update()
        self.recover()

    def update_engines(self, engines: list[EngineClient], version: int, files: list[str]) -> None:
        try:
            done = self.load_files(version, files, engines, begin=True, commit=len(engines) == 1)
        except WeightSyncError:
            self.abort_update(engines)
            raise
        if not done:
            self.commit_update(version, engines)

    def post_all(
        self, path: str, body: dict[str, Any] | bytes, version: int, engines: list[EngineClient] | None = None
    ) -> list[dict[str, Any] | None]:
        """One request to every engine, concurrently; a rejection becomes WeightSyncError.

        An engine that fails at the connection level (``EngineDead``) is marked in ``down``
        and answers None: the update goes on without it, :meth:`recover` restarts it."""
        engines = engines or self.members()

        def one(e: EngineClient) -> dict[str, Any] | None:
            try:
                if isinstance(body, bytes):
                    return e.post_bytes(path, body, self.timeout)
                return e.post(path, body, self.timeout)
            except EngineDead as err:
                log.warning("%s died during update %d (%s); it will be restarted", e.name, version, err)
                self.down.add(e.name)
                return None

        try:
            return concurrently(one, engines)
        except RolloutError as err:
            raise WeightSyncError(f"weight update to version {version} rejected: {err}") from err

    def begin_update(self, version: int, engines: list[EngineClient] | None = None) -> None:
        self.post_all(routes.BEGIN, {"version": version}, version, engines)
        faults.inject("sync_begin", version, engines or self.members())

    def load_files(
        self,
        version: int,
        files: list[str],
        engines: list[EngineClient] | None = None,
        begin: bool = False,
        commit: bool = False,
    ) -> bool:
        """Every engine stages ``files`` (shm). ``begin``: the same request opens the update
        (files need nothing opened before they are written); ``commit``: it also applies it —
        for one engine only, as nothing then waits for another engine's verdict. Each saves a
        round trip (~1 ms of a demo step). True when the update needs no separate commit: the
        engine committed, or died and is left to :meth:`recover`, as in :meth:`commit_update`."""
        targets = engines or self.members()
        if commit and len(targets) != 1:
            raise ValueError(f"a load that commits needs a fleet of one engine, not {len(targets)}")
        if begin:
            faults.inject("sync_begin", version, targets)
        faults.inject("sync_load", version, targets)
        if commit:
            faults.inject("sync_commit", version, targets)
        body = (
            {"version": version, "files": files}
            | ({"begin": True} if begin else {})
            | ({"commit": True} if commit else {})
        )
        answers = self.post_all(routes.LOAD, body, version, engines)
        if not commit:
            return False
        answer = answers[0]
        if answer is not None:
            if answer.get("version") != version:  # an engine that ignored "commit" would serve the old weights
                self.abort_update(targets)
                raise WeightSyncError(
                    f"{targets[0].name} did not commit version {version} with its load (answered {answer}): "
                    "an engine from another megarl version?"
                )
            self.committed(targets[0], version)
        return True

    def load_bytes(self, version: int, data: bytes, engines: list[EngineClient] | None = None) -> None:
        """One bucket as safetensors bytes (http transport)."""
        faults.inject("sync_load", version, engines or self.members())
        self.post_all(f"{routes.LOAD_BYTES}?version={version}", data, version, engines)

    def commit_update(self, version: int, engines: list[EngineClient] | None = None) -> None:
        """Commit engine by engine; one that died is left to :meth:`recover` (it replays this
        version), one that refuses aborts the engines not reached yet."""
        for e in engines or self.members():
            faults.inject("sync_commit", version, [e])
            try:
                e.post(routes.COMMIT, {"version": version}, self.timeout)
            except EngineDead as err:
                log.warning("%s died before committing version %d (%s); it will be restarted", e.name, version, err)
                self.down.add(e.name)
                continue
            except RolloutError as err:
                self.abort_update(engines)  # engines not reached yet drop their staged tensors
                raise WeightSyncError(f"commit of version {version} failed on {e.name}: {err}") from err
            self.committed(e, version)

    def abort_update(self, engines: list[EngineClient] | None = None) -> None:
        """Drop whatever is staged (best effort: an engine that is down has nothing staged)."""
        for e in engines or self.members():
            try:
                e.post(routes.ABORT, {}, self.timeout)
            except RolloutError:
                pass

    def engine_tps(self) -> list[int]:
        """Tensor-parallel size (= vLLM worker count) of each engine."""
        try:
            return [int(e.info()["tp"]) for e in self.engines]
        except RolloutError as err:
            raise WeightSyncError(f"engine /info failed: {err}") from err
