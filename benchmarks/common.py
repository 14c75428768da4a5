"""Shared helpers for benchmarks: run `megarl train` and read its summary; tiny HF models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_train(config: str, sets: list[str], log_path: Path, timeout: int = 1800) -> dict[str, Any]:
    """Run `megarl train` to completion; return its summary dict (raises with the log tail)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
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
