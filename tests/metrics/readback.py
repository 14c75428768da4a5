"""Read a run back from W&B's offline files and MLflow's store with the trackers' own readers
(``wandb leet inspect --json``: W&B's reader of its ``.wandb`` transaction log; ``MlflowClient``),
and compare it with megarl's ``metrics.jsonl`` / ``config.json`` / ``summary.json``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
             "WANDB_X_DISABLE_STATS": "true", "WANDB_X_DISABLE_MACHINE_INFO": "true"}


@dataclass
class WandbFile:
    """One ``.wandb`` file: one process's part of a W&B run."""

    run_id: str = ""
    run: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int | None = None


def wandb_files(run_dir: Path) -> list[WandbFile]:
    """The offline run files under ``run_dir/wandb``, oldest first (a resumed run adds a folder)."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    out = []
    for path in files:
        text = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", str(path), "--json"],
                              capture_output=True, text=True, check=True, timeout=120).stdout
        f = WandbFile()
        for rec in map(json.loads, text.splitlines()):
            kind = rec["type"]
            if kind == "run":
                f.run = rec["run"]
                f.run_id = rec["run"]["run_id"]
                f.config.update(rec["run"].get("config", {}).get("update", {}))
            elif kind == "config":
                f.config.update(rec["config"]["update"])
            elif kind == "history":
                f.history.append(rec["history"]["item"])
            elif kind == "summary":
                f.summary.update(rec["summary"].get("update", {}))
            elif kind == "metric":
                f.metrics.append(rec["metric"])
            elif kind == "artifact":
                f.artifacts.append(rec["artifact"])
            elif kind == "exit":
                f.exit_code = rec["exit"].get("exit_code", 0)
        f.config.pop("_wandb", None)
        out.append(f)
    return out


def jsonl_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl merged per step (what a tracker's row of that step holds), without ``time``."""
    steps: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        step = rec.pop("step")
        rec.pop("time")
        row = steps.setdefault(step, {})
        assert not set(rec) & set(row), f"step {step}: {sorted(set(rec) & set(row))} logged twice"
        row.update(rec)
    return steps


def same(a: float, b: float | str) -> bool:
    """Equal, NaN equal to NaN (W&B's JSON writes non-finite numbers as "NaN", "Infinity")."""
    b = float(b)
    return a == b or (math.isnan(a) and math.isnan(b))


def mlflow_history(client: Any, run_id: str) -> dict[int, dict[str, float]]:
    """Every metric of an MLflow run per step, asserting each (key, step) was logged once."""
    steps: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        if key.startswith("summary/"):
            continue
        for m in client.get_metric_history(run_id, key):
            row = steps.setdefault(m.step, {})
            assert key not in row, f"{key} logged twice at step {m.step}"
            row[key] = m.value
    return steps


def wandb_history(files: list[WandbFile]) -> dict[int, dict[str, float]]:
    """The W&B rows of every part of a run, by step, asserting steps only go up."""
    rows: dict[int, dict[str, float]] = {}
    last = -1
    for f in files:
        for item in f.history:
            step = item["_step"]
            assert step > last, f"W&B step {step} after {last}"
            last = step
            row = {k: v for k, v in item.items() if not k.startswith("_")}
            assert row.pop("step") == step
            rows[step] = row
    return rows
