"""The ``weight_sync`` section: how the actor's weights reach the engines after every optimizer
step, and the integrity check. Which transports this machine can run is
:mod:`megarl.config.cross`'s rule (it depends on CUDA and on colocation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class WeightSyncConfig:
    transport: Literal["auto", "shm", "http", "nccl", "cuda_ipc"] = "auto"
    """How buckets reach the engines: shm (files in this host's /dev/shm), http (bytes in a
    request body; engines on any host), nccl (GPU broadcast), cuda_ipc (GPU memory shared with
    colocated engines); auto = shm if every engine is on this host, else http."""
    bucket_mb: float = 64.0
    """Target bucket size, MiB."""
    integrity_check: bool = True
    """After a sync, compare engine vs trainer logprobs on a fixed sequence (see integrity_every)."""
    integrity_every: int = 1
    """Check every N-th policy version (1 = every sync). The first sync, and the first sync
    after an engine restart, are always checked: a wrong mapping or a bad reload shows there."""
    integrity_tol: float = 1e-3
    """Max |Δ logprob| the integrity check allows (fp32)."""
