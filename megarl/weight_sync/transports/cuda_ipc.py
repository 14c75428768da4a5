"""``cuda_ipc``: colocated engines open the trainer's GPU buffers without a copy (see
``megarl.weight_sync.transports.nccl`` for the shared JSON announcement and checks)."""

from __future__ import annotations

from typing import Any

import torch

from megarl.distributed import ParallelDims
from megarl.engine import routes, wire
from megarl.fleet.protocol import Replay, WeightUpdateProtocol
from megarl.weight_sync.transports.base import Bucket, FleetPhases, cannot_replay, check_all, need_cuda


class CudaIpcTransport(FleetPhases):
    name = "cuda_ipc"
    device = "cuda"

    def __init__(self, fleet: WeightUpdateProtocol | None, dims: ParallelDims) -> None:
        need_cuda(self.name)
        self.fleet, self.dims = fleet, dims
        self._buffers: list[torch.Tensor] = []

    def send(self, version: int, buckets: list[Bucket]) -> list[dict[str, Any]]:
        out = []
        for bucket in buckets:
            buf, records = wire.flatten(bucket)
            self._buffers.append(buf)  # alive until release(), i.e. after commit
            out.append({"handle": wire.share_cuda(buf), "tensors": records})
        torch.cuda.synchronize()  # the engines read these buffers from other processes
        return out

    def load(self, version: int, receipts: list[Any]) -> None:
        if self.fleet is None:
            return
        shared = [item for per_rank in receipts for item in per_rank or []]
        check_all(self.fleet, version, [r for item in shared for r in item["tensors"]])
        for item in shared:
            self.fleet.post_all(routes.IPC_LOAD, {"version": version, **item}, version)

    def replay(self, version: int) -> Replay:
        return cannot_replay("the cuda_ipc transport shares buffers only until commit (use shm)")

    def release(self, version: int, committed: bool) -> None:
        self._buffers = []
        torch.cuda.empty_cache()
