"""The grad probe's reading as the coordinator's parts at expert parallelism (single process, a
stand-in for the probe's gathered values): the experts' parts are the unions of each EP group's
ranks' parts of the same index, their units summed over the group, and megatron's layout puts
an EP group on consecutive DP ranks, which the probe's gather relies on. The real buffers at
EP = 2 are checked against EP = 1 in ``tests/model/test_moe.py``."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megarl.grad_parts import ExpertParts, grad_stats, read_parts
from megarl.model.grad_stats import rescale
from tests.model.test_grad_probe import _dims


def test_ep_groups_are_consecutive_dp_ranks_in_megatron_order() -> None:
    """TP 2 × DP 4 × EP 2: the dense DP groups and the expert EP groups as megatron builds them."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=2, ep=1, dp=4, pp=1, cp=1, order="tp-cp-ep-dp-pp").get_ranks("dp")
    experts = RankGenerator(tp=2, ep=2, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp").get_ranks("ep")
    assert dense == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for dp_group in dense:  # each EP group: DP ranks 2j, 2j+1 of its DP group
        assert [g for g in experts if g[0] in dp_group] == [dp_group[0:2], dp_group[2:4]]


def test_expert_parts_are_unions_over_each_ep_group() -> None:
    """DP 4, EP 2, 4 rows a rank in micro-batches of 2: 8 dense parts (rank-major), 4 expert
    parts — micro-batch k of ranks {0, 1}, then of ranks {2, 3}."""
    dims = dataclasses.replace(_dims(), dp=4, ep=2)
    probe = SimpleNamespace(
        dims=dims,
        microbatch=True,
        microbatches_per_part=1,
        classes=2,
        gather_microbatches=lambda: [float(i) for i in range(8)],
        gather_experts=lambda: [[10.0, 11.0], [12.0, 13.0]],
        expert_global_sq=5.0,
    )
    every = [slice(4 * r, 4 * r + 4) for r in range(4)]
    parts, rows, experts = read_parts(probe, every, 2)  # type: ignore[arg-type]
    assert parts == [float(i) for i in range(8)] and rows == [slice(i, i + 2) for i in range(0, 16, 2)]
    assert experts is not None and experts.sq == [10.0, 11.0, 12.0, 13.0] and experts.global_sq == 5.0
    starts = [[r.start for r in part] for part in experts.rows]
    assert starts == [[0, 4], [2, 6], [8, 12], [10, 14]]
    probe.gather_experts = lambda: [[10.0], [12.0]]  # a rank short of a part: refused, not misread
    with pytest.raises(RuntimeError, match="2 expert parts, expected 4"):
        read_parts(probe, every, 2)  # type: ignore[arg-type]


def test_expert_parts_count_the_union_units_with_signal() -> None:
    """Token units; rows 0-1 carry no signal. An expert part's n is the signal units of all its
    rows (both ranks'), and it is rescaled × (D/n)² like a dense part; the global norms of both
    classes over the same D_s."""
    units = torch.tensor([3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    signal = torch.tensor([False, False, True, True, True, True, True, True])
    rows = [slice(i, i + 2) for i in range(0, 8, 2)]  # ranks 0, 1 of one EP group, 2 micro-batches each
    experts = ExpertParts(sq=[2.0, 3.0], rows=[[rows[0], rows[2]], [rows[1], rows[3]]], global_sq=7.0)
    stats = grad_stats("actor", [1.0, 1.0, 1.0, 1.0], rows, units, signal, 2.0, "tokens", "microbatch", experts)
    assert stats is not None and stats.experts is not None
    total, signal_units = 52.0, 45.0
    assert stats.local_batches == [11.0, 15.0, 19.0]  # the dense part without signal dropped
    assert stats.experts.batches == [15.0, 30.0]  # 0 + (7 + 8), (5 + 6) + (9 + 10)
    assert stats.experts.sq_norms == pytest.approx([rescale(2.0, 15.0, total), rescale(3.0, 30.0, total)], rel=1e-15)
    assert stats.experts.global_sq_norm == pytest.approx(rescale(7.0, signal_units, total), rel=1e-15)
    assert stats.global_sq_norm == pytest.approx(rescale(4.0, signal_units, total), rel=1e-15)
    one = ExpertParts(sq=[2.0, 3.0], rows=[[rows[0]], [rows[1], rows[2], rows[3]]], global_sq=7.0)
    assert grad_stats("actor", [1.0] * 4, rows, units, signal, 2.0, "tokens", "microbatch", one) is None
