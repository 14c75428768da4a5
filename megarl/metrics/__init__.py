"""One metrics path: :class:`MetricsLogger` (``logger``: JSONL, TensorBoard, and the trackers of
``trackers`` — W&B in ``wandb_run``, MLflow in ``mlflow_run``), :func:`read_metrics`, :class:`Timer`."""

from megarl.metrics.logger import MetricsLogger, Timer, read_metrics

__all__ = ["MetricsLogger", "Timer", "read_metrics"]
