"""Which rows of a global batch a data-parallel rank trains on, and in which micro-batches."""

from __future__ import annotations

import torch

from megarl.distributed import ParallelDims
from megarl.model.microbatch import MicroBatch, balance_rows, token_budget_split


def dp_rows(
    n: int, micro_batch_size: int, dims: ParallelDims, shares: list[float] | None = None
) -> tuple[slice, list[slice]]:
    """This DP rank's rows of ``n`` (and every rank's), split by ``shares`` in whole
    micro-batches (equal when None). Uneven shares that would leave a rank less than one
    micro-batch fall back to equal rows."""
    dp, mbs = dims.dp, micro_batch_size
    if shares is None or dp == 1:
        counts = [n // dp] * dp
    else:
        chunks = n // mbs
        counts = [max(1, round(s * chunks)) * mbs for s in shares]
        counts[-1] = n - sum(counts[:-1])
        if counts[-1] < mbs or counts[-1] % mbs:
            counts = [n // dp] * dp
    starts = [sum(counts[:i]) for i in range(dp)]
    slices = [slice(s, s + c) for s, c in zip(starts, counts, strict=True)]
    return slices[dims.dp_rank], slices


def update_rows(
    lengths: torch.Tensor,  # (n,) long, columns each row needs (microbatch.row_lengths)
    micro_batch_size: int,
    max_tokens: int,
    dims: ParallelDims,
    shares: list[float] | None = None,
    probed: bool = False,
    pack: bool = False,
    part_rows: int = 0,
) -> tuple[slice | torch.Tensor, list[slice] | list[torch.Tensor], list[MicroBatch] | None]:
    """(this rank's rows, every rank's rows, its micro-batches) of one mini-batch.

    ``max_tokens = 0``: :func:`dp_rows` and fixed micro-batches (None). Otherwise token-budget
    micro-batches over rows balanced by tokens (∝ ``shares``) — except when a grad probe
    measures the update (``probed``): the noise estimate treats each DP rank's rows as a
    random sample of the batch, which a length-balanced split is not, so the rows stay the
    plan's contiguous ones and only the micro-batches follow the budget. A probed update's DP
    shares come in ``part_rows`` (whole GRPO groups in whole micro-batches,
    ``megarl.config.checks.probe_part_rows``; 0: micro-batches), so no rank boundary splits a
    group. ``pack``: the micro-batches run padding-free (``parallel.pack_sequences``)."""
    n = int(lengths.numel())
    unit = part_rows if probed and part_rows else micro_batch_size
    if not max_tokens:
        mine, every = dp_rows(n, unit, dims, shares)
        return mine, every, None
    if probed:
        mine, every = dp_rows(n, unit, dims, shares)
        return mine, every, token_budget_split(lengths[mine], max_tokens, packed=pack)
    parts = balance_rows(lengths, dims.dp, shares if dims.dp > 1 else None)
    rows = parts[dims.dp_rank]
    return rows, parts, token_budget_split(lengths[rows], max_tokens, packed=pack)
