"""One metrics path: JSONL (+ TensorBoard, W&B, MLflow) written by global rank 0, hierarchical names.

Names look like ``timing/step/generate``, ``rollout/reward_mean``, ``train/kl``,
``train/lr``, ``coord/b_noise/actor``. Every record carries ``step``. ``metrics.jsonl`` is the
record of the run: it is written first, always, and a tracker only gets a copy
(:mod:`megarl.metrics.trackers`). The run folder also gets ``config.json`` (the resolved config,
which the trackers log as the run's config) and, at the end, ``summary.json`` (the run's summary).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megarl.config.tracking import TrackingConfig
from megarl.config.train import TrainConfig
from megarl.metrics.mlflow_run import MlflowRun
from megarl.metrics.trackers import RUN_IDS, Backend, RunIds, TrackerThread, resolve, wait_all
from megarl.metrics.wandb_run import WandbRun

log = logging.getLogger("megarl")


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool,
        tensorboard: bool = True,
        trackers: Sequence[TrackerThread] = (),
        close_timeout_s: float = 60.0,
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.trackers = list(trackers)
        self.close_timeout_s = close_timeout_s
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

    @classmethod
    def open(cls, t: TrainConfig, config: dict[str, Any], enabled: bool, resumed: bool) -> MetricsLogger:
        """The run's logger as ``train.trackers`` asks (rank 0: ``enabled``); writes the resolved
        ``config`` to ``run_dir/config.json``. ``resumed``: continue the trackers' runs."""
        run_dir = Path(t.run_dir)
        trackers: list[TrackerThread] = []
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
            trackers = open_trackers(t.trackers, t.tracking, run_dir, config, resumed)
        tb = t.tensorboard and "tensorboard" in t.trackers
        return cls(run_dir, enabled, tensorboard=tb, trackers=trackers, close_timeout_s=t.tracking.close_timeout_s)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or self._fh is None:
            return
        values = {k: float(v) for k, v in metrics.items()}
        rec = {"step": step, "time": time.time(), **values}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        for tr in self.trackers:
            tr.log(step, values, rec["time"])

    def summary(self, values: dict[str, float]) -> None:
        """The run's end summary: ``run_dir/summary.json`` and each tracker's run summary."""
        if not self.enabled:
            return
        values = {k: float(v) for k, v in values.items()}
        (self.run_dir / "summary.json").write_text(json.dumps(values, indent=1) + "\n")
        for tr in self.trackers:
            tr.summary(values)

    def artifact(self, name: str, path: Path) -> None:
        """Upload a file or folder of the run (``hf_final``, ``report``) to every tracker."""
        for tr in self.trackers:
            tr.artifact(name, path)

    def close(self, ok: bool = True) -> None:
        """Close the files and finish the trackers' runs (``ok``: the run did not fail), waiting
        at most ``close_timeout_s`` for them."""
        if self._fh is not None:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
        wait_all(self.trackers, ok, self.close_timeout_s)


def open_trackers(
    names: Sequence[str], t: TrackingConfig, run_dir: Path, config: dict[str, Any], resumed: bool
) -> list[TrackerThread]:
    """A thread per remote tracker in ``names`` (``jsonl`` and ``tensorboard`` are local files)."""
    run = resolve(t, run_dir)
    ids = RunIds(run_dir / RUN_IDS, fresh=not resumed)
    backends: list[Backend] = []
    if "wandb" in names:
        backends.append(WandbRun(run, run_dir, config))
    if "mlflow" in names:
        backends.append(MlflowRun(run, run_dir, config))
    threads = [TrackerThread(b, ids) for b in backends]
    for th in threads:
        run_id, step = ids.get(th.name)
        log.info(
            "%s tracker: %s",
            th.name,
            f"continuing run {run_id} after step {step}" if run_id else f"new run {run.name!r} ({run.project})",
        )
    return threads


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
