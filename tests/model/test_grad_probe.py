"""The grad probe's parts on a stand-in for megatron's grad buffer (single process): each part
is the gradient its micro-batches added to the accumulated buffer, and with
``microbatches_per_part`` = k a part is k consecutive micro-batches — the planner joins
micro-batches that split GRPO groups into runs that hold whole groups (issue #41 D.4). The
real buffers are checked against brute force in ``test_parity.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.distributed import ParallelDims
from megarl.model.grad_stats import GradProbe


def _dims() -> ParallelDims:
    return ParallelDims(world_size=1, rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, tp_group=None,
                        pp_group=None, dp_group=None, mp_group=None, device=torch.device("cpu"), pgs=None,
                        global_layout=False)  # fmt: skip


def _accumulate(probe: GradProbe, grads: list[torch.Tensor]) -> None:
    """What the schedule does: each micro-batch's gradient added to the buffer, the probe told
    before each later micro-batch's forward and before the DP reduce."""
    param = torch.nn.Parameter(torch.zeros(grads[0].numel()))
    param.tensor_model_parallel = True  # type: ignore[attr-defined]  # counted on this rank
    buf = SimpleNamespace(grad_data=torch.zeros(grads[0].numel()), param_index_map={param: (0, param.numel(), 0)})
    ddp = SimpleNamespace(buffers=[buf])
    for k, g in enumerate(grads):
        if k:
            probe.microbatch_boundary(ddp)
        buf.grad_data += g
    probe.before_reduce(ddp)


def test_parts_are_runs_of_micro_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(32, generator=gen, dtype=torch.float64).float() for _ in range(6)]
    one = GradProbe(_dims(), microbatch=True)
    one.start()
    _accumulate(one, grads)
    assert one.mb_sq == pytest.approx([float(g.double().pow(2).sum()) for g in grads], rel=1e-6)
    pairs = GradProbe(_dims(), microbatch=True, microbatches_per_part=2)  # micro-batch 4, groups of 8
    pairs.start()
    _accumulate(pairs, grads)
    want = [float((grads[i].double() + grads[i + 1].double()).pow(2).sum()) for i in (0, 2, 4)]
    assert pairs.mb_sq == pytest.approx(want, rel=1e-6)
    assert pairs.local_sq == pytest.approx(float(sum(g.double() for g in grads).pow(2).sum()), rel=1e-6)
    thirds = GradProbe(_dims(), microbatch=True, microbatches_per_part=4)  # 6 micro-batches: not whole parts
    thirds.start()
    with pytest.raises(RuntimeError, match="6 micro-batches are not whole parts of 4"):
        _accumulate(thirds, grads)


def test_split_reads_each_parts_halves_difference() -> None:
    """``split``: per part of 2k micro-batches, |Δ_1 - Δ_2|² of its first k against its last k
    (the halves of one GRPO group), beside the unchanged whole-part norms."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(40, generator=gen, dtype=torch.float64).float() for _ in range(8)]
    plain = GradProbe(_dims(), microbatch=True, microbatches_per_part=4)
    plain.start()
    _accumulate(plain, grads)
    split = GradProbe(_dims(), microbatch=True, microbatches_per_part=4, split=True)
    split.start()
    _accumulate(split, grads)
    assert split.mb_sq == plain.mb_sq and split.local_sq == plain.local_sq  # bitwise: the split only adds
    g = [x.double() for x in grads]
    want = [float((g[i] + g[i + 1] - g[i + 2] - g[i + 3]).pow(2).sum()) for i in (0, 4)]
    assert split.split_sq == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="even number of micro-batches"):
        GradProbe(_dims(), microbatch=True, microbatches_per_part=3, split=True)
