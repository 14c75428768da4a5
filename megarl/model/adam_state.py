"""Scale Adam's second moments in place, through megatron's optimizer wrappers.

The coordinator asks for it on a batch change (``megarl.coordinator.policy.adam_v_scale``:
v tracks E[g²], which the batch change moves by a known factor). megatron-core 0.16 wraps a
torch Adam in one of FP32Optimizer / Float16OptimizerWithFloat16Params / DistributedOptimizer
(``.optimizer``), possibly inside a ChainedOptimizer (``.chained_optimizers``); the torch
Adam's per-parameter state holds ``exp_avg_sq`` for this rank's fp32 main parameters (the
distributed optimizer's shard on each DP rank), so scaling it locally on every rank scales
the whole state. The bias correction 1/(1-β2^t) multiplies v̂, so scaling v scales v̂ alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch


@torch.no_grad()
def scale_adam_second_moments(optimizer: Any, factor: float) -> int:
    """Multiply every ``exp_avg_sq`` under ``optimizer`` by ``factor``; returns how many
    tensors were scaled (0 before the first step: Adam creates its state lazily)."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"Adam second-moment factor {factor} must be finite and > 0")
    scaled = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)  # megatron wrapper -> torch optimizer
        for state in inner.state.values():
            v = state.get("exp_avg_sq")
            if v is not None:
                v.mul_(factor)
                scaled += 1
    return scaled
