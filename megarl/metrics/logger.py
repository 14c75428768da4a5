"""One metrics path: JSONL (+ TensorBoard) written by global rank 0, hierarchical names.

Names look like ``timing/step/generate``, ``rollout/reward_mean``, ``train/kl``,
``train/lr``, ``coord/b_noise/actor``. Every record carries ``step``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("megarl")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._fh = None
        self._tb: Any = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a")
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
                except ImportError:  # tensorboard is optional at runtime
                    log.warning("tensorboard not installed; writing JSONL only")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or self._fh is None:
            return
        rec = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, float(v), step)
            self._tb.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's metric records. A cut last line (a run killed mid-write) is skipped with a
    warning; a bad line elsewhere, a missing run folder or file is a :class:`ReportError`."""
    from megarl.errors import ReportError

    run = Path(run_dir)
    path = run / "metrics.jsonl"
    if not run.is_dir():
        raise ReportError(f"run folder {run} does not exist" if not run.exists() else f"{run} is not a folder")
    if not path.is_file():
        raise ReportError(f"{path} not found: {run} is not a megarl run folder (train.run_dir) or it never logged")
    lines = [(i, line) for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    recs: list[dict[str, Any]] = []
    for n, (lineno, line) in enumerate(lines):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "step" not in rec:
                raise ValueError("not a metrics record (an object with 'step')")
        except ValueError as e:
            if n == len(lines) - 1:
                log.warning("%s:%d: skipping the cut last line (%s)", path, lineno, e)
                break
            raise ReportError(f"{path}:{lineno}: {e}") from None
        recs.append(rec)
    return recs


class Timer:
    """Named phase timer: ``with timer("generate"): ...`` → ``timing/step/generate``."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def __call__(self, name: str) -> _Span:
        return _Span(self, name)

    def metrics(self) -> dict[str, float]:
        return {f"timing/step/{k}": v for k, v in self.times.items()}


class _Span:
    def __init__(self, timer: Timer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer.times[self.name] = self.timer.times.get(self.name, 0.0) + time.perf_counter() - self.t0
