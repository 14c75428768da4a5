"""The MLflow tracker: one MLflow run per megarl run, continued by id after a resume or requeue.

MLflow's step is the optimizer step; ``progress/samples`` is logged beside every record (pick it
as the x-axis in MLflow's charts to line runs up by responses trained). The resolved config is
the run's params (dotted names, ``str(value)``): params cannot change, so a resumed run whose
setting changed records the new value as the tag ``resumed.<name>``. The end summary is logged
as metrics ``summary/<name>`` at the last step. Without a tracking URI the run goes to
``sqlite:///<run_dir>/mlflow.db`` with artifacts in ``<run_dir>/mlartifacts``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megarl.metrics.trackers import RunNames

BATCH = 100  # MLflow's limit of params (and the store's of tags) per log_batch; metrics allow 1000


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"steps": 4}}`` → ``{"train.steps": "4"}`` (MLflow params are strings)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


class MlflowRun:
    name = "mlflow"

    def __init__(self, names: RunNames, run_dir: Path, config: dict[str, Any]) -> None:
        self.names, self.run_dir, self.config = names, run_dir, config
        self.client: Any = None
        self.run_id = ""
        self.last_step = 0

    def start(self, run_id: str | None) -> str:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        n = self.names
        self.client = c = MlflowClient(tracking_uri=n.mlflow_uri)
        old: dict[str, str] = {}
        run = None
        if run_id is not None:
            from mlflow.exceptions import MlflowException

            try:
                run = c.get_run(run_id)
            except MlflowException:  # another tracking server: a new run (the thread says so)
                run = None
        if run is not None:
            self.run_id = run.info.run_id
            c.update_run(self.run_id, status="RUNNING")
            old = run.data.params
        else:
            self.run_id = c.create_run(self._experiment(), run_name=n.name, tags=self._tags()).info.run_id
        params = flatten(self.config)
        new = [Param(k, v) for k, v in params.items() if k not in old]
        changed = [RunTag(f"resumed.{k}", v) for k, v in params.items() if k in old and old[k] != v]
        for i in range(0, max(len(new), len(changed)), BATCH):
            c.log_batch(self.run_id, params=new[i : i + BATCH], tags=changed[i : i + BATCH])
        return str(self.run_id)

    def _experiment(self) -> str:
        n, c = self.names, self.client
        exp = c.get_experiment_by_name(n.experiment)
        if exp is not None:
            return str(exp.experiment_id)
        where = (self.run_dir / "mlartifacts").resolve().as_uri() if n.default_uri else None
        return str(c.create_experiment(n.experiment, artifact_location=where))

    def _tags(self) -> dict[str, str]:
        tags = {t: "" for t in self.names.tags}
        if self.names.group:
            tags["group"] = self.names.group
        tags["megarl.run_dir"] = str(self.run_dir.resolve())
        return tags

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        batch = [Metric(k, v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])
        self.last_step = step

    def summary(self, values: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        step = int(values.get("steps", self.last_step))
        batch = [Metric(f"summary/{k}", float(v), ms, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def artifact(self, name: str, path: Path) -> None:
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path=name)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path=name)

    def finish(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")
