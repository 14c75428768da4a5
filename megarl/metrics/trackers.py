"""Experiment trackers (W&B, MLflow) behind the one metrics path.

Invariants:
- ``metrics.jsonl`` is written first and always; a tracker receives a copy of each record.
- Each tracker runs in its own daemon thread fed by a queue: the loop only enqueues, so a slow,
  offline or failing tracker never slows a step. Its first error (not installed, no network,
  refused) turns that tracker off with one warning line; the run goes on.
- ``run_dir/trackers.json`` keeps each tracker's run id and the last step it received. A resumed
  or requeued run continues the same tracker run, and a step it replays (its checkpoint is older
  than the last step logged) is not sent again: a tracker's steps never repeat or go backwards.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megarl.config.tracking import TrackingConfig

log = logging.getLogger("megarl")
RUN_IDS = "trackers.json"


class Backend(Protocol):
    """One tracker's client. Every call may raise; :class:`TrackerThread` contains it."""

    name: str

    def start(self, run_id: str | None) -> str:
        """Open a new run, or continue run ``run_id``; returns the run's id."""
        ...

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None: ...

    def summary(self, values: dict[str, float]) -> None: ...

    def artifact(self, name: str, path: Path) -> None: ...

    def finish(self, ok: bool) -> None: ...


@dataclass(frozen=True)
class RunNames:
    """The tracking settings resolved against the environment (``TrackingConfig`` docs)."""

    project: str
    entity: str
    experiment: str
    name: str
    group: str
    tags: tuple[str, ...]
    mlflow_uri: str
    x_axis: str
    default_uri: bool
    """True when ``mlflow_uri`` is megarl's own default (a database in the run folder)."""


def resolve(t: TrackingConfig, run_dir: Path, env: Mapping[str, str] = os.environ) -> RunNames:
    project = t.project or env.get("WANDB_PROJECT", "") or "megarl"
    uri = t.mlflow_uri or env.get("MLFLOW_TRACKING_URI", "")
    tags = t.tags or [s.strip() for s in env.get("WANDB_TAGS", "").split(",") if s.strip()]
    return RunNames(
        project=project,
        entity=t.entity or env.get("WANDB_ENTITY", ""),
        experiment=t.experiment or env.get("MLFLOW_EXPERIMENT_NAME", "") or project,
        name=t.name or env.get("WANDB_NAME", "") or run_dir.resolve().name,
        group=t.group or env.get("WANDB_RUN_GROUP", ""),
        tags=tuple(tags),
        mlflow_uri=uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}",
        x_axis=t.x_axis,
        default_uri=not uri,
    )


class RunIds:
    """``run_dir/trackers.json``: ``{tracker: {"run_id": str, "step": int}}``, replaced whole on
    every change (a kill never leaves half a file). A fresh run starts from none."""

    def __init__(self, path: Path, fresh: bool) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._ids: dict[str, dict[str, Any]] = {}
        if not fresh and path.is_file():
            try:
                self._ids = json.loads(path.read_text())
            except ValueError as e:
                log.warning("%s is not JSON (%s): tracker runs start anew", path, e)

    def get(self, name: str) -> tuple[str | None, int]:
        """The run id of tracker ``name`` and the last step it received (-1: none)."""
        entry = self._ids.get(name, {})
        return entry.get("run_id"), int(entry.get("step", -1))

    def set(self, name: str, **values: Any) -> None:
        with self._lock:
            self._ids.setdefault(name, {}).update(values)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._ids, indent=1) + "\n")
            tmp.replace(self.path)


class TrackerThread:
    """One backend behind a queue and a daemon thread: calls return at once, errors turn it off."""

    def __init__(self, backend: Backend, ids: RunIds, max_queue: int = 100_000) -> None:
        self.backend, self.ids = backend, ids
        self.name = backend.name
        self._resume_id, self.floor = ids.get(self.name)  # steps <= floor were sent by an earlier attempt
        self.dead = False
        self._full_warned = False
        self._q: queue.Queue[tuple[Any, ...] | None] = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._work, name=f"megarl-{self.name}", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        if step > self.floor:
            self._put(("log", step, metrics, wall_time))

    def summary(self, values: dict[str, float]) -> None:
        self._put(("summary", values))

    def artifact(self, name: str, path: Path) -> None:
        self._put(("artifact", name, path))

    def close(self, ok: bool, wait_s: float, limit_s: float) -> None:
        """Finish the run and wait at most ``wait_s`` (of all trackers' ``limit_s``) for the queue to drain."""
        self._put(("finish", ok))
        self._put(None)
        self._thread.join(wait_s)
        if self._thread.is_alive():
            log.warning(
                "%s tracker: still delivering after train.tracking.close_timeout_s=%g; leaving it "
                "(metrics.jsonl has every record)",
                self.name,
                limit_s,
            )

    def _put(self, item: tuple[Any, ...] | None) -> None:
        if self.dead:
            return
        try:
            self._q.put_nowait(item)
        except queue.Full:
            if not self._full_warned:
                self._full_warned = True
                log.warning("%s tracker: %d records queued, dropping the newest", self.name, self._q.maxsize)

    def _work(self) -> None:
        what = "start"
        try:
            run_id = self.backend.start(self._resume_id)
            self.ids.set(self.name, run_id=run_id)
            if self._resume_id is not None and run_id != self._resume_id:
                log.warning("%s tracker: run %s not found, started run %s", self.name, self._resume_id, run_id)
            while (item := self._q.get()) is not None:
                what = item[0]
                if what == "log":
                    self.backend.log(*item[1:])
                    self.ids.set(self.name, step=item[1])
                elif what == "summary":
                    self.backend.summary(*item[1:])
                elif what == "artifact":
                    self.backend.artifact(*item[1:])
                else:
                    self.backend.finish(*item[1:])
        except Exception as e:  # any failure of a tracker must not reach the run: say it once, go on
            self.dead = True
            first = (str(e).strip().splitlines() or [""])[0][:300]
            if isinstance(e, ImportError):
                first += "; pip install 'megarl[trackers]'"
            log.warning(
                "%s tracker off after an error in %s: %s: %s (metrics.jsonl keeps every record)",
                self.name,
                what,
                type(e).__name__,
                first,
            )
            if what != "start" and what != "finish":
                try:
                    self.backend.finish(False)
                except Exception as e2:
                    log.debug("%s tracker: finish after the error failed too: %s", self.name, e2)


def wait_all(threads: list[TrackerThread], ok: bool, timeout_s: float) -> None:
    """Close every tracker, all within one ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for th in threads:
        th.close(ok, max(0.0, deadline - time.monotonic()), timeout_s)
