"""How HF-named buckets reach the engines: one ``Transport`` interface, one class per medium.

:class:`~megarl.weight_sync.sync.WeightSync` drives every transport through the same phases
(each a method here), so validation and failure handling are the same whatever the medium:

  begin(version)        rank 0     every engine opens an update (nothing staged yet)
  send(version, bkts)   all ranks  stage owners move their buckets (may be a collective);
                                   returns a small picklable receipt for rank 0
  load(version, rcpts)  rank 0     engines stage what the receipts point to (validated)
  commit(version)       rank 0     every engine applies its whole update at once
  abort(version)        rank 0     every engine drops what it staged (old version serves)
  release(version, ok)  all ranks  free local buffers / files no longer needed

Transports: ``shm`` (safetensors files in /dev/shm; engines on this host), ``http`` (the
bucket's safetensors bytes as a request body; engines anywhere), and the CUDA ones in
``transports.nccl`` / ``transports.cuda_ipc`` (``nccl`` broadcast, ``cuda_ipc`` for colocated engines).
``auto`` picks shm when every engine is on this host and reads the run's private staging
folder (engines megarl started; attached ones only with MEGARL_STAGING_DIR), else http
(:func:`resolve_transport`).
"""

from __future__ import annotations

from pathlib import Path

from megarl.config import ConfigError
from megarl.distributed import ParallelDims
from megarl.fleet.protocol import WeightUpdateProtocol
from megarl.weight_sync.transports.base import Bucket, Transport, bucket_bytes, is_local_address
from megarl.weight_sync.transports.cuda_ipc import CudaIpcTransport
from megarl.weight_sync.transports.http import HttpTransport
from megarl.weight_sync.transports.nccl import NcclTransport
from megarl.weight_sync.transports.shm import ShmTransport

__all__ = [
    "TRANSPORTS",
    "Bucket",
    "Transport",
    "bucket_bytes",
    "is_local_address",
    "make_transport",
    "resolve_transport",
]

TRANSPORTS = ("auto", "shm", "http", "nccl", "cuda_ipc")


def resolve_transport(requested: str, addresses: list[str], started_locally: bool, has_staging: bool = True) -> str:
    """The transport to use for this fleet; ConfigError if the requested one cannot reach it.
    ``has_staging``: the engines read shm files from a staging folder this process knows."""
    if requested not in TRANSPORTS:
        raise ConfigError(f"weight_sync.transport={requested!r} must be one of {list(TRANSPORTS)}")
    remote = [] if started_locally else [a for a in addresses if not is_local_address(a)]
    if requested == "auto":
        return "http" if remote or not has_staging else "shm"
    if requested == "shm" and not has_staging:
        raise ConfigError(
            "weight_sync.transport='shm' needs the engines' staging folder, but these engines were attached"
            " without one (export MEGARL_STAGING_DIR to the engines and the trainer, or use 'http' / 'auto')"
        )
    if remote and requested in ("shm", "cuda_ipc"):
        raise ConfigError(
            f"weight_sync.transport={requested!r} needs every engine on this host, but {remote} "
            "are not (use 'http', 'nccl' or 'auto')"
        )
    return requested


def make_transport(
    name: str, fleet: WeightUpdateProtocol | None, dims: ParallelDims, root: Path, master_address: str = ""
) -> Transport:
    """Build the named transport on every trainer rank (collective for http and nccl)."""
    if name == "shm":
        return ShmTransport(fleet, dims, root)
    if name == "http":
        return HttpTransport(fleet, dims)
    if name == "nccl":
        return NcclTransport(fleet, dims, master_address)
    if name == "cuda_ipc":
        return CudaIpcTransport(fleet, dims)
    raise ConfigError(f"weight_sync.transport={name!r} must be one of {list(TRANSPORTS[1:])} after resolution")
