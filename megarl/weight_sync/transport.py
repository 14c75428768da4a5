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
:mod:`megarl.weight_sync.gpu` (``nccl`` broadcast, ``cuda_ipc`` for colocated engines).
``auto`` picks shm when every engine is on this host and reads the run's private staging
folder (engines megarl started; attached ones only with MEGARL_STAGING_DIR), else http
(:func:`resolve_transport`).
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megarl.config import ConfigError
from megarl.distributed import ParallelDims
from megarl.engine.client import EngineClient
from megarl.rollout.data import RolloutError
from megarl.rollout.fleet import Fleet

Bucket = list[tuple[str, torch.Tensor]]
"""HF-named tensors sent together; a layer group (q/k/v, gate/up) never spans two buckets."""


class Transport(Protocol):
    name: str
    device: str
    """Where the gathered tensors should be: 'cpu' (serialised) or 'cuda' (sent from GPU)."""

    def begin(self, version: int) -> None: ...
    def send(self, version: int, buckets: list[Bucket]) -> Any: ...
    def load(self, version: int, receipts: list[Any]) -> None: ...
    def commit(self, version: int) -> None: ...
    def abort(self, version: int) -> None: ...
    def release(self, version: int, committed: bool) -> None: ...


TRANSPORTS = ("auto", "shm", "http", "nccl", "cuda_ipc")


def is_local_address(address: str) -> bool:
    """True if ``host:port`` is on this machine (loopback, or one of this host's addresses)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return False
    if ip.is_loopback:
        return True
    try:
        own = set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        return False
    return str(ip) in own


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
    name: str, fleet: Fleet | None, dims: ParallelDims, root: Path, master_address: str = ""
) -> Transport:
    """Build the named transport on every trainer rank (collective for http and nccl)."""
    if name == "shm":
        return ShmTransport(fleet, dims, root)
    if name == "http":
        return HttpTransport(fleet, dims)
    from megarl.weight_sync.gpu import CudaIpcTransport, NcclTransport

    if name == "nccl":
        return NcclTransport(fleet, dims, master_address)
    if name == "cuda_ipc":
        return CudaIpcTransport(fleet, dims)
    raise ConfigError(f"weight_sync.transport={name!r} must be one of {list(TRANSPORTS[1:])} after resolution")


def bucket_bytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def cannot_replay(reason: str) -> Callable[[list[EngineClient]], None]:
    def replay(engines: list[EngineClient]) -> None:
        names = ", ".join(e.name for e in engines)
        raise RolloutError(f"restarted {names} cannot be given the current weights: {reason}")

    return replay


class _FleetPhases:
    """begin / commit / abort shared by every transport (rank 0 holds the fleet).

    EngineClient deaths: one found dead before the update is restarted at the previous version
    (``Fleet.recover`` in begin); one that dies during it is left out of the rest of it and
    restarted after commit, replaying this version (or after abort, the previous one)."""

    fleet: Fleet | None

    def begin(self, version: int) -> None:
        if self.fleet is not None:
            self.fleet.recover()
            self.fleet.begin_update(version)

    def commit(self, version: int) -> None:
        if self.fleet is not None:
            self.fleet.commit_update(version)
            self.fleet.set_replay(self.replay(version))
            self.fleet.recover()

    def abort(self, version: int) -> None:
        if self.fleet is not None:
            self.fleet.abort_update()
            self.fleet.recover()

    def replay(self, version: int) -> Callable[[list[EngineClient]], None] | None:
        return None


class ShmTransport(_FleetPhases):
    """Each stage owner writes its buckets as safetensors files under ``root`` (/dev/shm):
    one memcpy, no RPC per tensor; engines on this host read them. The last committed
    version's files stay until the next commit, so a restarted engine can replay them."""

    name = "shm"
    device = "cpu"

    def __init__(self, fleet: Fleet | None, dims: ParallelDims, root: Path) -> None:
        self.fleet, self.dims, self.root = fleet, dims, root
        self._files: list[str] = []
        self._prev_dir: Path | None = None

    def send(self, version: int, buckets: list[Bucket]) -> list[str]:
        from safetensors.torch import save_file

        files = []
        vdir = self.root / f"v{version}"
        if buckets:
            vdir.mkdir(parents=True, exist_ok=True)
        for k, bucket in enumerate(buckets):
            path = vdir / f"stage{self.dims.pp_rank}_bucket{k}.safetensors"
            save_file(dict(bucket), str(path))
            files.append(str(path))
        return files

    def load(self, version: int, receipts: list[Any]) -> None:
        self._files = [f for files in receipts for f in files]
        if self.fleet is not None:
            self.fleet.load_files(version, self._files)

    def replay(self, version: int) -> Callable[[list[EngineClient]], None] | None:
        fleet, files = self.fleet, list(self._files)
        assert fleet is not None
        return lambda engines: fleet.update_engines(engines, version, files)

    def release(self, version: int, committed: bool) -> None:
        vdir = self.root / f"v{version}"
        if not committed:
            shutil.rmtree(vdir, ignore_errors=True)
            return
        if self._prev_dir is not None and self._prev_dir != vdir:
            shutil.rmtree(self._prev_dir, ignore_errors=True)
        self._prev_dir = vdir


class HttpTransport(_FleetPhases):
    """Each stage owner POSTs every bucket's safetensors bytes to every engine
    (``/weights/load_bytes``, application/octet-stream): works for engines on other hosts,
    which cannot read this host's /dev/shm. Stage owners other than rank 0 reach the engines
    directly (their addresses are broadcast once, here: the constructor is a collective)."""

    name = "http"
    device = "cpu"

    def __init__(self, fleet: Fleet | None, dims: ParallelDims) -> None:
        self.dims = dims
        info: list[Any] = [None]
        if dims.is_rank0:
            assert fleet is not None
            # the credential travels inside the trainer's own process group, never on a command line
            info = [([e.address for e in fleet.engines], fleet.timeout, fleet.engines[0].token)]
        dist.broadcast_object_list(info, src=0)
        addresses, timeout, token = info[0]
        if fleet is None and dims.is_stage_owner:  # a client of the same engines, no lifecycle
            engines = [EngineClient(f"engine{i}", a, token=token) for i, a in enumerate(addresses)]
            fleet = Fleet(engines, timeout, timeout)
        self.poster = fleet
        self.fleet = fleet if dims.is_rank0 else None
        # A restarted local engine replays the last update from these bytes (rank 0's stage).
        self._keep = dims.is_rank0 and fleet is not None and any(e.launch for e in fleet.engines)
        self._kept: list[bytes] = []

    def send(self, version: int, buckets: list[Bucket]) -> int:
        from safetensors.torch import save

        self._kept = []
        for bucket in buckets:
            data = save(dict(bucket))
            assert self.poster is not None
            self.poster.load_bytes(version, data)
            if self._keep:
                self._kept.append(data)
        return len(buckets)

    def load(self, version: int, receipts: list[Any]) -> None:
        """Nothing left to move: every stage owner already sent its buckets."""

    def replay(self, version: int) -> Callable[[list[EngineClient]], None] | None:
        if self.dims.pp > 1:
            return cannot_replay("with pipeline_parallel > 1 the http transport keeps only stage 0's bytes")
        fleet, blobs = self.fleet, self._kept
        assert fleet is not None

        def replay(engines: list[EngineClient]) -> None:
            try:
                fleet.begin_update(version, engines)
                for data in blobs:
                    fleet.load_bytes(version, data, engines)
            except Exception:
                fleet.abort_update(engines)
                raise
            fleet.commit_update(version, engines)

        return replay

    def release(self, version: int, committed: bool) -> None:
        self._kept = []  # a committed update's bytes live on in the fleet's replay
