"""The loop's own state in checkpoints, resume, and preemption.

A checkpoint holds the models (``dist_ckpt``: actor + optimizer, frozen reference, critic +
optimizer) and ``extra``: step, policy version, prompt-sampler position, prompt counters,
the coordinator's state, the KL controller, the trainer's RNG position. Resuming restores
all of it, pushes the restored actor into the fleet under its old version, and trims
``metrics.jsonl`` to the checkpoint's step (no duplicated or missing records).

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
from pathlib import Path
from typing import Any

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


def models_of(tr: Any) -> dict[str, Any]:
    models = {"actor": tr.actor}
    if tr.ref is not None:
        models["ref"] = tr.ref
    if tr.critic is not None:
        models["critic"] = tr.critic
    return models


def save(tr: Any, step: int, keep_last: int, asynchronous: bool = False) -> Any:
    """Checkpoint now (a Path), or stage it and return a PendingSave to ``finalize()`` later."""
    extra = {
        "step": step,
        "version": tr.version,
        "sampler": tr.sampler.state_dict(),
        "prompt_stats": {"skipped": tr.prompt_stats.skipped_overlong, "truncated": tr.prompt_stats.truncated_overlong},
        "planner": tr.planner.state_dict(),
        "kl_ctl": tr.kl_ctl.state_dict(),
    }
    files = {"tokenizer.model": tr.tok.path}
    return save_checkpoint(
        ckpt_root(tr.run_dir), models_of(tr), extra, keep_last=keep_last, files=files, asynchronous=asynchronous
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


def restore(tr: Any, path: Path) -> int:
    """Load models + loop state; returns the number of completed steps."""
    extra = load_checkpoint(path, models_of(tr))
    tr.version = int(extra["version"]) - 1  # the next push re-sends this version
    tr.sampler.load_state_dict(extra["sampler"])
    tr.prompt_stats.skipped_overlong = int(extra["prompt_stats"]["skipped"])
    tr.prompt_stats.truncated_overlong = int(extra["prompt_stats"]["truncated"])
    tr.planner.load_state_dict(extra["planner"])
    tr.kl_ctl.load_state_dict(extra["kl_ctl"])
    step = int(extra["step"])
    if tr.dims.is_rank0:
        trim_metrics(Path(tr.run_dir) / "metrics.jsonl", step)
    return step


def rotate_metrics(path: Path) -> None:
    """A fresh (not resumed) run starts a new metrics file; the old one is kept beside it."""
    if path.exists() and path.stat().st_size:
        import time

        path.replace(path.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl"))


def trim_metrics(path: Path, step: int) -> None:
    """Keep records up to ``step`` (a crash after the checkpoint may have logged more)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
