"""The loop's own state in checkpoints, resume, and preemption.

A checkpoint holds the models (``dist_ckpt``: actor + optimizer, frozen reference, critic +
optimizer) and ``extra``: the step and the state of each named part of the loop (rollouts:
prompt-sampler position and prompt counters; planner: the coordinator; advantages: the KL
controller; publisher: the policy version) — whatever :meth:`Components.stateful` lists.
Resuming restores all of it, pushes the restored actor into the fleet under its old version,
and trims ``metrics.jsonl`` to the checkpoint's step (no duplicated or missing records).

Which checkpoint: ``train.resume=auto`` takes the newest *intact* one (its files match the
manifest written at commit, :mod:`.integrity`), naming each corrupt newer one in a warning;
an explicit path must be intact. Rank 0 decides and broadcasts, so all ranks load the same
checkpoint. The ``megarl train`` launcher makes this choice before starting the ranks.

Preemption: SIGUSR1 (SLURM's warning signal) or SIGTERM set a flag; at the end of the step
the ranks agree (all-reduce MAX), save a checkpoint and stop with ``preempted``. Repeated
signals are harmless. The handlers are installed first thing in a rank (``megarl train``),
so a signal during start-up is not fatal: the run stops after its first step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megarl.checkpoint.dist_ckpt import load_checkpoint, save_checkpoint
from megarl.checkpoint.integrity import CHECKPOINTS, VERIFIED_ENV, CheckpointError, choose_resume

log = logging.getLogger("megarl")
_flag = {"preempt": False}


def install_preemption_handlers() -> None:
    def handler(signum: int, frame: Any) -> None:
        _flag["preempt"] = True

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, handler)


def preempt_requested() -> bool:
    """Collective: True on every rank if any rank received the signal."""
    t = torch.tensor([1.0 if _flag["preempt"] else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def ckpt_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


class Stateful(Protocol):
    """A named part of the loop's state (sampler, planner, KL controller, policy version...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def save(
    run_dir: str | Path,
    step: int,
    models: Mapping[str, Any],
    parts: Mapping[str, Stateful],
    files: Mapping[str, Path],
    keep_last: int,
    asynchronous: bool = False,
) -> Any:
    """Checkpoint ``models`` (dist_ckpt) and ``{"step", name: part.state_dict()}`` now (a Path),
    or stage it and return a PendingSave to ``finalize()`` later. ``files`` are copied in."""
    extra: dict[str, Any] = {"step": step, **{name: part.state_dict() for name, part in parts.items()}}
    return save_checkpoint(
        ckpt_root(run_dir), dict(models), extra, keep_last=keep_last, files=dict(files), asynchronous=asynchronous
    )


def find_resume(run_dir: str | Path, resume: str) -> Path | None:
    """Collective: the checkpoint to resume from (:func:`.integrity.choose_resume`), the same
    on every rank: rank 0 verifies and decides, the others receive its answer (its error too)."""
    if resume == "never":
        return None
    if resume != "auto" and os.environ.get(VERIFIED_ENV) == resume:
        return Path(resume)  # the launcher verified exactly this checkpoint
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return choose_resume(run_dir, resume)
    answer: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            found = choose_resume(run_dir, resume)
            answer = [None if found is None else str(found), None]
        except CheckpointError as e:
            answer = [None, str(e)]
    dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise CheckpointError(answer[1])
    return None if answer[0] is None else Path(answer[0])


def restore(
    path: Path, models: Mapping[str, Any], parts: Mapping[str, Stateful], optional: Collection[str] = ()
) -> int:
    """Load models + every named part; returns the number of completed steps. A part named in
    ``optional`` that the checkpoint lacks (written before the part existed) keeps its state."""
    extra = load_checkpoint(path, dict(models))
    missing = sorted(set(parts) - set(extra) - set(optional))
    if missing:
        raise ValueError(f"checkpoint {path} has no state for {missing} (it holds {sorted(extra)})")
    for name, part in parts.items():
        if name in extra:
            part.load_state_dict(extra[name])
    return int(extra["step"])


def rotate_metrics(path: Path) -> None:
    """A fresh (not resumed) run starts a new metrics file; the old one is kept beside it."""
    if path.exists() and path.stat().st_size:
        import time

        path.replace(path.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl"))


def trim_metrics(path: Path, step: int) -> None:
    """Keep records up to ``step`` (a crash after the checkpoint may have logged more). A line a
    hard kill cut short (not JSON, or no step) is dropped with a warning: it came after the last
    whole record, i.e. after the checkpoint's step, and the resumed run logs that step again."""
    if not path.exists():
        return
    keep = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record_step = int(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            logging.getLogger("megarl").warning("%s:%d is not a whole metrics record (cut short?): dropped", path, n)
            continue
        if record_step <= step:
            keep.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
