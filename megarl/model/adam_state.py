"""Adam's second moments through megatron's optimizer wrappers: scaled in place on a batch
change, and read as the preconditioner of the Adam noise scale (:func:`adam_preconditioner`).

The coordinator asks for it on a batch change (``megarl.coordinator.decisions.adam_v_scale``:
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


@torch.no_grad()
def adam_preconditioner(optimizer: Any, ddp: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
    """Adam's element-wise preconditioner P = 1/(√v̂ + ε), v̂ = v/(1 − β2^t), per grad buffer of
    ``ddp``, laid out like its ``grad_data`` (0 where the buffer holds padding), from the steps
    taken so far: the preconditioned noise scale (``noise_kind: adam``) reads it before a step
    (the step itself also folds its own g² into v, a 1 − β2 share).

    None before Adam's first step (no state yet). ``out``: last call's buffers, refilled in place.
    Each buffer parameter's state is found under its fp32 main copy (``main_param``, bf16/fp16
    models) or itself (fp32). The distributed optimizer keeps only this DP rank's shard of v,
    while the probe weighs whole local gradients: refused."""
    found: dict[int, tuple[torch.Tensor, float, float]] = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if type(opt).__name__ == "DistributedOptimizer":
            raise ValueError("the Adam-preconditioned noise scale needs use_distributed_optimizer = false")
        inner = getattr(opt, "optimizer", opt)
        for group in inner.param_groups:
            beta2, eps = float(group["betas"][1]), float(group["eps"])
            for p in group["params"]:
                state = inner.state.get(p) or {}
                if "exp_avg_sq" not in state:
                    return None
                step = float(state.get("step", group.get("step", 0)))
                if step < 1:
                    return None
                found[id(p)] = (state["exp_avg_sq"], 1.0 - beta2**step, eps)
    buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
    if out is None or len(out) != len(buffers):
        out = [torch.zeros_like(b.grad_data, dtype=torch.float32) for b in buffers]
    for w, buf in zip(out, buffers, strict=True):
        w.zero_()
        for p, (start, end, _) in buf.param_index_map.items():
            key = id(getattr(p, "main_param", p))
            if key not in found:
                raise ValueError(f"no Adam state for a parameter of shape {tuple(p.shape)} (not under this optimizer)")
            v, bias2, eps = found[key]
            w[start:end] = ((v.float() / bias2).sqrt_().add_(eps)).reciprocal_().reshape(-1)
    return out
