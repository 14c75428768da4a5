"""Expert health of a mixture-of-experts actor: how many tokens each routed expert of each layer
received in a step's update, the load imbalance and the dead experts that follow from it, and a
watch that says when experts have received nothing for several steps in a row.

Where the counts come from: a forward hook on each layer's megatron ``TopKRouter``, whose output
is ``(probs, routing_map)`` with ``routing_map`` (tokens, experts) boolean, the experts each
token is actually sent to (after router replay, if any). The hook counts only while the router
is in training mode — the update's forwards (``megarl.model.train.train_step``), never the
forward-only passes (old / reference log-probs, the integrity probe). Before each micro-batch
the schedule runner tells the tracker its rows (:meth:`ExpertLoad.expect`), so only real tokens
count: the positions before each row's length (``megarl.model.microbatch.row_lengths``: the
prompt and the response up to its last trained token), never right padding. The counts are
therefore the same whichever micro-batching (fixed rows, token budget, packed) runs the update.
One RL update is every PPO epoch × mini-batch, so a token counts once per epoch, once for each
of its top-k experts.

Reduction (:meth:`ExpertLoad.read`): summed over the DP group — every DP rank routes its own
rows; expert-parallel ranks are DP ranks, and a router is whole on each of them, so the counts
do not depend on EP — and over the PP group, each stage adding its own layers into a
(layers, experts) table. Without sequence parallelism TP ranks route the same tokens, so they
are not summed; with it (``parallel.sequence_parallel``) each TP rank routes its own slice of the
(padded, ``megarl.model.seqpar``) sequence, so the counts are summed over TP too, and the
positions a rank sees are offset by its slice.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist


class ExpertLoad:
    """Tokens routed to each expert of this rank's MoE layers since the last :meth:`reset`."""

    def __init__(self, model: Any) -> None:
        """Hooks every MoE layer's router of ``model`` (a :class:`megarl.model.builder.Model`)."""
        config = model.config
        self.dims = model.dims
        self.sp = self.dims.tp if getattr(config, "sequence_parallel", False) else 1
        """TP ranks that split the sequence (1: each routes every position)."""
        self.num_layers: int = config.num_layers
        self.num_experts: int = config.num_moe_experts
        self.topk: int = config.moe_router_topk
        layers = [layer for layer in model.core.decoder.layers if hasattr(layer.mlp, "router")]
        self.layers = [layer.layer_number - 1 for layer in layers]
        """Global 0-based index of each hooked layer (megatron's layer_number counts from 1 across stages)."""
        self.counts = torch.zeros(len(layers), self.num_experts, dtype=torch.long, device=self.dims.device)
        self._rows: tuple[torch.Tensor | None, bool, int | None] = (None, True, None)
        self._mask: torch.Tensor | None = None  # the micro-batch's real-token mask, built by its first layer
        for i, layer in enumerate(layers):
            layer.mlp.router.register_forward_hook(self._hook(i))

    def expect(self, lengths: torch.Tensor | None, packed: bool, width: int | None = None) -> None:
        """The next forward's micro-batch: each row's real length (b,) (None: every position
        counts), whether it runs packed (then every token of the packed row is real), and its
        columns (packed: tokens) before any sequence-parallel padding (None: the router's)."""
        self._rows, self._mask = (lengths, packed, width), None

    def reset(self) -> None:
        self.counts.zero_()

    def _valid(self, n_tokens: int, device: torch.device) -> torch.Tensor | None:
        """Which of the router's ``n_tokens`` rows are real tokens (megatron's [s, b] order
        flattened, sequence first; under sequence parallelism this TP rank's slice of s), or
        None for all of them."""
        lengths, packed, width = self._rows
        if width is None and (packed or lengths is None):
            return None
        if self._mask is None or self._mask.numel() != n_tokens:
            b = 1 if packed or lengths is None else int(lengths.numel())
            s_local = -(-width // self.sp) if width is not None else n_tokens // b
            if width is not None and lengths is None and not packed:
                b = n_tokens // s_local
            if n_tokens != s_local * b:
                raise RuntimeError(f"router saw {n_tokens} tokens, not a multiple of the micro-batch's {b} rows")
            first = self.dims.tp_rank * s_local if self.sp > 1 else 0
            positions = first + torch.arange(s_local)[:, None]
            real = positions < (width if width is not None else s_local)
            if lengths is not None and not packed:
                real = real & (positions < lengths.cpu()[None, :])
            self._mask = real.expand(s_local, b).reshape(-1).to(device)
        return self._mask

    def _hook(self, index: int) -> Any:
        def count(router: torch.nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            if not router.training:
                return
            routing_map = output[1].detach()
            valid = self._valid(routing_map.shape[0], routing_map.device)
            if valid is not None:
                routing_map = routing_map[valid]
            self.counts[index] += routing_map.sum(dim=0).to(self.counts.device, torch.long)

        return count

    def read(self) -> torch.Tensor:
        """(num_layers, num_experts) long on CPU: the counts of every layer, summed over DP ranks
        (and TP ranks under sequence parallelism) and gathered over pipeline stages; the same on
        every rank. Collective over DP, PP (and TP)."""
        table = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long, device=self.dims.device)
        table[self.layers] = self.counts
        dist.all_reduce(table, group=self.dims.dp_group)
        if self.sp > 1:  # each TP rank routed its own slice of the sequence
            dist.all_reduce(table, group=self.dims.tp_group)
        if self.dims.pp > 1:
            dist.all_reduce(table, group=self.dims.pp_group)
        return table.cpu()


def load_metrics(counts: torch.Tensor, topk: int) -> dict[str, float]:
    """Per-step expert health from (layers, experts) token counts.

    ``moe/load_max_over_mean/layer{i}``: the busiest expert's tokens over the mean per expert
    (1 = perfectly balanced; E = one expert takes everything); ``moe/load_max_over_mean``: the
    worst layer's; ``moe/dead_experts``: experts (over all layers) that received no token;
    ``moe/tokens``: tokens the update routed (each layer routes every token to ``topk`` experts).
    """
    counts = counts.double()
    mean = counts.mean(dim=1)
    ratio = torch.where(mean > 0, counts.max(dim=1).values / mean.clamp(min=1e-30), torch.nan)
    out = {f"moe/load_max_over_mean/layer{i}": float(r) for i, r in enumerate(ratio)}
    out["moe/load_max_over_mean"] = float(ratio.max())
    out["moe/dead_experts"] = float((counts == 0).sum())
    out["moe/tokens"] = float(counts[0].sum()) / topk
    return out


class DeadExpertWatch:
    """Experts that received no token in each of the last ``steps`` updates. :meth:`observe`
    returns a message when that set changes — first appears, grows, shrinks or empties — and
    None while it stays the same (a warning once, then again on a change). Streaks start afresh
    in a resumed run."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.streak: torch.Tensor | None = None
        self.reported: list[tuple[int, int]] = []

    def observe(self, counts: torch.Tensor) -> tuple[int, str] | None:
        """(logging level, message) when the set of long-dead experts changed, else None."""
        if self.steps <= 0:
            return None
        zero = (counts == 0).long()
        self.streak = zero if self.streak is None else (self.streak + 1) * zero
        dead = [(int(layer), int(e)) for layer, e in (self.streak >= self.steps).nonzero().tolist()]
        if dead == self.reported:
            return None
        self.reported = dead
        if not dead:
            return logging.INFO, "MoE: every expert received tokens again"
        per_layer: dict[int, list[int]] = {}
        for layer, e in dead:
            per_layer.setdefault(layer, []).append(e)
        where = "; ".join(f"layer {layer}: experts {es}" for layer, es in per_layer.items())
        return logging.WARNING, (
            f"MoE: {len(dead)} expert(s) received no tokens in each of the last {self.steps} or more steps "
            f"(model.moe_dead_expert_steps={self.steps}): {where}"
        )
