"""``http``: each bucket's safetensors bytes as a request body (``/weights/load_bytes``):
engines anywhere the trainer can reach; the bytes are kept to replay into a restarted engine."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megarl.distributed import ParallelDims
from megarl.fleet.client import EngineClient
from megarl.fleet.fleet import Fleet
from megarl.fleet.protocol import Replay, WeightUpdateProtocol
from megarl.weight_sync.transports.base import Bucket, FleetPhases, cannot_replay


class HttpTransport(FleetPhases):
    """Each stage owner POSTs every bucket's safetensors bytes to every engine
    (``/weights/load_bytes``, application/octet-stream): works for engines on other hosts,
    which cannot read this host's /dev/shm. Stage owners other than rank 0 reach the engines
    directly (their addresses are broadcast once, here: the constructor is a collective)."""

    name = "http"
    device = "cpu"

    def __init__(self, fleet: WeightUpdateProtocol | None, dims: ParallelDims) -> None:
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
        self.poster: WeightUpdateProtocol | None = fleet
        self.fleet = fleet if dims.is_rank0 else None
        # A restarted local engine replays the last update from these bytes (rank 0's stage).
        self._keep = dims.is_rank0 and fleet is not None and any(e.launch for e in fleet.engines)
        self._kept: list[bytes] = []
        # other stage owners post to the addresses they were given: only rank 0 knows who joins
        self.updates_joining_engines = dims.pp == 1

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

    def replay(self, version: int) -> Replay:
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
