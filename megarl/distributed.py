"""Process-group setup: the ONLY module that touches torch.distributed init and megatron's
``parallel_state``.

:func:`init_distributed` starts torch.distributed (gloo on CPU, nccl on GPU), builds
megatron's TP/PP/DP groups (and EP: expert parallelism over DP ranks, expert TP = TP) and
seeds the RNGs, then returns a :class:`ParallelDims` that is
passed down explicitly. Nothing else in megarl reads ``parallel_state`` directly.

:func:`init_layout` builds a second, independent layout over the same ranks (the PPO
critic's own TP/PP/DP). Its groups live only in its :class:`ParallelDims` (``pgs``, a
megatron ``ProcessGroupCollection``), which megarl passes explicitly to every megatron
object and call of that model (GPTModel, DDP, optimizer, schedules, grad finalisation,
sharded state dicts), so megatron's global ``parallel_state`` keeps describing the actor.
Invariants: every rank calls :func:`init_layout` with the same arguments (group creation is
collective); a layout equal to the global one returns the global :class:`ParallelDims`
itself; rank order is megatron's (``tp-cp-ep-dp-pp``, TP fastest), from megatron's own
``RankGenerator``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.compat import cpu as cpu_compat
from megarl.compat import gloo as gloo_compat
from megarl.compat import megatron_moe


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
    pgs: Any
    """megatron ``ProcessGroupCollection`` of this layout, passed to every megatron object of
    a model on it (the groups above plus the embedding / context / expert groups)."""
    global_layout: bool
    """These are megatron's global ``parallel_state`` groups (False: an :func:`init_layout`)."""
    ep: int = 1
    """Expert-parallel size: each MoE layer's experts are split over the ``ep_group``'s ranks."""
    ep_rank: int = 0
    """This rank's index in its expert-parallel group: it holds global experts
    ``ep_rank × local … (ep_rank + 1) × local − 1`` (local = num_experts / ep)."""
    ep_group: Any = None
    """Expert-parallel group: ranks of one PP stage that hold different experts (at etp = tp:
    consecutive DP ranks of one TP rank in megatron's order; at etp < tp: ranks etp apart,
    spanning the TP group first); None when ep = 1."""
    etp: int = 0
    """Expert tensor-parallel size: each expert is split over this many ranks (0: ``tp``, the
    experts split like a dense MLP; 1: every TP rank holds its experts whole; a divisor of
    ``tp`` between: each expert split over ``etp`` consecutive TP ranks)."""
    etp_rank: int = 0
    """This rank's index in its expert-TP group (megatron's expert tensor-parallel rank): the
    shard of each expert it holds (= ``tp_rank`` at etp 0, 0 at etp 1)."""
    etp_group: Any = None
    """Expert tensor-parallel group (the ranks holding the shards of the same experts), set
    only when 1 < etp < tp: at etp 0 the experts travel with the dense shards over ``tp_group``."""

    @property
    def expert_tp(self) -> int:
        """The experts' TP size (``etp``, 0 resolved to ``tp``)."""
        return self.etp or self.tp

    def tp_of(self, expert: bool) -> tuple[int, int]:
        """(TP size, this rank's TP index) a parameter is split by: an expert's at etp ≠ 0 is
        (etp, etp_rank) (at etp 1: (1, 0)), every other (tp, tp_rank)."""
        return (self.etp, self.etp_rank) if expert and self.etp else (self.tp, self.tp_rank)

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


def init_distributed(tp: int, pp: int, seed: int, timeout_s: int = 600, *, ep: int = 1, etp: int = 0) -> ParallelDims:
    """Initialise torch.distributed + megatron parallel groups for this process; ``ep``: expert
    parallelism (EP must divide world / (TP × PP)); ``etp``: expert tensor parallelism, 0 (= TP),
    1 (experts whole on every TP rank) or a divisor of TP (each expert split over that many
    consecutive TP ranks)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_compat.install()
        gloo_compat.install()  # uneven all-gather / reduce-scatter (SP × EP token dispatch)
    megatron_moe.install()
    if not dist.is_initialized():
        # On CUDA both backends: megatron's and megarl's groups (backend=None) then carry GPU
        # tensors over NCCL and the small CPU tensors megarl broadcasts and reduces (rollout
        # batches, plan timings, checkpoint agreement) over gloo; NCCL alone refuses CPU tensors.
        backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" not in os.environ and "MASTER_PORT" not in os.environ:
            # one process, not launched: an in-process store, no TCP port. (A fixed default port
            # made two single-rank runs on one machine collide at start-up.)
            os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")  # ranks started without torchrun must agree on one
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            dist.init_process_group(backend=backend, timeout=timeout)
    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(f"world size {world} is not divisible by tensor_parallel×pipeline_parallel={tp * pp}")
    if (world // (tp * pp)) % ep:
        raise ValueError(f"expert_parallel={ep} does not divide the data-parallel size {world // (tp * pp)}")
    if etp < 0 or (etp and tp % etp):
        raise ValueError(f"expert_tensor_parallel={etp} must be 0 or divide tensor_parallel={tp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or tp,
        create_gloo_process_groups=use_cuda,
    )
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    if use_cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.model_parallel_cpu_manual_seed(seed, tp_rank, ep_rank, ps.get_expert_tensor_parallel_rank())
    from megatron.core.process_groups_config import ProcessGroupCollection

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
        # exactly the groups megatron objects pick up when given no collection
        pgs=ProcessGroupCollection.use_mpu_process_groups(),
        global_layout=True,
        ep=ep,
        ep_rank=ep_rank,
        ep_group=ps.get_expert_model_parallel_group() if ep > 1 else None,
        etp=0 if etp == tp else etp,
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_group=ps.get_expert_tensor_parallel_group() if 1 < etp < tp else None,
    )


def layout_ranks(world: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Global ranks of every TP / PP / DP / model-parallel (TP×PP) group of a TP×PP×DP layout
    of ``world`` ranks, in megatron's order (its ``RankGenerator``, ``tp-cp-ep-dp-pp``)."""
    from megatron.core.parallel_state import RankGenerator

    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tensor_parallel×pipeline_parallel={tp}×{pp}")
    gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    return {
        "tp": gen.get_ranks("tp"),
        "pp": gen.get_ranks("pp"),
        "dp": gen.get_ranks("dp"),
        "mp": gen.get_ranks("tp-pp"),
    }


def _new_groups(rank_lists: list[list[int]]) -> Any:
    """Collective: one group per rank list (every rank creates all of them, same order);
    returns this rank's group, or None if it is in none."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def init_layout(base: ParallelDims, tp: int, pp: int) -> ParallelDims:
    """A second parallel layout (TP × PP, DP = world / (TP × PP)) over ``base``'s ranks.

    Collective over all ranks. Returns ``base`` itself when ``(tp, pp)`` is its layout.
    Context and expert parallelism are 1 in both layouts (a ``base`` with EP > 1 is refused),
    so the size-1 CP / EP groups, and
    the one distributed-optimizer instance group (all ranks), are shared with ``base``.
    """
    if (tp, pp) == (base.tp, base.pp):
        return base
    if base.ep > 1 or base.etp:
        raise ValueError(
            f"a second layout TP×PP={tp}×{pp} beside expert parallelism EP={base.ep}, ETP={base.expert_tp} "
            f"(TP={base.tp}) is not supported: "
            "give the critic the actor's layout"
        )
    from megatron.core.process_groups_config import ProcessGroupCollection

    world, rank = base.world_size, base.rank
    ranks = layout_ranks(world, tp, pp)
    tp_group = _new_groups(ranks["tp"])
    pp_group = _new_groups(ranks["pp"])
    dp_group = _new_groups(ranks["dp"])
    mp_group = _new_groups(ranks["mp"])
    # word embeddings live on the first and last stage (tied-weight grads are summed there)
    embd_group = _new_groups([[r[0], r[-1]] for r in ranks["pp"]]) if pp > 1 else base.pgs.cp
    pp_ranks = next(r for r in ranks["pp"] if rank in r)
    tp_ranks = next(r for r in ranks["tp"] if rank in r)
    dp_ranks = next(r for r in ranks["dp"] if rank in r)
    g = base.pgs
    pgs = ProcessGroupCollection(
        tp=tp_group,
        pp=pp_group,
        mp=mp_group,
        embd=embd_group,
        pos_embd=g.cp,  # no learned position embeddings (RoPE): a size-1 group skips its all-reduce
        cp=g.cp,
        tp_cp=tp_group,
        dp=dp_group,
        dp_cp=dp_group,
        intra_dp_cp=dp_group,
        expt_dp=dp_group,
        intra_expt_dp=dp_group,
        ep=g.ep,
        expt_tp=tp_group,
        tp_ep=tp_group,
        tp_ep_pp=mp_group,
        intra_dist_opt=g.intra_dist_opt,
    )
    return ParallelDims(
        world_size=world,
        rank=rank,
        tp=tp,
        pp=pp,
        dp=world // (tp * pp),
        tp_rank=tp_ranks.index(rank),
        pp_rank=pp_ranks.index(rank),
        dp_rank=dp_ranks.index(rank),
        tp_group=tp_group,
        pp_group=pp_group,
        dp_group=dp_group,
        mp_group=mp_group,
        device=base.device,
        pgs=pgs,
        global_layout=False,
    )


@contextlib.contextmanager
def layout_rng(dims: ParallelDims, seed: int) -> Iterator[None]:
    """Megatron's RNG tracker seeded for ``dims``' TP rank while a model of that layout is
    built (weight init forks the tracker's model-parallel stream on GPU; seeding it by the
    global layout's TP rank would give two shards of one weight the same stream). Same
    stream names and seed offsets as ``model_parallel_cuda_manual_seed``; the tracker is
    restored on exit. A no-op for the global layout."""
    if dims.global_layout:
        yield
        return
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    states, seeds = tracker.get_states(), set(tracker.seeds_)
    tracker.reset()
    try:
        tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + dims.tp_rank)
        tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + dims.tp_rank)
        yield
    finally:
        tracker.reset()
        tracker.set_states(states)
        tracker.seeds_ = seeds


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
