"""Loading optimizer state exactly (megatron-core 0.16 without apex / Transformer Engine).

Split out of ``dist_ckpt``: the fixes that make a resumed optimizer continue bitwise.

* ``DistributedOptimizer.load_state_dict`` puts ONE shared ``step`` tensor into every
  parameter's Adam state; torch's ``_foreach_add_`` then advances it once per parameter,
  so bias correction is wrong after a resume (the ~4e-4 drift in FACTS.md).
  :func:`_fix_adam_steps` gives every parameter its own copy.
* A never-stepped optimizer has no Adam state to shard: :func:`_ensure_adam_state` creates
  the zero state torch's Adam would create.
* megatron's ``load_parameter_state_from_fully_reshardable`` also copies ``step``
  (KeyError): :func:`_load_fully_reshardable` is a copy of it that skips ``step``.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.errors import CheckpointError

DIST_OPT_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


__all__ = ["CheckpointError"]


# --------------------------------------------------------------------------- public API


def _load_optimizer_state(optimizer: Any, state: Any) -> None:
    """``optimizer.load_state_dict`` plus the fixes megatron's torch-Adam path needs.

    A MoE model with expert parallelism (or expert TP below TP) has a chain of two optimizers
    (dense parameters over DP, expert parameters over the expert-data-parallel group); megatron's sharded state dict
    of a chain, and so the loaded state, is ``{index: that optimizer's state}``."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(opts) == 1:
        _load_one(opts[0], state)
        return
    parts = sorted(state) if isinstance(state, dict) else None
    if parts != list(range(len(opts))):
        raise CheckpointError(
            f"the checkpoint's optimizer state has parts {parts}; this model chains {len(opts)} optimizers "
            "(dense and expert parameters, chained at expert_parallel > 1 or expert_tensor_parallel < tensor_parallel): "
            "resume with the parallel.expert_parallel and parallel.expert_tensor_parallel it was saved with"
        )
    for i, opt in enumerate(opts):
        _load_one(opt, state[i])
    optimizer._synchronize_steps()  # (megatron's own load does this: TE's FusedAdam keeps steps per group)


def _load_one(opt: Any, state: dict[str, Any]) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(opt, DistributedOptimizer):
        torch_sd = state.get("optimizer", state)  # the fp16/bf16 optimizer nests torch's state dict
        per_param = [v for k, v in torch_sd["state"].items() if k != "common_step"]
        if "common_step" not in torch_sd["state"] and any("step" not in v for v in per_param):
            # megatron saves the common step only when it is non-zero (``if step:``): a
            # checkpoint from before the first step has none, and torch's Adam refuses state
            # without one. 0 is the step a fresh Adam starts from.
            torch_sd["state"]["common_step"] = torch.tensor(0.0)
        opt.load_state_dict(state)
        _fix_adam_steps(opt)
        return
    state = dict(state)
    param_state = state.pop("param_state")
    sharding = state.pop("param_state_sharding_type")
    if sharding != DIST_OPT_SHARDING["distrib_optim_sharding_type"]:
        raise CheckpointError(f"distributed optimizer state of sharding type {sharding!r} is not supported")
    opt.load_state_dict(state)  # param groups (lr, betas, ...), Adam step, state allocation
    _fix_adam_steps(opt)
    _load_fully_reshardable(opt, param_state)


@torch.no_grad()
def _load_fully_reshardable(opt: Any, param_state: dict[int, dict[str, torch.Tensor]]) -> None:
    """Copy this rank's slice of model-space main params and Adam moments into ``opt``.

    megatron's ``load_parameter_state_from_fully_reshardable`` with one difference: it copies
    into every key of the torch-Adam state, ``step`` included, which the checkpoint's
    model-space tensors never hold (KeyError 'step'); the step comes from the param groups.
    The iteration order (buffers, then ``param_index_map``) defines ``param_state``'s keys,
    exactly as in ``DistributedOptimizer.sharded_param_state_fully_reshardable``.
    """
    param_idx = -1
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        if len(gbuf_range_maps) != 1:
            raise CheckpointError("distributed optimizer with several grad-buffer dtypes is not supported")
        for range_maps in gbuf_range_maps.values():
            local: dict[Any, Any] = {}
            for range_map in range_maps:
                local.update(range_map["param_map"])
            for model_param in opt.buffers[gbuf_idx].param_index_map:
                param_idx += 1
                if model_param not in local:
                    continue  # no element of this parameter lives on this DP rank
                rng = local[model_param]["param"]
                group_index, group_order = opt.model_param_group_index_map[model_param]
                main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
                dst = {"param": main_param, **opt.optimizer.state[main_param]}
                for key, value in param_state[param_idx].items():
                    if key == "step":
                        continue
                    dst["param" if key == "fp32_param" else key].copy_(value.flatten()[rng.start : rng.end])


def _fix_adam_steps(optimizer: Any) -> None:
    """After a load: every torch-Adam parameter gets its own ``step`` tensor.

    megatron's ``DistributedOptimizer.load_state_dict`` (torch-Adam path, no apex/TE) puts ONE
    shared ``torch.tensor(step)`` into the state of every parameter; torch's Adam then
    increments it in place once per parameter (``_foreach_add_(state_steps, 1)``): after the
    first resumed step every parameter's step is ``step + n_params`` instead of ``step + 1``,
    so Adam's bias correction is wrong from then on. Measured (TP2×DP2, 4 layers, lr 2e-3):
    weights off by 4e-4 after the first resumed step, loss off by 1.5e-3 at the second.
    Per-parameter copies make the resumed run bitwise equal to the uninterrupted one.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        seen: set[int] = set()
        for state in inner.state.values():
            step = state.get("step")
            if not isinstance(step, torch.Tensor):
                continue
            if id(step) in seen:
                state["step"] = step.detach().clone()
            seen.add(id(state["step"]))


def _ensure_adam_state(optimizer: Any) -> None:
    """Give every parameter of a never-stepped torch Adam the state its first step would create.

    Zero moments and ``step = 0`` are exactly torch's lazy initialisation, so this changes no
    numbers; it makes the saved state complete (a checkpoint taken before the first step has
    every key a later load asks for), and ``DistributedOptimizer.state_dict()`` (called by its
    ``sharded_state_dict``) needs a ``step`` on every parameter or it fails an assertion.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue  # apex/TE FusedAdam keep their step in the param groups
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), step=torch.tensor(0.0))


# --------------------------------------------------------------------------- internals
