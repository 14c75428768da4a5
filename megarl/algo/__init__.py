"""Pure-tensor RL algorithm library: advantages, KL, losses, aggregation, filters.

Nothing here is distributed: every function takes tensors and masks and returns tensors.
See each module's docstring for the formulas and their sources.
"""

from megarl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    group_ids_from_size,
    grpo_advantages,
    kl_penalized_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_to_last_token,
    sequence_to_token,
)
from megarl.algo.aggregation import (
    LOSS_AGG_MODES,
    aggregate,
    denominator_stats,
    global_denominator,
    make_denominator,
)
from megarl.algo.filters import (
    groups_with_signal,
    overlong_filter_mask,
    overlong_soft_penalty,
)
from megarl.algo.kl import (
    KL_CONTROLLERS,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    make_kl_controller,
)
from megarl.algo.losses import policy_loss, tis_weights, value_loss
from megarl.algo.masked import masked_mean, masked_sum, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_CONTROLLERS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageResult",
    "FixedKLController",
    "aggregate",
    "compute_advantages",
    "denominator_stats",
    "discounted_returns",
    "gae_advantages",
    "global_denominator",
    "group_ids_from_size",
    "groups_with_signal",
    "grpo_advantages",
    "kl_estimate",
    "kl_penalized_rewards",
    "make_denominator",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_filter_mask",
    "overlong_soft_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_to_last_token",
    "sequence_to_token",
    "tis_weights",
    "value_loss",
]
