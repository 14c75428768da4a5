"""The MoE router losses (load balancing, z-loss) in megarl's loss convention.

megatron attaches each micro-batch's router losses to the routing probabilities
(``MoEAuxLossAutoScaler``) in its per-token mode (``calculate_per_token_loss``, which megarl
uses) multiplied by the micro-batch's routed token count n_mb, and scales their gradient by
``config.grad_scale_func(1)``, expecting finalize to divide everything by the total token
count. megarl's finalize never divides (its losses arrive divided by their global
denominators, :mod:`megarl.model.builder`), so :func:`scale_router_losses` sets that scale to
1/N, N the tokens routed in the whole update (every micro-batch of every DP rank, padding
included: megarl passes megatron no padding mask). The objective then gains

    moe_aux_loss_coeff · Σ_mb (n_mb / N) · aux_mb  +  moe_z_loss_coeff · Σ_mb (n_mb / N) · z_mb,

the token-weighted means of Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4,
per micro-batch and layer, summed over layers) and ST-MoE's z-loss (Zoph et al. 2022, eq. 5),
whatever the micro-batch and DP split of the same micro-batches. ``grad_scale_func`` also
scales the main loss in megatron's backward step; that tensor is the only one it sees that
requires grad, and it is returned unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megarl.model.builder import Model
from megarl.model.packing import Packing
from megarl.model.rows import tokens_of


def router_losses_on(config: Any) -> bool:
    """A MoE model whose training adds a load-balancing or z-loss term."""
    return bool(getattr(config, "num_moe_experts", None)) and bool(
        getattr(config, "moe_aux_loss_coeff", 0.0) or getattr(config, "moe_z_loss_coeff", None)
    )


def scale_router_losses(model: Model, mbs: Sequence[Any], packings: Sequence[Packing | None] | None) -> None:
    """Before an update's schedule: scale its router losses by 1 / (tokens routed in the update).
    Collective over the DP group when the model has router losses; a no-op otherwise."""
    if not router_losses_on(model.config):
        return
    packs = packings or [None] * len(mbs)
    local = sum(p.index.numel() if p is not None else tokens_of(mb).numel() for mb, p in zip(mbs, packs, strict=True))
    total = torch.tensor([float(local)], dtype=torch.float64, device=model.dims.device)
    dist.all_reduce(total, group=model.dims.dp_group)
    model.config.grad_scale_func = _aux_only_scale(1.0 / float(total.item()))


def _aux_only_scale(scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def grad_scale(t: torch.Tensor) -> torch.Tensor:
        # the main loss (requires grad) is already normalised; megatron's ones(1) is the router losses'
        return t if t.requires_grad else t * scale

    return grad_scale
