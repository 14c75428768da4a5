"""Routing replay (R3, ``algo.router_replay: trainer``) for mixture-of-experts models: the
experts each token was sent to in the old-log-prob forward are recorded and sent the same way
in every forward of the update, so the PPO ratio π_θ / π_old compares the same function of the
weights rather than two different expert choices (Ma et al. 2025, "Stabilizing MoE
Reinforcement Learning by Aligning Training and Inference Routers", R3).

The hook is megatron's: each ``TopKRouter`` hands its top-k choice to ``router.router_replay``
(``topk_routing_with_score_function`` → ``get_replay_topk(scores, topk, num_groups,
group_topk, default_compute_topk)``). megatron's own ``RouterReplay`` keeps every instance in
one process-wide list (``moe_enable_routing_replay``: the actor's, the reference's and the
critic's routers together, fed by position), so each of the actor's routers gets a
:class:`RouteTape` of its own instead, driven by this model's :class:`RouteReplay`. Replayed,
the router's weights for the chosen experts are ``scores.gather(idx)`` as in megatron's
replay: gradients still reach the router.

Routes are a per-token field like the log-probs: ``routes (B, S, L, k)``, ``routes[b, t, l]``
the experts of token ``tokens[b, t]`` at this pipeline stage's l-th MoE layer, -1 where the
token was not recorded (padding beyond a row's length, ``megarl.model.microbatch.row_lengths``:
such tokens route live and are not counted). They are cut by rows and columns with the other
per-token fields, so they follow their tokens through DP shares, micro-batches, token budgets
and packing. Inside a forward the router sees a micro-batch's tokens flattened sequence-first,
``[s, b] → s·b + b``, or packed (``megarl.model.packing``); :func:`to_router` and
:func:`from_router` convert.

The live top-k is taken beside every replayed one (one ``topk`` over the scores the router
has anyway): ``moe/route_mismatch/layer{i}`` is the fraction of counted tokens whose live top-k
set differs from the recorded one, per global layer i over a step's updates, and
``moe/route_mismatch`` its mean over layers.

``algo.router_replay: rollout`` replays the engines' routes instead (``RolloutBatch.routes``,
every decoder layer as vLLM numbers them): :func:`stage_routes` takes this stage's layers out of
them. The old-log-prob forward then replays them too, and its live choices give
``moe/engine_route_mismatch/layer{i}`` (engine vs the trainer's π_old); the update's give
``moe/route_mismatch`` as above (engine vs π_θ). Layers: vLLM's layer index is the HF decoder
layer's, megatron's router ``layer_number`` - 1 the same global index on every PP stage.
Experts: vLLM returns logical ids before its EPLB mapping, megatron's router scores every expert
on every EP rank (the dispatcher maps global ids to ranks after the top-k), and the adapter maps
HF expert g to megatron's global expert g (``megarl.checkpoint.experts``): the ids pass as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist

from megarl.distributed import ParallelDims
from megarl.model.packing import Packing

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class RouteTape:
    """One router's replay: live (megatron's top-k), record (live, the choice kept) or replay
    (the target's experts, the live choice counted against them)."""

    def __init__(self) -> None:
        self.mode: Literal["live", "record", "replay"] = "live"
        self.recorded: torch.Tensor | None = None  # (tokens, k) long, the last recorded forward's
        self.target: torch.Tensor | None = None  # (tokens, k) long, -1 rows route live
        self.differ = 0  # tokens whose live top-k set differed from the target, since the last reset
        self.counted = 0  # tokens compared

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron's call: (the k scores, the k expert indices) of each token."""
        assert default_compute_topk is not None
        if self.mode != "replay":
            vals, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if self.mode == "record":
                self.recorded = idx.detach()
            return vals, idx
        assert self.target is not None, "replay without routes"
        target = self.target.to(scores.device)
        with torch.no_grad():
            _, live = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
        known = target[:, 0] >= 0
        idx = torch.where(known[:, None], target, live)
        differ = (live.sort(dim=1).values != idx.sort(dim=1).values).any(dim=1)
        self.differ += int((differ & known).sum())
        self.counted += int(known.sum())
        return scores.gather(1, idx), idx


def stage_routes(engine: torch.Tensor, layers: list[int], num_experts: int, topk: int) -> torch.Tensor:
    """The engines' routes (B, S, L_model, k) → this stage's (B, S, len(layers), k), layer j =
    global layer ``layers[j]`` (:attr:`RouteReplay.layers`); expert ids unchanged (see the module
    docstring), -1 kept. ValueError naming what does not fit this model."""
    if engine.dim() != 4 or engine.shape[3] != topk:
        raise ValueError(f"engine routes must be (B, S, layers, top-k={topk}), got {tuple(engine.shape)}")
    if layers and max(layers) >= engine.shape[2]:
        raise ValueError(f"engine routes cover {engine.shape[2]} layers; this stage routes global layer {max(layers)}")
    lo, hi = int(engine.min()), int(engine.max())
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"engine routes name experts in [{lo}, {hi}]; the model has {num_experts} (and -1: live)")
    return engine[:, :, layers]


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer type holding every expert index and the -1 of unrecorded tokens."""
    return torch.int16 if num_experts < 2**15 else torch.int32


def to_router(routes: torch.Tensor, packing: Packing | None) -> torch.Tensor:
    """A micro-batch's routes (b, w, L, k) in the router's token order: (tokens, L, k) long."""
    if packing is not None:
        return packing.pack(routes)[0].long()
    b, w = routes.shape[:2]
    return routes.transpose(0, 1).reshape(w * b, *routes.shape[2:]).long()


def from_router(flat: torch.Tensor, b: int, w: int, packing: Packing | None) -> torch.Tensor:
    """Inverse of :func:`to_router`: (tokens, L, k) -> (b, w, L, k), -1 at padding."""
    if packing is None:
        return flat.reshape(w, b, *flat.shape[1:]).transpose(0, 1)
    out = flat.new_full((b * w, *flat.shape[1:]), -1)
    out[packing.index.to(flat.device)] = flat
    return out.reshape(b, w, *flat.shape[1:])


class RouteReplay:
    """The routers of one model's pipeline stage on this rank (``Model.routes``): records a
    forward's routes, replays them in later ones, counts the live choices that differ."""

    def __init__(self, core: torch.nn.Module, num_experts: int, num_layers: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in core.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("algo.router_replay needs a mixture-of-experts model; this stage has no router")
        self.tapes: list[RouteTape] = []
        self.layers: list[int] = []  # each tape's global layer index (0-based)
        for r in routers:
            tape = RouteTape()
            r.router_replay = tape  # megatron's hook (TopKRouter.routing passes it to the top-k)
            self.tapes.append(tape)
            self.layers.append(int(r.layer_number) - 1)
        self.num_experts, self.num_layers = num_experts, num_layers
        self.recording: list[torch.Tensor] | None = None  # each recorded micro-batch's (b, w, L, k)

    @contextmanager
    def record(self) -> Iterator[list[torch.Tensor]]:
        """Within: every forward records its routes; yields the list each micro-batch's
        (b, w, L, k) routes are appended to (in schedule order)."""
        self.recording = []
        self._set("record")
        try:
            yield self.recording
        finally:
            self._set("live")
            self.recording = None
            for t in self.tapes:
                t.recorded = None

    def before(self, routes: torch.Tensor | None, packing: Packing | None) -> None:
        """Before a micro-batch's forward: replay ``routes`` (b, w, L, k) when given, else as set."""
        if routes is None:
            if self.recording is None:
                self._set("live")
            return
        flat = to_router(routes, packing)
        for i, t in enumerate(self.tapes):
            t.target = flat[:, i]
            t.mode = "replay"

    def after(self, tokens: torch.Tensor, packing: Packing | None) -> None:
        """After a micro-batch's forward of ``tokens`` (b, w): keep its routes when recording."""
        for t in self.tapes:
            t.target = None
        if self.recording is None:
            return
        recorded = [t.recorded for t in self.tapes]
        if any(r is None for r in recorded):
            raise RuntimeError("a recording forward left a router without its routes")
        flat = torch.stack([r for r in recorded if r is not None], dim=1).to(route_dtype(self.num_experts))
        self.recording.append(from_router(flat, tokens.shape[0], tokens.shape[1], packing).cpu())

    def mismatch(self, dims: ParallelDims, name: str = "moe/route_mismatch") -> dict[str, float]:
        """``{name}/layer{i}`` per global layer and their mean ``{name}`` since the last call
        (collective over DP and PP; TP ranks route alike); resets the counts."""
        counts = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=dims.device)
        for layer, t in zip(self.layers, self.tapes, strict=True):
            counts[layer, 0] += t.differ
            counts[layer, 1] += t.counted
            t.differ = t.counted = 0
        dist.all_reduce(counts, group=dims.dp_group)
        if dims.pp > 1:
            dist.all_reduce(counts, group=dims.pp_group)
        out = {f"{name}/layer{i}": float(d / n) for i, (d, n) in enumerate(counts.tolist()) if n > 0}
        if out:
            out[name] = sum(out.values()) / len(out)
        return out

    def _set(self, mode: Literal["live", "record", "replay"]) -> None:
        for t in self.tapes:
            t.mode = mode


@contextmanager
def recording(model: Any, on: bool) -> Iterator[list[torch.Tensor] | None]:
    """:meth:`RouteReplay.record` on ``model`` (``megarl.model.builder.Model``) when ``on``."""
    if not on:
        yield None
        return
    if model.routes is None:
        raise ValueError("routes asked of a model built without routing replay (algo.router_replay)")
    with model.routes.record() as taken:
        yield taken


def collect(
    taken: list[torch.Tensor],
    placed: list[tuple[torch.Tensor, int]],
    n_local: int,
    total: tuple[int, int],
    parts: list[torch.Tensor] | None,
    dims: ParallelDims,
) -> torch.Tensor:
    """A recording forward's routes (``taken[i]`` (b, w, L, k) of micro-batch i, whose rows and
    width among this rank's ``n_local`` rows are ``placed[i]``) as the whole batch's
    ``total = (B, S)`` routes (B, S, L, k), -1 where not recorded: this rank's rows, all-gathered
    over DP when the ranks split them (``parts[r]``: rank r's rows of the batch; None: one
    rank ran them all)."""
    B, S = total
    L, k = taken[0].shape[2:]
    most = max(int(p.numel()) for p in parts) if parts is not None else n_local
    local = torch.full((most, S, L, k), -1, dtype=torch.int32)  # (NCCL and gloo have no int16)
    for t, (rows, width) in zip(taken, placed, strict=True):
        local[rows, :width] = t.to(torch.int32)
    if parts is None:
        return local[:n_local].to(taken[0].dtype)
    local = local.to(dims.device)
    gathered = [torch.empty_like(local) for _ in range(dims.dp)]
    dist.all_gather(gathered, local, group=dims.dp_group)
    full = torch.full((B, S, L, k), -1, dtype=taken[0].dtype)
    for rows, g in zip(parts, gathered, strict=True):
        full[rows] = g[: rows.numel()].cpu().to(full.dtype)
    return full


def attach(model: Any) -> RouteReplay:
    """Give ``model`` (``megarl.model.builder.Model``) its routers' replay (``Model.routes``)."""
    cfg = model.config
    model.routes = RouteReplay(model.core, int(cfg.num_moe_experts or 0), int(cfg.num_layers))
    return model.routes  # type: ignore[no-any-return]
