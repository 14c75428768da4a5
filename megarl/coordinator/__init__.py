"""Critical-batch-size coordinator: noise scale, LR rules, step-time models, goodput plan.

Pure Python (no processes, no torch.distributed). The trainer reports gradient norms and
timings each step; `Coordinator.next_plan()` returns prompts per step, per-model learning
rates and per-DP-rank shares. See each module's docstring for formulas and sources.
"""

from megarl.config import CoordinatorConfig
from megarl.coordinator.config import CoordinatorRun
from megarl.coordinator.coordinator import Coordinator
from megarl.coordinator.decisions import adam_v_scale, hold_or_move, jump, limit_move, optimum_band
from megarl.coordinator.goodput import (
    BatchChoice,
    BatchGrid,
    choose_batch,
    efficiency,
    goodput,
)
from megarl.coordinator.lr_rules import (
    LR_RULES,
    LrInputs,
    adascale_gain,
    adascale_sqrt_rule,
    apply_lr_rule,
    clip_lr,
    linear_rule,
    sqrt_rule,
    surge_lr_max,
    surge_rule,
)
from megarl.coordinator.noise import (
    NoiseScaleEstimator,
    dp_estimates,
    expert_parallel_estimates,
    microbatch_estimates,
    parts_dof,
    two_batch_estimates,
)
from megarl.coordinator.records import ExpertGradStats, ModelGradStats, StepPlan, StepTimings
from megarl.coordinator.throughput import LinearTimeModel, StepTimeModel

__all__ = [
    "LR_RULES",
    "BatchChoice",
    "BatchGrid",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorRun",
    "ExpertGradStats",
    "LinearTimeModel",
    "LrInputs",
    "ModelGradStats",
    "NoiseScaleEstimator",
    "StepPlan",
    "StepTimeModel",
    "StepTimings",
    "adam_v_scale",
    "adascale_gain",
    "adascale_sqrt_rule",
    "apply_lr_rule",
    "choose_batch",
    "clip_lr",
    "dp_estimates",
    "efficiency",
    "expert_parallel_estimates",
    "goodput",
    "hold_or_move",
    "limit_move",
    "jump",
    "linear_rule",
    "microbatch_estimates",
    "optimum_band",
    "parts_dof",
    "sqrt_rule",
    "surge_lr_max",
    "surge_rule",
    "two_batch_estimates",
]
