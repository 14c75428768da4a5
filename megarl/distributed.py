"""Process-group setup: the ONLY module that touches torch.distributed init and megatron's
``parallel_state``.

:func:`init_distributed` starts torch.distributed (gloo on CPU, nccl on GPU), builds
megatron's TP/PP/DP groups and seeds the RNGs, then returns a :class:`ParallelDims` that is
passed down explicitly. Nothing else in megarl reads ``parallel_state`` directly.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.compat import cpu as cpu_compat


@dataclass(frozen=True)
class ParallelDims:
    """Parallel layout and process groups of this trainer rank."""

    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    mp_group: Any
    """Model-parallel group (TP × PP) of this rank."""
    device: torch.device

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_stage_owner(self) -> bool:
        """The rank of a PP stage that sends that stage's weights (TP rank 0, DP rank 0)."""
        return self.tp_rank == 0 and self.dp_rank == 0


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(tp: int, pp: int, seed: int, timeout_s: int = 600) -> ParallelDims:
    """Initialise torch.distributed + megatron parallel groups for this process."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_compat.install()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(f"world size {world} is not divisible by tensor_parallel×pipeline_parallel={tp * pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        create_gloo_process_groups=use_cuda,
    )
    tp_rank = ps.get_tensor_model_parallel_rank()
    if use_cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.model_parallel_cpu_manual_seed(seed, tp_rank)
    return ParallelDims(
        world_size=world,
        rank=dist.get_rank(),
        tp=tp,
        pp=pp,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=tp_rank,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        device=torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu"),
    )


def layer_offset(num_layers: int, pp: int, pp_rank: int) -> int:
    """Index of this PP stage's first transformer layer (even split, as megatron's default)."""
    return pp_rank * (num_layers // pp)


def pp_stage_ranks(dims: ParallelDims) -> list[int]:
    """Global ranks of this rank's pipeline group, stage order."""
    return dist.get_process_group_ranks(dims.pp_group)


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
