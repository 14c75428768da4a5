"""megatron-core's uneven first-dimension collectives on gloo.

Under sequence parallelism with expert parallelism (TP > 1, EP > 1) megatron's alltoall token
dispatcher all-gathers each rank's tokens over the expert-TP group and reduce-scatters them back
(``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` with split sizes):
the TP ranks hold different numbers of tokens for this EP rank's experts, so the parts are
uneven. NCCL takes uneven ``all_gather`` / ``reduce_scatter`` lists; gloo refuses them
("ProcessGroupGloo::allgather: invalid tensor size"). -> :func:`install` routes the uneven case
through even collectives: the gather pads every part to the largest and cuts the padding off;
the reduce-scatter all-reduces the whole tensor and keeps this rank's part (same sums: every
element is added over the same ranks). The even case, and every other caller, runs megatron's
own code. Both are differentiable the way megatron's are: they are called inside its autograd
functions, each the other's backward.

Idempotent; installed on gloo only (``megarl.distributed``). Tested in
``tests/compat/test_gloo.py`` on two ranks, and end to end by the TP 2 × EP 2 step of
``tests/model/test_moe.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_original: dict[str, Any] = {}


def gather_uneven(part: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """All-gather along dim 0 where rank r holds ``sizes[r]`` rows: the parts in rank order."""
    most = max(sizes)
    padded = part.new_zeros((most, *part.shape[1:]))
    padded[: part.shape[0]] = part
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


def reduce_scatter_uneven(whole: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """Reduce-scatter along dim 0: the sum over ranks of rows ``sizes[:r]`` … of rank r's part."""
    total = whole.contiguous().clone()
    dist.all_reduce(total, group=group)
    start = sum(sizes[: group.rank()])
    return total[start : start + sizes[group.rank()]].clone()


def _uneven(sizes: list[int] | None, group: Any) -> bool:
    return sizes is not None and group is not None and group.size() > 1 and len(set(sizes)) > 1


def _gather_along_first_dim(
    input_: torch.Tensor, group: Any, output_split_sizes: list[int] | None = None, use_global_buffer: bool = False
) -> torch.Tensor:
    if _uneven(output_split_sizes, group):
        return gather_uneven(input_.contiguous(), list(output_split_sizes or []), group)
    return _original["gather"](input_, group, output_split_sizes, use_global_buffer)  # type: ignore[no-any-return]


def _reduce_scatter_along_first_dim(
    input_: torch.Tensor, group: Any, input_split_sizes: list[int] | None = None, use_global_buffer: bool = False
) -> torch.Tensor:
    if _uneven(input_split_sizes, group):
        return reduce_scatter_uneven(input_, list(input_split_sizes or []), group)
    return _original["reduce_scatter"](input_, group, input_split_sizes, use_global_buffer)  # type: ignore[no-any-return]


def install() -> bool:
    """Apply the patch above; True if it was applied now (False: already installed)."""
    if _original:
        return False
    from megatron.core.tensor_parallel import mappings

    _original["gather"] = mappings._gather_along_first_dim
    _original["reduce_scatter"] = mappings._reduce_scatter_along_first_dim
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim
    return True
