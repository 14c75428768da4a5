"""The batch record's wire forms read one field table: every field of ``RolloutBatch`` is in
it (or is one of the two plain fields), and both forms — the broadcast's flat vector and the
checkpoint's JSON dict — give back every field exactly, with its dtype and shape."""

import json
from dataclasses import fields

import pytest
import torch

from megarl.rollout.batch import (
    FIELDS,
    ROUTES,
    batch_from_dict,
    batch_from_flat,
    batch_to_dict,
    batch_to_flat,
    broadcast_batch,
)
from megarl.types import RolloutBatch

B, S = 3, 5


def _full_batch() -> RolloutBatch:
    """Every field set to values no default could produce."""
    g = torch.Generator().manual_seed(0)
    return RolloutBatch(
        tokens=torch.randint(0, 2**40, (B, S), generator=g),  # ids past float32's exact range
        mask=(torch.rand(B, S, generator=g) > 0.5).float(),
        engine_logprobs=-torch.rand(B, S, generator=g),
        rewards=torch.randn(B, generator=g),
        group_ids=torch.tensor([0, 0, 1]),
        response_lens=torch.tensor([4, 1, 0]),
        truncated=torch.tensor([True, False, True]),
        version=7,
        texts=["a", "bc", ""],
        versions=torch.tensor([5, 6, 7]),
        turn_rewards=torch.randn(B, S, generator=g),
        routes=torch.randint(-1, 300, (B, S, 4, 2), generator=g, dtype=torch.int16),
    )


def test_the_table_names_every_tensor_field() -> None:
    assert {f.name for f in fields(RolloutBatch)} == set(FIELDS) | {"version", "texts", ROUTES}


def _flat(b: RolloutBatch) -> RolloutBatch:
    return batch_from_flat(batch_to_flat(b), b.size, b.tokens.shape[1], b.version, has_turn_rewards=True)


def _json(b: RolloutBatch) -> RolloutBatch:
    return batch_from_dict(json.loads(json.dumps(batch_to_dict(b))))


@pytest.mark.parametrize("wire", [_flat, _json], ids=["broadcast", "checkpoint"])
def test_every_field_round_trips(wire) -> None:
    batch = _full_batch()
    back = wire(batch)
    for f in FIELDS:
        a, b = getattr(batch, f), getattr(back, f)
        assert b.dtype == a.dtype == FIELDS[f][0], f
        assert b.shape == a.shape == ((B, S) if FIELDS[f][1] else (B,)), f
        assert torch.equal(a, b), f
    assert back.version == batch.version
    assert back.texts == (batch.texts if wire is _json else [])  # the broadcast leaves texts on rank 0


def test_routes_survive_the_checkpoint_exactly() -> None:
    batch = _full_batch()
    back = _json(batch)
    assert back.routes is not None and back.routes.dtype == torch.int16 and torch.equal(back.routes, batch.routes)
    assert _json(RolloutBatch(**{**batch.__dict__, "routes": None})).routes is None


def _broadcast_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        batch = _full_batch()
        for routes in (batch.routes, None):  # with the engines' routes, and a batch without them
            got = broadcast_batch(RolloutBatch(**{**batch.__dict__, "routes": routes}) if rank == 0 else None)
            if rank == 1:
                torch.save({"routes": got.routes, "tokens": got.tokens}, f"{out}.{routes is None}")
    finally:
        dist.destroy_process_group()


def test_broadcast_carries_routes_to_every_rank(tmp_path) -> None:
    """Two real gloo ranks: rank 1 receives rank 0's routes bit for bit (int16 bytes beside
    the float64 vector), and a batch without routes still arrives without them."""
    import torch.multiprocessing as mp

    from megarl.fleet.client import free_port

    out = str(tmp_path / "got")
    mp.spawn(_broadcast_worker, args=(free_port(), out), nprocs=2)
    batch = _full_batch()
    with_routes, without = torch.load(f"{out}.False"), torch.load(f"{out}.True")
    assert with_routes["routes"].dtype == torch.int16 and torch.equal(with_routes["routes"], batch.routes)
    assert torch.equal(with_routes["tokens"], batch.tokens) and without["routes"] is None
