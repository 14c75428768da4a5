"""What every weight-sync transport shares: the :class:`Transport` interface (the phases
``WeightSync`` drives), the bucket type, and :class:`FleetPhases` — each transport's begin /
commit / abort, which are the fleet's open / close / cancel of the weight-update protocol
(``megarl.fleet.protocol``, the one place its phases and invariants are written) — that each
transport builds on (one file per transport beside this one)."""

from __future__ import annotations

import ipaddress
import socket
from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch

from megarl.config import ConfigError
from megarl.engine import routes
from megarl.errors import RolloutError
from megarl.fleet.client import EngineClient
from megarl.fleet.protocol import Replay, WeightUpdateProtocol

Bucket = list[tuple[str, torch.Tensor]]
"""HF-named tensors sent together; a layer group (q/k/v, gate/up) never spans two buckets."""


class Transport(Protocol):
    name: str
    device: str
    """Where the gathered tensors should be: 'cpu' (serialised) or 'cuda' (sent from GPU)."""
    send_needs_begin: bool
    """``send`` reaches the engines (or is a trainer collective), so every rank must know that
    rank 0's begin succeeded before any sends; False: ``send`` only writes locally (shm), and
    a failed begin is reported with the rest of the update."""
    updates_joining_engines: bool
    """Every update carries every weight through the fleet rank 0 holds, so an engine restarted
    in the background is brought up to date by the next update alone (``Fleet.members``)."""

    def begin(self, version: int) -> None: ...
    def send(self, version: int, buckets: list[Bucket]) -> Any: ...
    def load(self, version: int, receipts: list[Any]) -> None: ...
    def commit(self, version: int) -> None: ...
    def abort(self, version: int) -> None: ...
    def release(self, version: int, committed: bool) -> None: ...


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


def bucket_bytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def cannot_replay(reason: str) -> Replay:
    def replay(engines: list[EngineClient]) -> None:
        names = ", ".join(e.name for e in engines)
        raise RolloutError(f"restarted {names} cannot be given the current weights: {reason}")

    return replay


class FleetPhases(ABC):
    """begin / commit / abort shared by every transport (rank 0 holds the fleet; elsewhere
    ``fleet`` is None and they do nothing): the protocol's open / close / cancel.

    Engine deaths: one found dead before the update is restarted at the previous version
    (``recover`` in open); one that dies during it is left out of the rest of it and
    restarted after commit, replaying this version (or after abort, the previous one)."""

    fleet: WeightUpdateProtocol | None
    send_needs_begin = True
    updates_joining_engines = False

    def begin(self, version: int) -> None:
        if self.fleet is not None:
            self.fleet.open_update(version)

    def commit(self, version: int) -> None:
        if self.fleet is not None:
            self.fleet.close_update(version, self.replay(version))

    def abort(self, version: int) -> None:
        if self.fleet is not None:
            self.fleet.cancel_update()

    @abstractmethod
    def replay(self, version: int) -> Replay:
        """How a restarted engine gets the weights of ``version`` once it is committed (or the
        error saying why it cannot)."""


def need_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        raise ConfigError(f"weight_sync.transport={name!r} needs CUDA; use 'shm' or 'http' on CPU")


def check_all(fleet: WeightUpdateProtocol, version: int, records: list[dict[str, Any]]) -> None:
    body = {"tensors": [{k: r[k] for k in ("name", "shape", "dtype")} for r in records]}
    fleet.post_all(routes.CHECK, body, version)
