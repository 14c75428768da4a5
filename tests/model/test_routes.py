"""The pieces of routing replay that need no process group (``megarl.model.routes``): the routes'
layouts between a micro-batch and the router, and one router's tape against megatron's own top-k
routing function. The whole path runs on megatron's MoE layer in ``tests/model/test_moe.py``."""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

from megarl.model.packing import Packing
from megarl.model.routes import RouteTape, from_router, route_dtype, stage_routes, to_router


def _routes(b: int, w: int, layers: int = 3, k: int = 2) -> torch.Tensor:
    return torch.arange(b * w * layers * k, dtype=torch.int16).reshape(b, w, layers, k)


def test_padded_layout_is_megatrons_sequence_first_order() -> None:
    routes = _routes(3, 5)
    flat = to_router(routes, None)
    assert flat.shape == (15, 3, 2) and flat.dtype == torch.long
    hidden = torch.arange(3 * 5).reshape(3, 5)  # token id per (row, column), as the model sees it
    order = hidden.transpose(0, 1).reshape(-1)  # megatron's [s, b, h] flattened: s·b + b
    assert torch.equal(flat, routes.reshape(15, 3, 2)[order].long())
    assert torch.equal(from_router(flat, 3, 5, None), routes.long())


def test_packed_layout_keeps_real_tokens_and_marks_padding() -> None:
    routes = _routes(3, 5)
    lengths = torch.tensor([5, 2, 4])
    packing = Packing.of(lengths, 5)
    flat = to_router(routes, packing)
    assert flat.shape == (11, 3, 2)
    assert torch.equal(flat[:5], routes[0].long()) and torch.equal(flat[5:7], routes[1, :2].long())
    back = from_router(flat, 3, 5, packing)
    real = torch.arange(5)[None, :] < lengths[:, None]
    assert torch.equal(back[real], routes[real].long()) and (back[~real] == -1).all()


def _route(tape: RouteTape | None, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return topk_routing_with_score_function(logits, 2, router_replay=tape)


def test_tape_records_replays_and_counts_live_choices() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g)
    tape = RouteTape()
    live_probs, live_map = _route(tape, logits)  # live: megatron's choice
    assert tape.recorded is None
    tape.mode = "record"
    _, recorded_map = _route(tape, logits)
    assert torch.equal(recorded_map, live_map) and tape.recorded is not None
    recorded = tape.recorded.clone()
    # replay the recorded experts on other logits: same experts, the new logits' weights, gradients flow
    other = torch.randn(6, 4, generator=g).requires_grad_(True)
    _, other_live_map = _route(None, other.detach())
    tape.mode, tape.target = "replay", recorded
    probs, routing_map = _route(tape, other)
    assert torch.equal(routing_map, live_map)
    expected = torch.softmax(other.detach().gather(1, recorded), dim=-1)
    assert torch.allclose(probs.detach().gather(1, recorded), expected)
    (probs * torch.randn(6, 4, generator=g)).sum().backward()  # (Σ probs is 1 per token: no gradient)
    assert other.grad is not None and other.grad.abs().sum() > 0
    differ = (other_live_map != live_map).any(dim=1)
    assert differ.any() and (tape.differ, tape.counted) == (int(differ.sum()), 6)
    # tokens marked -1 (not recorded) route live and are not counted
    tape.differ = tape.counted = 0
    tape.target = recorded.clone()
    tape.target[:3] = -1
    _, routing_map = _route(tape, other.detach())
    assert torch.equal(routing_map[:3], other_live_map[:3]) and torch.equal(routing_map[3:], live_map[3:])
    assert (tape.differ, tape.counted) == (int(differ[3:].sum()), 3)


def test_route_dtype_holds_every_expert_and_the_mark() -> None:
    assert route_dtype(128) == torch.int16 and route_dtype(2**15) == torch.int32


def test_stage_routes_take_each_stages_global_layers() -> None:
    """The engines' routes cover every decoder layer (vLLM's index = the HF layer's); a PP stage
    replays its own MoE layers by megatron's global layer number - 1 (dense layers skipped),
    expert ids unchanged at any EP size (the router scores every expert on every EP rank)."""
    B, S, L, k, E = 2, 5, 6, 2, 8
    g = torch.Generator().manual_seed(0)
    engine = torch.randint(0, E, (B, S, L, k), generator=g, dtype=torch.int16)
    engine[1, 3:] = -1  # padding / the last token: live
    engine[:, :, 2] = 0  # a dense layer: vLLM's rows there mean nothing
    first, second = stage_routes(engine, [0, 1], E, k), stage_routes(engine, [3, 4, 5], E, k)  # PP 2, layer 2 dense
    assert first.shape == (B, S, 2, k) and second.shape == (B, S, 3, k)
    assert torch.equal(first, engine[:, :, :2]) and torch.equal(second, engine[:, :, 3:])
    assert (second[1, 3:] == -1).all() and first.dtype == torch.int16
    with pytest.raises(ValueError, match="cover 6 layers; this stage routes global layer 6"):
        stage_routes(engine, [5, 6], E, k)
    with pytest.raises(ValueError, match=r"name experts in \[-1, 7\]; the model has 4"):
        stage_routes(engine, [0], 4, k)
    with pytest.raises(ValueError, match="top-k=4"):
        stage_routes(engine, [0], E, 4)
