"""How a ``megarl train`` process starts: as the launcher, or as a trainer rank.

The launcher half (:func:`launch`, a process that is not a torchrun rank) picks the checkpoint
to resume from — a bad explicit one fails here in one line, and the ranks get the verified
choice and do not read it again — and reads every row of the data before any process starts;
then it trains in-process (one rank) or starts torchrun as its child with
``parallel.tensor_parallel × pipeline_parallel × data_parallel`` ranks, supervised by
``megarl.launcher`` (signals forwarded, one-line errors printed once).

The rank half (:func:`rank`) is what each trainer process runs: stop signals handled first (a
stop during start-up must not kill rank 0, which owns the engines: the run stops after its
first step), the world size checked, ``megarl.loop.train``, then every rank leaves together.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

log = logging.getLogger("megarl")


def launch(cfg: Any, config_path: str | None, sets: list[str]) -> int:
    """The launcher half (``RANK`` unset): the checks that need no process group, then train."""
    from megarl.checkpoint.integrity import VERIFIED_ENV, CheckpointError, choose_resume
    from megarl.prelaunch import check_data

    try:
        found = choose_resume(cfg.train.run_dir, cfg.train.resume)
    except CheckpointError as e:
        sys.stderr.write(f"megarl: checkpoint error: {e}\n")
        return 2
    cfg.train.resume = "never" if found is None else str(found)
    os.environ[VERIFIED_ENV] = cfg.train.resume
    counts = check_data(cfg)  # every row of the data, before any process starts
    log.info("data: %s", ", ".join(f"{k} {v}" for k, v in counts.items()))
    p = cfg.parallel
    world = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    if world == 1:
        return rank(cfg)
    return _torchrun(world, config_path, [*sets, f"train.resume={cfg.train.resume}"])


def _torchrun(world: int, config_path: str | None, sets: list[str]) -> int:
    """torchrun as a child; SIGTERM / SIGINT / SIGUSR1 sent to this process are forwarded to the
    ranks (finish the step, checkpoint, exit) and this process exits with their status."""
    from megarl.launcher import launch as supervise

    cmd = [
        sys.executable,
        "-m",
        "megarl.launcher",  # torchrun, quiet when a rank reported a one-line error
        "--standalone",
        f"--nproc-per-node={world}",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "-m",
        "megarl.cli",
        "train",
    ]
    if config_path:
        cmd += ["--config", config_path]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return supervise(cmd, env)  # supervised; a rank's one-line error is printed once, exit 2


def rank(cfg: Any) -> int:
    """The rank half: train, then leave with the other ranks."""
    from megarl.checkpoint.state import install_preemption_handlers

    install_preemption_handlers()  # first thing: a stop signal during start-up ends the run after a step
    if message := world_size_error(cfg):  # (python -m megarl.cli says it before its imports)
        from megarl.config import ConfigError

        raise ConfigError(message)
    import warnings

    warnings.filterwarnings("ignore")
    from megarl.loop import train
    from megarl.report import draw

    summary = train(cfg, report=draw)
    if int(os.environ.get("RANK", "0")) == 0:
        log.info("summary %s", json.dumps(summary.as_dict()))
    # leave together and tear the process groups down explicitly: a rank that exits while a
    # peer still holds live gloo groups can abort in their destructors ("terminate called
    # without an active exception", exit -6) and fail an otherwise finished run
    import torch.distributed as dist

    from megarl.distributed import shutdown

    if dist.is_initialized():
        dist.barrier()
    shutdown()
    return 0


def world_size_error(cfg: Any) -> str | None:
    """Under torchrun: why WORLD_SIZE is not the config's TP × PP × DP (None when it is, or
    when this process is not a torchrun rank)."""
    p = cfg.parallel
    world = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == world:
        return None
    return (
        f"this run has {os.environ.get('WORLD_SIZE')} ranks (WORLD_SIZE) but parallel.tensor_parallel="
        f"{p.tensor_parallel} × pipeline_parallel={p.pipeline_parallel} × data_parallel={p.data_parallel} = "
        f"{world}: start it with `megarl train` (it launches torchrun itself) or --nproc-per-node={world}"
    )
