"""Which rows of a global batch a data-parallel rank trains on."""

from __future__ import annotations

from megarl.distributed import ParallelDims


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
