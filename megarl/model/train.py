"""One optimizer step of a megatron model: forward and backward through megatron's schedule
(``megarl.model.forward.run_schedule``), the optimizer step, and the loss statistics reduced
exactly over micro-batches, DP ranks and pipeline stages.

The batch is this DP rank's rows (``megarl.model.rows``: a typed record such as
``megarl.types.UpdateRows``, or a dict of tensors); the loss function sees each micro-batch as
the same kind. It returns a loss already divided by its GLOBAL denominator
(``megarl.algo.aggregation``), so the gradients of any split of the rows sum to the full-batch
objective's, and statistics that reduce just as exactly: a ``megarl.types.LossTerms`` record
(sums, and maxima where its fields say so) or a dict of sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist

from megarl.distributed import ParallelDims
from megarl.model.builder import Model
from megarl.model.forward import model_logits, run_schedule
from megarl.model.microbatch import MicroBatch
from megarl.model.packing import packings_of
from megarl.model.router_loss import scale_router_losses
from megarl.model.rows import Rows, micro_batches, take_rows
from megarl.types import LossTerms

Terms = TypeVar("Terms", bound=LossTerms)


@overload
def train_step(
    model: Model,
    batch: Rows,
    loss_fn: Callable[[Rows, torch.Tensor], tuple[torch.Tensor, Terms]],
    *,
    micro_batch_size: int,
    lr: float | None = None,
    value_model: bool = False,
    groups: list[MicroBatch] | None = None,
) -> tuple[Terms, float]: ...


@overload
def train_step(
    model: Model,
    batch: Rows,
    loss_fn: Callable[[Rows, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    *,
    micro_batch_size: int,
    lr: float | None = None,
    value_model: bool = False,
    groups: list[MicroBatch] | None = None,
) -> tuple[dict[str, float], float]: ...


def train_step(
    model: Model,
    batch: Any,
    loss_fn: Callable[[Any, torch.Tensor], tuple[torch.Tensor, Any]],
    *,
    micro_batch_size: int,
    lr: float | None = None,
    value_model: bool = False,
    groups: list[MicroBatch] | None = None,
) -> tuple[Any, float]:
    """One optimizer step over ``batch`` (this DP rank's rows). Returns (stats, grad_norm).

    Micro-batches: consecutive ``micro_batch_size`` rows at full width, or the given
    ``groups`` (token-budget micro-batches, ``megarl.model.microbatch``), each cut to its width
    (and run packed when the group carries its rows' lengths).

    ``loss_fn(micro_batch, logits_or_values)`` returns a loss already divided by its global
    denominator and its statistics, which are reduced over micro-batches here and over DP
    ranks (all-reduce), then shared over the pipeline (:func:`reduce_stats`): a
    :class:`~megarl.types.LossTerms` record comes back as the same record of () float64
    tensors, a dict of tensors (all sums) as a dict of floats.
    """

    def schedule_loss(mb: Any, out: torch.Tensor) -> tuple[Any, ...]:
        loss, stats = loss_fn(mb, model_logits(model, out) if not value_model else out)
        return loss, torch.tensor(1), _detached(stats)

    mbs = micro_batches(batch, micro_batch_size) if groups is None else [take_rows(batch, mb) for mb in groups]
    model.module.train()
    model.module.zero_grad_buffer()  # type: ignore[operator]
    model.optimizer.zero_grad()
    if lr is not None:
        for group in model.optimizer.param_groups:
            group["lr"] = lr
    packings = None if groups is None else packings_of(groups)
    scale_router_losses(model, mbs, packings)
    store = run_schedule(model, mbs, schedule_loss, False, packings)
    ok, grad_norm, _ = model.optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped (non-finite gradients)")
    return reduce_stats(store, model.dims), float(grad_norm or 0.0)


def _detached(stats: Any) -> Any:
    """The statistics without autograd history (megatron keeps them until the step ends)."""
    if isinstance(stats, dict):
        return {k: v.detach() for k, v in stats.items()}
    return dataclasses.replace(stats, **{name: v.detach() for name, v, _ in stats.present()})


def _layout(stats: LossTerms | dict[str, torch.Tensor]) -> list[tuple[str, bool]]:
    """(name, reduces by maximum) of each statistic: a record's present fields in order, a
    dict's keys sorted (all sums)."""
    if isinstance(stats, dict):
        return [(k, False) for k in sorted(stats)]
    return [(name, is_max) for name, _, is_max in stats.present()]


def _value(stats: LossTerms | dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return stats[name] if isinstance(stats, dict) else getattr(stats, name)


def reduce_stats(store: list[Any], dims: ParallelDims) -> Any:
    """The micro-batches' statistics (``store``, on the last stage) reduced into the update's:
    summed — or maximised, for a record's maximum fields — over micro-batches and the DP
    group of the last stage in float64, then broadcast over the pipeline so every rank
    returns the same. An empty store (no statistics) gives {}."""
    result: Any = {}
    if dims.is_last_stage and store:
        first, layout = store[0], _layout(store[0])
        # on the model's device: NCCL groups (CUDA) refuse CPU tensors
        sums = torch.zeros(len(layout) + 1, dtype=torch.float64, device=dims.device)
        maxes = torch.full((len(layout) + 1,), -float("inf"), dtype=torch.float64, device=dims.device)
        for d in store:
            for i, (name, is_max) in enumerate(layout):
                v = _value(d, name).double()
                if is_max:
                    maxes[i] = torch.maximum(maxes[i], v.max())
                else:
                    sums[i] += v.sum()
        dist.all_reduce(sums, group=dims.dp_group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=dims.dp_group)
        values = {name: float(maxes[i] if is_max else sums[i]) for i, (name, is_max) in enumerate(layout)}
        if isinstance(first, dict):
            result = values
        else:
            reduced = {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
            result = dataclasses.replace(first, **reduced)
    if dims.pp > 1:
        obj = [result]
        dist.broadcast_object_list(obj, src=dist.get_process_group_ranks(dims.pp_group)[-1], group=dims.pp_group)
        result = obj[0]
    return result
