"""CUDA transports: NCCL broadcast to the engine workers, CUDA IPC to colocated engines.

Both send each bucket as one flat uint8 buffer on the GPU (``wire.flatten``) and announce
its tensors (name, shape, dtype, byte offset) as JSON first: every engine checks the whole
update's names/shapes/dtypes (``/weights/check``) before any data moves, so a mismatch is
rejected by name while nothing is in flight. Workers stage what they receive and check it
is finite; commit applies it in one ``reload_weights`` (``megarl.engine.worker_ext``).

* ``nccl`` follows vLLM's RLHF recipe (examples/offline_inference/rlhf_utils.py, as verl and
  OpenRLHF do): a ``StatelessProcessGroup`` + ``PyNcclCommunicator`` made of the trainer's
  rank 0 (rank 0 of the group, hosting the rendezvous store) and every engine worker
  (``/weights/nccl_init`` with its ``rank_offset``). Per bucket, rank 0 POSTs
  ``/weights/nccl_load`` and broadcasts concurrently. Other PP stage owners hand their
  buckets to rank 0 point-to-point over the trainer's own group first. Engine workers hold
  the received buffers until commit (one extra copy of the weights on the engine GPUs).
* ``cuda_ipc`` (colocated engines): every stage owner shares its buffers
  (``reduce_tensor`` → JSON, ``wire.share_cuda``); rank 0 POSTs the handles; workers open
  them without a copy. The buffers stay alive on the trainer until commit has returned.

Neither can replay weights into a restarted engine (the NCCL group / the buffers are gone):
the fleet then reports the restart as an error instead of serving stale weights.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from megarl.distributed import ParallelDims
from megarl.engine import routes, wire
from megarl.errors import RolloutError, WeightSyncError
from megarl.fleet.client import EngineClient, free_port
from megarl.fleet.protocol import Replay, WeightUpdateProtocol
from megarl.weight_sync.transports.base import (
    Bucket,
    FleetPhases,
    cannot_replay,
    check_all,
    is_local_address,
    need_cuda,
)


class NcclTransport(FleetPhases):
    name = "nccl"
    device = "cuda"

    def __init__(self, fleet: WeightUpdateProtocol | None, dims: ParallelDims, master_address: str = "") -> None:
        need_cuda(self.name)
        self.fleet, self.dims = fleet, dims
        self.master_address = master_address
        self.group: Any = None

    def begin(self, version: int) -> None:
        if self.fleet is not None and self.group is None:
            self._join(self.fleet)
        super().begin(version)

    def _join(self, fleet: WeightUpdateProtocol) -> None:
        """Form the broadcast group: rank 0 = this trainer rank, then each engine's workers."""
        from megarl.engine.worker_ext import nccl_group

        tps = fleet.engine_tps()
        world = 1 + sum(tps)
        address = self.master_address or (
            "127.0.0.1"
            if all(is_local_address(e.address) for e in fleet.engines)
            else socket.gethostbyname(socket.gethostname())
        )
        port = free_port()
        offsets = [1 + sum(tps[:i]) for i in range(len(tps))]

        def init(e: EngineClient, offset: int) -> dict[str, Any]:
            body = {"master_address": address, "master_port": port, "rank_offset": offset, "world_size": world}
            return e.post(routes.NCCL_INIT, body, fleet.timeout)

        # The engines block in their rendezvous until rank 0 (this process) joins too.
        with ThreadPoolExecutor(max_workers=len(fleet.engines)) as pool:
            futures = [pool.submit(init, e, off) for e, off in zip(fleet.engines, offsets)]
            self.group = nccl_group(address, port, 0, world, torch.device("cuda", torch.cuda.current_device()))
            try:
                for f in futures:
                    f.result()
            except RolloutError as err:
                raise WeightSyncError(f"NCCL weight group ({address}:{port}, world {world}) failed: {err}") from err

    def send(self, version: int, buckets: list[Bucket]) -> None:
        """Collective: stage owners relay their flat buffers to rank 0, which broadcasts them."""
        flats = [wire.flatten(b) for b in buckets]
        mine = [(records, int(buf.numel())) for buf, records in flats]
        everyone: list[Any] = [None] * self.dims.world_size
        dist.all_gather_object(everyone, mine)
        if not self.dims.is_rank0:
            for buf, _ in flats:
                dist.send(buf, dst=0)
            return
        error = ""
        if self.fleet is not None:
            try:
                check_all(self.fleet, version, [r for per_rank in everyone for recs, _ in per_rank for r in recs])
            except WeightSyncError as err:
                error = str(err)
        for src, per_rank in enumerate(everyone):
            for k, (records, nbytes) in enumerate(per_rank):
                if src == 0:
                    buf = flats[k][0]
                else:  # always drain the senders, even after an error, so no rank is left blocked
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
                    dist.recv(buf, src=src)
                if not error and self.fleet is not None:
                    try:
                        self._broadcast(self.fleet, version, buf, records)
                    except WeightSyncError as err:
                        error = str(err)
        if error:
            raise WeightSyncError(error)

    def _broadcast(
        self, fleet: WeightUpdateProtocol, version: int, buf: torch.Tensor, records: list[dict[str, Any]]
    ) -> None:
        body = {"version": version, "tensors": records, "nbytes": int(buf.numel())}
        with ThreadPoolExecutor(max_workers=1) as pool:
            # the engines' workers wait in the matching broadcast while this request runs
            pending = pool.submit(fleet.post_all, routes.NCCL_LOAD, body, version)
            self.group.broadcast(buf, src=0, stream=torch.cuda.current_stream())
            torch.cuda.current_stream().synchronize()
            pending.result()

    def load(self, version: int, receipts: list[Any]) -> None:
        """Everything was broadcast during send."""

    def replay(self, version: int) -> Replay:
        return cannot_replay("the nccl transport keeps no copy of the weights (use shm or http)")

    def release(self, version: int, committed: bool) -> None:
        torch.cuda.empty_cache()
