"""The W&B tracker: one W&B run per megarl run, continued by id after a resume or requeue.

W&B's ``step`` is the optimizer step (records arrive in order: :class:`~.trackers.TrackerThread`
drops replayed steps), ``step`` and ``progress/samples`` are logged as metrics with every record
and ``define_metric`` makes one of them the charts' x-axis (``train.tracking.x_axis``). Offline
runs (``WANDB_MODE=offline``) write ``<run_dir>/wandb/offline-run-*`` (or ``$WANDB_DIR``); a
resumed offline run writes another such folder with the same run id: ``wandb sync`` them in order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megarl.metrics.trackers import RunNames


class WandbRun:
    name = "wandb"

    def __init__(self, names: RunNames, run_dir: Path, config: dict[str, Any]) -> None:
        self.names, self.run_dir, self.config = names, run_dir, config
        self.run: Any = None

    def start(self, run_id: str | None) -> str:
        import wandb

        n = self.names
        self.run = wandb.init(
            project=n.project,
            entity=n.entity or None,
            name=n.name,
            group=n.group or None,
            tags=list(n.tags) or None,
            dir=os.environ.get("WANDB_DIR") or str(self.run_dir),
            id=run_id,
            resume="allow" if run_id else None,
            # console capture rewrites rank 0's stdout: only when asked for (WANDB_CONSOLE=wrap)
            settings=wandb.Settings(console=os.environ.get("WANDB_CONSOLE", "off")),  # type: ignore[arg-type]
            reinit="create_new",
        )
        self.run.config.update(self.config, allow_val_change=True)  # a resumed run may change settings
        self.run.define_metric("step")
        self.run.define_metric("progress/samples", step_metric="step")
        self.run.define_metric("*", step_metric="step" if n.x_axis == "step" else "progress/samples")
        return str(self.run.id)

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self.run.log({**metrics, "step": step}, step=step)

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def artifact(self, name: str, path: Path) -> None:
        import wandb

        art = wandb.Artifact(f"{self.run.id}-{name}", type="model" if name == "hf_final" else name)
        if path.is_dir():
            art.add_dir(str(path))
        else:
            art.add_file(str(path))
        self.run.log_artifact(art)

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)
