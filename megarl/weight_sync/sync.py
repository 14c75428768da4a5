"""Actor weights → fleet after every optimizer step (Megatron shards → HF names → engines).

Flow (all trainer ranks call :meth:`WeightSync.push`):
1. Each PP stage gathers its TP shards (collective over the TP group); the stage owner maps
   them to HF names with the one adapter (``megarl.checkpoint.hf_adapter``).
2. The owner packs HF tensors into ~``bucket_mb`` buckets, never splitting a layer group
   (q/k/v and gate/up stay together), and writes each bucket as a safetensors file in
   shared memory (``/dev/shm``) — one memcpy, no per-tensor RPC, no pickle.
3. Rank 0 collects the bucket paths of all stages and drives the fleet:
   begin(version) → load(files) on every engine → commit; a rejected load aborts the
   update everywhere (old version keeps serving) and raises ``WeightSyncError``.
4. Optional integrity probe: engine vs trainer log-probs on a fixed sequence.

GPU transports (NCCL broadcast to engine workers, CUDA IPC when colocated) plug in at
step 2/3 behind the same ``push`` call; ``transport: shm`` is the CPU path.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, iter_layer_groups
from megarl.checkpoint.hf_io import gather_hf_tensors
from megarl.model.builder import Model
from megarl.rollout.fleet import Fleet, WeightSyncError

log = logging.getLogger("megarl.sync")


def shm_root() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return base / f"megarl-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}-{os.getppid()}"


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
    def __init__(
        self, model: Model, adapter: LlamaQwen2Adapter, fleet: Fleet | None, bucket_mb: float, root: Path | None = None
    ) -> None:
        self.model, self.adapter, self.fleet = model, adapter, fleet
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.root = root or shm_root()
        self._prev_dir: Path | None = None

    def push(self, version: int) -> dict[str, float]:
        """Collective over all trainer ranks. Returns timings (rank 0) in seconds."""
        dims = self.model.dims
        t0 = time.perf_counter()
        named = gather_hf_tensors(self.model, self.adapter)
        t_gather = time.perf_counter() - t0
        files: list[str] = []
        nbytes = 0
        vdir = self.root / f"v{version}"
        if dims.is_stage_owner:
            from safetensors.torch import save_file

            vdir.mkdir(parents=True, exist_ok=True)
            for k, bucket in enumerate(pack_buckets(named, self.bucket_bytes)):
                path = vdir / f"stage{dims.pp_rank}_bucket{k}.safetensors"
                save_file(dict(bucket), str(path))
                files.append(str(path))
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        t_write = time.perf_counter() - t0 - t_gather
        all_files: list[Any] = [None] * dims.world_size
        dist.all_gather_object(all_files, (files, nbytes))
        stats = {"gather_s": t_gather, "write_s": t_write}
        error = ""
        if dims.is_rank0 and self.fleet is not None:
            flat = [f for fs, _ in all_files for f in fs]
            total = sum(b for _, b in all_files)
            try:
                stats.update(self.fleet.update_weights(version, flat))
            except WeightSyncError as err:
                error = str(err)
            stats["bytes"] = float(total)
            if not error:
                if self._prev_dir is not None and self._prev_dir != vdir:
                    shutil.rmtree(self._prev_dir, ignore_errors=True)
                self._prev_dir = vdir
        flag: list[Any] = [error]
        dist.broadcast_object_list(flag, src=0)
        if flag[0]:
            shutil.rmtree(vdir, ignore_errors=True) if dims.is_rank0 else None
            raise WeightSyncError(flag[0])
        stats["total_s"] = time.perf_counter() - t0
        return stats

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def probe(model: Model, fleet: Fleet | None, tokens: list[int], tol: float) -> float:
    """Max |engine − trainer| log-prob over a fixed sequence, across engines (collective).

    Compared at temperature 1: vLLM's prompt log-probs are raw (pre-temperature), and the
    probe checks weights, not sampling. Raises WeightSyncError beyond ``tol``. Returns the
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
            diff = torch.maximum(diff, (e - lp.double()).abs().max().reshape(1))
    dist.broadcast(diff, src=0)
    if float(diff) > tol:
        raise WeightSyncError(f"integrity probe: engine vs trainer log-prob differ by {float(diff):.3g} > {tol}")
    return float(diff)
