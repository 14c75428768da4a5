"""Expert health (``megarl.model.expert_load``): which router rows count (real tokens in
megatron's sequence-first order, packed rows whole, training forwards only), the per-step
metrics, and the watch that warns once when experts go without tokens for N steps and again
when that set changes. The counts of a real megatron MoE model at EP 1 and EP 2 against
transformers' routing, and with routing forced onto two experts, are in
``tests/model/test_moe.py``."""

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megarl.model.expert_load import DeadExpertWatch, ExpertLoad, load_metrics
from tests.helpers import one_rank_group

_one_rank = pytest.fixture(scope="module", autouse=True)(one_rank_group)  # read() all-reduces over DP


class _Router(torch.nn.Module):
    """Stands in for megatron's TopKRouter: returns (probs, routing_map) for the given map."""

    def forward(self, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return routing_map.float(), routing_map


@dataclass
class _Dims:
    dp_group: Any = None  # the default (one-rank) group
    pp_group: Any = None
    tp_group: Any = None
    pp: int = 1
    tp: int = 1
    tp_rank: int = 0
    device: torch.device = torch.device("cpu")


def _tracker(num_layers: int = 2, experts: int = 4, dims: _Dims | None = None) -> tuple[ExpertLoad, list[_Router]]:
    routers = [_Router() for _ in range(num_layers)]
    layers = [SimpleNamespace(mlp=SimpleNamespace(router=r), layer_number=i + 1) for i, r in enumerate(routers)]
    config = SimpleNamespace(
        num_layers=num_layers, num_moe_experts=experts, moe_router_topk=1, sequence_parallel=dims is not None
    )
    core = SimpleNamespace(decoder=SimpleNamespace(layers=layers))
    return ExpertLoad(SimpleNamespace(config=config, dims=dims or _Dims(), core=core)), routers


def test_sequence_parallel_counts_this_ranks_slice_of_the_padded_rows() -> None:
    """TP 2 with sequence parallelism, TP rank 1: a micro-batch of 2 rows × 5 columns runs padded
    to 6, and this rank's router sees columns 3..5 of both rows, sequence first; real lengths 5
    and 4 leave (s3,b0) (s3,b1) (s4,b0) real, the padded column s5 never. Packed, 7 tokens padded
    to 8: this rank sees tokens 4..7, the last one padding."""
    load, (r0, _) = _tracker(dims=_Dims(tp=2, tp_rank=1))
    load.expect(torch.tensor([5, 4]), packed=False, width=5)
    r0(_one_hot([0, 1, 2, 3, 3, 3]))  # (s3,b0) (s3,b1) (s4,b0) (s4,b1) (s5,b0) (s5,b1)
    assert load.counts[0].tolist() == [1, 1, 1, 0]
    load.reset()
    load.expect(torch.tensor([3, 4]), packed=True, width=7)
    r0(_one_hot([0, 1, 2, 3]))
    assert load.counts[0].tolist() == [1, 1, 1, 0]


def _one_hot(experts: list[int], n: int = 4) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(experts), n).bool()


def test_only_real_tokens_count_in_sequence_first_order() -> None:
    load, (r0, r1) = _tracker()
    # a micro-batch of 2 rows × 3 columns, real lengths 3 and 1: megatron's router rows are
    # (s0,b0) (s0,b1) (s1,b0) (s1,b1) (s2,b0) (s2,b1); the real ones are all of row 0 and s0 of row 1
    load.expect(torch.tensor([3, 1]), packed=False)
    r0(_one_hot([0, 1, 2, 3, 0, 1]))
    r1(_one_hot([3, 3, 3, 3, 3, 3]))
    assert load.read().tolist() == [[2, 1, 1, 0], [0, 0, 0, 4]]
    load.expect(torch.tensor([2, 2]), packed=True)  # a packed row (1, 4): every token is real
    r0(_one_hot([1, 1, 1, 1]))
    assert load.read()[0].tolist() == [2, 5, 1, 0]
    load.expect(None, packed=False)  # a micro-batch without a loss mask: every position counts
    r1(_one_hot([0, 0]))
    assert load.read()[1].tolist() == [2, 0, 0, 4]
    r0.eval()  # forward-only passes never count
    r0(_one_hot([3, 3]))
    assert load.read()[0].tolist() == [2, 5, 1, 0]
    load.reset()
    assert int(load.read().sum()) == 0
    load.expect(torch.tensor([1, 1, 1]), packed=False)
    r1.train()
    with pytest.raises(RuntimeError, match="router saw 4 tokens, not a multiple of the micro-batch's 3 rows"):
        r1(_one_hot([0, 0, 0, 0]))


def test_load_metrics() -> None:
    counts = torch.tensor([[6, 2, 0, 0], [2, 2, 2, 2]])  # top-2 over 4 tokens
    m = load_metrics(counts, topk=2)
    assert m == {
        "moe/load_max_over_mean/layer0": 3.0,  # 6 / (8 / 4)
        "moe/load_max_over_mean/layer1": 1.0,
        "moe/load_max_over_mean": 3.0,
        "moe/dead_experts": 2.0,
        "moe/tokens": 4.0,
    }


def test_the_watch_warns_once_then_on_each_change() -> None:
    live, e1_dead, both_dead = (torch.tensor([[3, 1, 2]]), torch.tensor([[3, 0, 3]]), torch.tensor([[6, 0, 0]]))
    watch = DeadExpertWatch(2)
    said = [watch.observe(c) for c in (e1_dead, live, e1_dead, e1_dead, e1_dead, both_dead, both_dead, live)]
    assert said[:3] == [None, None, None]  # expert 1's first streak broke after one step
    assert said[3] == (
        logging.WARNING,
        "MoE: 1 expert(s) received no tokens in each of the last 2 or more steps "
        "(model.moe_dead_expert_steps=2): layer 0: experts [1]",
    )
    assert said[4] is None and said[5] is None  # the same set; expert 2's streak is 1 step
    assert said[6] is not None and said[6][1].endswith("layer 0: experts [1, 2]")
    assert said[7] == (logging.INFO, "MoE: every expert received tokens again")
    never = DeadExpertWatch(0)
    assert all(never.observe(both_dead) is None for _ in range(5))
