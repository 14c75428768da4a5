"""Where a run's metrics go besides ``metrics.jsonl``: the ``train.tracking`` section (W&B and
MLflow run settings) and its checks. Each empty setting falls back to the environment variable
the tracker's own users set (docs/TRACKING.md), so a cluster's usual exports keep working."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.rules import fail

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(kw_only=True)
class TrackingConfig:
    project: str = ""
    """W&B project ('' = $WANDB_PROJECT, else "megarl"); also the MLflow experiment's default name."""
    entity: str = ""
    """W&B entity, a team or user ('' = $WANDB_ENTITY, else the account's default)."""
    experiment: str = ""
    """MLflow experiment ('' = $MLFLOW_EXPERIMENT_NAME, else the project)."""
    name: str = ""
    """Run name in both trackers ('' = $WANDB_NAME, else the name of train.run_dir's folder)."""
    group: str = ""
    """W&B run group, an MLflow tag "group" ('' = $WANDB_RUN_GROUP, else none)."""
    tags: list[str] = field(default_factory=list)
    """Run tags in both trackers (empty = $WANDB_TAGS, comma-separated, else none)."""
    mlflow_uri: str = ""
    """MLflow tracking URI ('' = $MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db)."""
    x_axis: Literal["step", "samples"] = "step"
    """Default x-axis of the W&B charts: optimizer steps or responses trained (``progress/samples``);
    both are logged with every record, and MLflow's step is always the optimizer step."""
    artifacts: bool = False
    """At the end, upload hf_final/ and the report (report.html + plots) as run artifacts."""
    close_timeout_s: float = 60.0
    """At the end, how long the run waits for a tracker to deliver what is queued, s (then it
    leaves without it; metrics.jsonl has every record)."""

    def validate(self) -> None:
        """A close timeout >= 0; tags W&B accepts. (That ``train.trackers`` names each tracker once
        is :class:`megarl.config.train.TrainConfig`'s rule.)"""
        if self.close_timeout_s < 0:
            fail("train.tracking.close_timeout_s", self.close_timeout_s, "must be >= 0")
        for tag in self.tags:
            if not tag.strip() or len(tag) > 64:
                fail(
                    "train.tracking.tags", self.tags, "must hold non-empty tags of at most 64 characters (W&B's limit)"
                )
