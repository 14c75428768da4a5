"""Shared helpers for benchmarks: run `megarl train` and read its summary; tiny HF models."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_train(
    config: str, sets: list[str], log_path: Path, timeout: int = 1800, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run `megarl train` to completion; return its summary dict (raises with the log tail).
    ``env``: extra environment variables of the run (e.g. ``MEGARL_VIRTUAL_CLOCK``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", config]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    for line in reversed((proc.stdout + proc.stderr).splitlines()):
        if " summary {" in line:
            return dict(json.loads(line.split(" summary ", 1)[1]))
    raise RuntimeError(f"no summary line in {log_path}")


def step_metrics(
    config: str, out: Path, steps: int, sets: list[str], timeout: int, code: Path = ROOT
) -> list[dict[str, Any]]:
    """``steps`` steps of `megarl train` from the megarl in ``code`` with engines timing their model
    forward (MEGARL_ENGINE_TIME_MODEL=1); the metrics.jsonl rows of its steps. The log goes next
    to ``out`` (the run directory); a failed run raises with the log's tail."""
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONWARNINGS="ignore", MEGARL_ENGINE_TIME_MODEL="1")  # fmt: skip
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", config]
    for s in [f"train.steps={steps}", "train.eval_every=0", "train.tensorboard=false", "train.resume=never",
              f"train.run_dir={out}", *sets]:  # fmt: skip
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=code)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} (in {code}) failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing/step/total" in r]


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    head = " | ".join(c.ljust(widths[c]) for c in cols)
    sep = "-|-".join("-" * widths[c] for c in cols)
    body = "\n".join(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols) for r in rows)
    return f"{head}\n{sep}\n{body}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


T_ONE_SIDED = {
    0.90: [3.078, 1.886, 1.638, 1.533, 1.476, 1.440, 1.415, 1.397, 1.383],
    0.95: [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833],
}
"""One-sided Student t quantiles for 1..9 degrees of freedom (more: the 9's, conservative)."""


def mean_bound(xs: list[float], level: float = 0.90, upper: bool = False) -> tuple[float, float, float]:
    """Mean, sample standard deviation and the one-sided ``level`` t bound of the mean of ``xs``
    (the lower bound, or the upper with ``upper``); nan for the last two with one value."""
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, math.nan, math.nan
    sd = statistics.stdev(xs)
    t = T_ONE_SIDED[level][min(len(xs) - 1, 9) - 1]
    half = t * sd / math.sqrt(len(xs))
    return mean, sd, mean + half if upper else mean - half
