"""Actor weights → fleet after every optimizer step (Megatron shards → HF names → engines).

Flow (all trainer ranks call :meth:`WeightSync.push`):
1. Each PP stage gathers its TP shards (collective over the TP group); the stage owner maps
   them to HF names with the one adapter (``megarl.checkpoint.hf_adapter``).
2. The owner packs HF tensors into ~``bucket_mb`` buckets, never splitting a layer group
   (q/k/v and gate/up stay together).
3. A transport (``megarl.weight_sync.transports``: shm, http, nccl, cuda_ipc — one interface)
   moves the buckets: rank 0 opens the update on every engine (begin), the stage owners send,
   rank 0 has the engines stage and validate (load), then commit. On the fleet's side these
   are the phases of the weight-update protocol (``megarl.fleet.protocol``: all or nothing, a
   dead engine restarted and replayed); here every rank learns rank 0's verdict, so a bucket
   rejected by any engine raises the same ``WeightSyncError`` naming the tensor on every rank.
4. Optional integrity check: engine vs trainer log-probs on a fixed sequence.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, iter_layer_groups
from megarl.checkpoint.hf_io import gather_hf_tensors
from megarl.config import ConfigError
from megarl.data.prompts import RolloutError
from megarl.errors import WeightSyncError
from megarl.fleet.fleet import Fleet
from megarl.model.builder import Model
from megarl.weight_sync.transports import Transport, bucket_bytes, make_transport, resolve_transport

log = logging.getLogger("megarl.sync")


def pack_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy packing of whole layer groups into buckets of about ``bucket_bytes``."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for group in iter_layer_groups(named):
        gbytes = sum(t.numel() * t.element_size() for _, t in group)
        if cur and size + gbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.extend(group)
        size += gbytes
    if cur:
        buckets.append(cur)
    return buckets


class WeightSync:
    """Push the actor's weights to the fleet through one transport (chosen once, here).

    ``transport``: a name from ``weight_sync.transport`` ('auto' is resolved on rank 0 from
    where the engines are) or a ready :class:`Transport`. ``root``: where the shm transport
    writes; default the fleet's private staging folder (the only one its engines read),
    announced by rank 0. The constructor is a collective.
    """

    def __init__(
        self,
        model: Model,
        adapter: LlamaQwen2Adapter,
        fleet: Fleet | None,
        bucket_mb: float,
        root: Path | None = None,
        transport: str | Transport = "shm",
    ) -> None:
        self.model, self.adapter, self.fleet = model, adapter, fleet
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        name, staging = self._resolve(transport if isinstance(transport, str) else "")
        if name == "shm" and root is None and not staging:
            raise ConfigError("weight_sync.transport='shm' without a fleet staging folder needs an explicit root")
        self.root = root or Path(staging)
        if isinstance(transport, str):
            transport = make_transport(name, fleet, model.dims, self.root)
        self.transport: Transport = transport

    def _resolve(self, requested: str) -> tuple[str, str]:
        """Rank 0 knows the fleet: it decides the transport and names the staging folder;
        every rank gets the same answer (or error)."""
        answer: list[Any] = [None]
        if self.model.dims.is_rank0:
            try:
                fleet = self.fleet
                local = fleet is None or all(e.launch for e in fleet.engines)
                addresses = [] if fleet is None else [e.address for e in fleet.engines]
                staging = "" if fleet is None or fleet.staging_dir is None else str(fleet.staging_dir)
                if requested:  # a name to resolve ('' for a ready transport)
                    requested = resolve_transport(requested, addresses, local, has_staging=bool(staging))
                answer = [("ok", requested, staging)]
            except ConfigError as err:
                answer = [("error", str(err), "")]
        dist.broadcast_object_list(answer, src=0)
        kind, value, staging = answer[0]
        if kind == "error":
            raise ConfigError(value)
        if self.model.dims.is_rank0:
            log.info("weight sync transport: %s (staging folder %s)", value, staging or "none")
        return str(value), str(staging)

    def push(self, version: int) -> dict[str, float]:
        """Collective over all trainer ranks. Returns timings (rank 0) in seconds."""
        dims, tr = self.model.dims, self.transport
        t0 = time.perf_counter()
        named = gather_hf_tensors(self.model, self.adapter, device=tr.device)
        t_gather = time.perf_counter() - t0
        buckets = pack_buckets(named, self.bucket_bytes) if dims.is_stage_owner else []
        nbytes = sum(bucket_bytes(b) for b in buckets)
        begun = self._rank0(lambda: tr.begin(version))
        if tr.send_needs_begin:  # every rank stops here if the engines could not begin
            self._agree(begun, version, committed=None)
        receipt, error = None, ""
        try:
            receipt = tr.send(version, buckets)
        except WeightSyncError as err:
            error = str(err)
        t_send = time.perf_counter() - t0 - t_gather
        gathered: list[Any] = [(receipt, error, nbytes)]
        if dims.pp > 1:  # other stages' owners sent too: rank 0 loads their receipts
            gathered = [None] * dims.world_size
            dist.all_gather_object(gathered, (receipt, error, nbytes))
        stats = {"gather_s": t_gather, "write_s": t_send}
        if dims.is_rank0:
            t1 = time.perf_counter()
            errors = [e for e in [begun, *(e for _, e, _ in gathered)] if e]
            error = errors[0] if errors else self._rank0(lambda: self._finish(version, [r for r, _, _ in gathered]))
            if error:
                error += self._rank0(lambda: tr.abort(version))  # "" unless restarting a dead engine failed too
            stats["fleet_update_s"] = time.perf_counter() - t1
            stats["bytes"] = float(sum(b for _, _, b in gathered))
        self._agree(error, version, committed=True)
        stats["total_s"] = time.perf_counter() - t0
        return stats

    def _finish(self, version: int, receipts: list[Any]) -> None:
        self.transport.load(version, receipts)
        self.transport.commit(version)

    def _rank0(self, fn: Any) -> str:
        """Run ``fn`` on rank 0; the message of the WeightSyncError it raised (or of the
        RolloutError: an engine that died and could not be restarted), or ''. Every rank
        then raises it (``_agree``) instead of waiting for rank 0 forever."""
        if not self.model.dims.is_rank0:
            return ""
        try:
            fn()
        except WeightSyncError as err:
            return str(err)
        except RolloutError as err:
            return f"weight update: {err}"
        return ""

    def _agree(self, error: str, version: int, committed: bool | None) -> None:
        """Broadcast rank 0's verdict; release local buffers; raise the same error everywhere."""
        flag = torch.tensor([bool(error)])
        dist.broadcast(flag, src=0)  # one collective on the steady path; the message only on failure
        failed = bool(flag.item())
        message: list[Any] = [error]
        if failed:
            dist.broadcast_object_list(message, src=0)
        if committed is not None or failed:
            self.transport.release(version, committed=not failed)
        if failed:
            raise WeightSyncError(message[0] or "weight update failed on rank 0")

    def cleanup(self) -> None:
        """Remove this sync's shm files (the fleet removes the staging folder it made)."""
        if self.transport.name == "shm":
            for vdir in self.root.glob("v*"):
                shutil.rmtree(vdir, ignore_errors=True)


def check_integrity(model: Model, fleet: Fleet | None, tokens: list[int], tol: float) -> float:
    """Max |engine − trainer| log-prob over a fixed sequence, across engines (collective).

    Compared at temperature 1: vLLM's prompt log-probs are raw (pre-temperature), and the
    check tests weights, not sampling. Raises WeightSyncError beyond ``tol``. Returns the
    max difference (on every rank).
    """
    temperature = 1.0
    from megarl.model.forward import forward_logprobs

    t = torch.tensor([tokens], dtype=torch.long)
    lp = forward_logprobs(model, t, micro_batch_size=1, temperature=temperature)["logprobs"][0, :-1]
    diff = torch.zeros(1, dtype=torch.float64)
    if model.dims.is_rank0 and fleet is not None:
        for engine_lp in fleet.logprobs([tokens], temperature):
            e = torch.tensor(engine_lp[0], dtype=torch.float64)
            diff = torch.maximum(diff, (e - lp.double().cpu()).abs().max().reshape(1))
    dist.broadcast(diff, src=0)
    if float(diff) > tol:
        raise WeightSyncError(f"integrity check: engine vs trainer log-prob differ by {float(diff):.3g} > {tol}")
    return float(diff)
