"""The wire forms of a :class:`~megarl.types.RolloutBatch`, from ONE field table.

Two forms carry a packed batch: the flat float64 vector :func:`broadcast_batch` ships from
rank 0 to every trainer rank (tensors only: ``texts`` stay on rank 0), and the JSON dict a
checkpoint saves for the batches generated ahead (``rollout.max_staleness`` > 0; ``texts``
included). Both read :data:`FIELDS`, so a tensor field added to ``RolloutBatch`` without a
row here fails at once (:func:`check_fields`) instead of being dropped by one form.

Exactness: ids < 2**53 and float32 values are exact in float64; float32 → Python float (and
its JSON repr) is exact too. ``versions`` travels filled in (each sample's policy version).

``routes`` (the engines' MoE routes, (B, S, L, k) int16: L × k times the tokens) is the one
field outside the table: in float64 it would be 4× its size, so it travels beside the vector
as its raw bytes (broadcast) or base64 of them (checkpoint), :data:`ROUTES`.
"""

from __future__ import annotations

import base64
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from megarl.types import RolloutBatch

FIELDS: dict[str, tuple[torch.dtype, bool]] = {
    "tokens": (torch.long, True),
    "mask": (torch.float32, True),
    "engine_logprobs": (torch.float32, True),
    "rewards": (torch.float32, False),
    "group_ids": (torch.long, False),
    "response_lens": (torch.long, False),
    "truncated": (torch.bool, False),
    "versions": (torch.long, False),
    "turn_rewards": (torch.float32, True),
}
"""Every tensor field of RolloutBatch, in wire order: name → (dtype, per token: (B, S) else (B,))."""
ROUTES = "routes"
"""The (B, S, L, k) int16 field that travels as bytes beside :data:`FIELDS`."""


def check_fields(batch: RolloutBatch) -> None:
    """Raise if ``batch`` has a tensor field that :data:`FIELDS` (or :data:`ROUTES`) does not carry."""
    tensors = {f.name for f in fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)}
    if not tensors <= {*FIELDS, ROUTES}:  # a new tensor field must travel too
        raise TypeError(f"RolloutBatch tensors {sorted(tensors)} are not all in the wire forms' {tuple(FIELDS)}")


def _values(batch: RolloutBatch) -> dict[str, torch.Tensor | None]:
    check_fields(batch)
    return {f: getattr(batch, f) for f in FIELDS} | {"versions": batch.sample_versions()}


# ---------------------------------------------------------------- the broadcast's flat vector


def batch_to_flat(batch: RolloutBatch) -> torch.Tensor:
    """Every tensor of ``batch`` in one float64 vector; ``engine_logprobs`` only when present."""
    return torch.cat([v.reshape(-1).to(torch.float64) for v in _values(batch).values() if v is not None])


def flat_sizes(B: int, S: int, has_logprobs: bool, has_turn_rewards: bool = False) -> dict[str, int]:
    """Elements of each field in :func:`batch_to_flat`'s vector, in order (the two optional
    fields only when present)."""
    sizes = {f: B * S if per_token else B for f, (_, per_token) in FIELDS.items()}
    if not has_logprobs:
        del sizes["engine_logprobs"]
    if not has_turn_rewards:
        del sizes["turn_rewards"]
    return sizes


def batch_from_flat(
    flat: torch.Tensor, B: int, S: int, version: int, has_logprobs: bool = True, has_turn_rewards: bool = False
) -> RolloutBatch:
    """Inverse of :func:`batch_to_flat` for a (B, S) batch (``texts`` stay on rank 0)."""
    sizes = flat_sizes(B, S, has_logprobs, has_turn_rewards)
    parts = flat.split(list(sizes.values()))
    tensors = {f: p.reshape((B, S) if FIELDS[f][1] else (B,)).to(FIELDS[f][0]) for f, p in zip(sizes, parts)}
    return RolloutBatch(**{"engine_logprobs": None, "turn_rewards": None, **tensors}, version=version)


def broadcast_batch(batch: RolloutBatch | None, src: int = 0) -> RolloutBatch:
    """Ship rank 0's batch to all trainer ranks as tensors: its shape, then every tensor in
    one buffer (two collectives, whatever the number of fields)."""
    rank = dist.get_rank()
    meta = torch.zeros(7, dtype=torch.long)
    if rank == src:
        assert batch is not None
        has = (batch.engine_logprobs is not None, batch.turn_rewards is not None)
        Lk = batch.routes.shape[2:] if batch.routes is not None else (0, 0)
        meta[:] = torch.tensor([batch.tokens.shape[0], batch.tokens.shape[1], batch.version, *has, *Lk])
    dist.broadcast(meta, src=src)
    B, S, version, has_logprobs, has_turn_rewards, L, k = (int(x) for x in meta)
    if rank == src:
        assert batch is not None
        dist.broadcast(batch_to_flat(batch), src=src)
        if batch.routes is not None:  # (two more collectives, only with the engines' routes)
            dist.broadcast(batch.routes.to(torch.int16).contiguous().view(torch.uint8), src=src)
        return batch
    flat = torch.empty(sum(flat_sizes(B, S, bool(has_logprobs), bool(has_turn_rewards)).values()), dtype=torch.float64)
    dist.broadcast(flat, src=src)
    out = batch_from_flat(flat, B, S, version, bool(has_logprobs), bool(has_turn_rewards))
    if L:
        raw = torch.empty(B * S * L * k * 2, dtype=torch.uint8)
        dist.broadcast(raw, src=src)
        out.routes = raw.view(torch.int16).view(B, S, L, k)
    return out


# ---------------------------------------------------------------- the checkpoint's JSON dict


def batch_to_dict(batch: RolloutBatch) -> dict[str, Any]:
    """``engine_logprobs`` is None (JSON null) when the step did not ask the engines,
    ``turn_rewards`` when the batch holds no multi-turn episodes."""
    out: dict[str, Any] = {k: v.tolist() if v is not None else None for k, v in _values(batch).items()}
    r = batch.routes
    if r is not None:  # int16 bytes as base64: ~2.7 bytes a route, not a JSON list's ~3-6
        raw = r.to(torch.int16).contiguous().view(torch.uint8).numpy().tobytes()
        out[ROUTES] = {"shape": list(r.shape), "int16_b64": base64.b64encode(raw).decode("ascii")}
    return {**out, "version": batch.version, "texts": list(batch.texts)}


def batch_from_dict(d: dict[str, Any]) -> RolloutBatch:
    # (a field the checkpoint does not hold — turn_rewards before it existed — is None)
    tensors = {k: torch.tensor(d[k], dtype=dt) if d.get(k) is not None else None for k, (dt, _) in FIELDS.items()}
    routes = None
    if d.get(ROUTES) is not None:
        raw = bytearray(base64.b64decode(d[ROUTES]["int16_b64"], validate=True))
        routes = torch.frombuffer(raw, dtype=torch.int16).view(*d[ROUTES]["shape"])
    return RolloutBatch(**tensors, version=int(d["version"]), texts=list(d["texts"]), routes=routes)  # type: ignore[arg-type]
