"""One run's checkpoints: resume, save (blocking or asynchronous), commit, preemption.

In the spirit of torchtitan's ``CheckpointManager``: the loop hands it what a checkpoint holds
once — the models by name, the named stateful parts (``Components.stateful`` + the loop's
``Progress``), the tokenizer files — and calls it at three moments:

    restore(path)   before the first step: models and parts from ``path``; the completed steps
    after_step(s)   after step s is logged: commits the previous step's asynchronous save,
                    agrees across ranks on a preemption signal, saves when due (every
                    ``train.save_every`` steps, or now when preempted: then blocking, and the
                    run stops); returns whether it was preempted and the time the save blocked
    finish(s)       at the end: commits a pending save, and saves the final state unless step s
                    already did, so every finished run is resumable

Invariant: at most one asynchronous save in flight, committed at the next step's end (its
files are whole and verified by their manifest before ``train.resume=auto`` would take it).
The file layout, manifests and resume choice are :mod:`.state`, :mod:`.dist_ckpt` and
:mod:`.integrity`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megarl.checkpoint import state
from megarl.checkpoint.state import Stateful
from megarl.config import TrainConfig


class CheckpointManager:
    def __init__(
        self,
        run_dir: Path,
        t: TrainConfig,
        models: Mapping[str, Any],
        parts: Mapping[str, Stateful],
        files: Mapping[str, Path],
    ) -> None:
        self.run_dir, self.t = run_dir, t
        self.models, self.parts, self.files = dict(models), dict(parts), dict(files)
        self._pending: Any = None
        """An asynchronous save being written (``PendingSave``), committed at the next step's end."""

    def restore(self, path: Path) -> int:
        """Models and parts from ``path``; the number of completed steps. (Checkpoints from before
        ``Progress`` existed resume with its counters at zero.)"""
        return state.restore(path, self.models, self.parts, optional=["progress"])

    def due(self, step: int) -> bool:
        """Whether ``train.save_every`` saves after ``step``."""
        return bool(self.t.save_every) and step % self.t.save_every == 0

    def after_step(self, step: int) -> tuple[bool, dict[str, float]]:
        """Collective, after step ``step`` is logged: (preempted, the save's metrics)."""
        preempted = state.preempt_requested()
        if self._pending is not None:  # the previous step's background write: commit it
            self._pending.finalize()
            self._pending = None
        if not (preempted or self.due(step)):
            return preempted, {}
        asynchronous = self.t.async_save and not preempted
        t0 = time.perf_counter()
        result = self._save(step, asynchronous)
        if asynchronous:
            self._pending = result
        return preempted, {"timing/checkpoint_blocked_s": time.perf_counter() - t0}

    def finish(self, step: int) -> None:
        """Collective, at the run's end: the pending save committed and the final state saved."""
        if self._pending is not None:
            self._pending.finalize()
            self._pending = None
        if not self.due(step):
            self._save(step, asynchronous=False)  # the final state is always resumable

    def _save(self, step: int, asynchronous: bool) -> Any:
        return state.save(
            self.run_dir, step, self.models, self.parts, self.files, self.t.keep_last, asynchronous=asynchronous
        )
