"""What megatron's schedules cut into micro-batches: a batch of rows.

A batch is either a typed record of per-row tensors with a row-selection method
(:class:`RowRecord`, e.g. ``megarl.types.UpdateRows``: the RL update) or a plain dict of
tensors keyed by name (forward-only passes, supervised steps, tests and tools). Either way
every tensor's first dimension is the row; per-token tensors are (n, S, ...), per-row (n,).
The functions here cut both kinds alike, so a micro-batch is the same kind as its batch.
"""

from __future__ import annotations

from typing import Any, Protocol, Self, TypeVar, cast

import torch

from megarl.model.microbatch import MicroBatch, take


class RowRecord(Protocol):
    """A typed batch of rows that the schedules can cut."""

    @property
    def tokens(self) -> torch.Tensor: ...  # (n, S) long, the model's input

    def select(self, index: slice | torch.Tensor) -> Self: ...  # the rows ``index`` of every field

    def narrow(self, width: int) -> Self: ...  # per-token fields cut to ``width`` columns


Rows = TypeVar("Rows", bound=RowRecord | dict[str, torch.Tensor])


def tokens_of(batch: RowRecord | dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's (n, S) tokens."""
    return batch["tokens"] if isinstance(batch, dict) else batch.tokens


def routes_of(batch: RowRecord | dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The batch's (n, S, L, k) expert routes to replay (``megarl.model.routes``), if it has them."""
    return batch.get("routes") if isinstance(batch, dict) else getattr(batch, "routes", None)


def select_rows(batch: Rows, index: slice | torch.Tensor) -> Rows:
    """The rows ``index`` of every tensor of ``batch``."""
    if isinstance(batch, dict):
        return cast(Rows, {k: v[index] for k, v in batch.items()})
    return cast(Rows, cast(Any, batch).select(index))


def take_rows(batch: Rows, mb: MicroBatch) -> Rows:
    """The micro-batch's rows, per-token tensors cut to its width; per-row tensors kept."""
    if isinstance(batch, dict):
        return cast(Rows, take(batch, mb))
    return cast(Rows, cast(Any, batch).select(mb.rows).narrow(mb.width))


def micro_batches(batch: Rows, micro_batch_size: int) -> list[Rows]:
    """Consecutive ``micro_batch_size`` rows at full width."""
    n = tokens_of(batch).shape[0]
    if n % micro_batch_size:
        raise ValueError(f"batch of {n} rows is not divisible by micro_batch_size={micro_batch_size}")
    return [select_rows(batch, slice(i, i + micro_batch_size)) for i in range(0, n, micro_batch_size)]
