"""Phase 3: rewards (+ the KL penalty when ``algo.kl_mode`` is ``reward``) → advantages.

The math is ``megarl.algo``; this phase owns the adaptive KL controller (its β moves with
the measured KL and is checkpointed)."""

from __future__ import annotations

from typing import Any

import torch

from megarl import algo
from megarl.config import AlgoConfig
from megarl.types import Advantages, PolicyEval, RolloutBatch

KLController = algo.FixedKLController | algo.AdaptiveKLController


class AdvantageEstimator:
    """Phase 3 with its state (the KL controller), built from the ``algo`` section."""

    def __init__(self, a: AlgoConfig) -> None:
        self.algo = a
        self.kl_ctl = algo.make_kl_controller(
            a.kl_controller, kl_coef=a.kl_coef, target_kl=a.kl_target, horizon=int(a.kl_horizon)
        )

    def __call__(self, batch: RolloutBatch, ev: PolicyEval) -> tuple[Advantages, dict[str, float]]:
        """Advantages (and critic returns); see :func:`rollout_advantages`."""
        return rollout_advantages(self.algo, self.kl_ctl, batch, ev)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.kl_ctl.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state)


@torch.no_grad()
def rollout_advantages(
    a: AlgoConfig, kl_ctl: KLController, batch: RolloutBatch, ev: PolicyEval
) -> tuple[Advantages, dict[str, float]]:
    """Advantages (and critic returns) of one rollout batch; updates ``kl_ctl`` in reward mode.

    With ``kl_mode: reward`` the penalty β·KL_t enters both views of the reward (token
    rewards for reinforce_pp/gae, their sum for the outcome estimators), so it acts on every
    estimator (``algo.kl_penalized_rewards``, as verl's ``apply_kl_penalty``); the loss then
    carries no KL term.
    """
    mask = batch.mask
    if a.overlong_filter:
        mask = mask * (~batch.truncated).float()[:, None]
    rewards = batch.rewards
    if batch.turn_rewards is not None:  # multi-turn: each reward at the turn that earned it (algo.gamma discounts)
        token_rewards = batch.turn_rewards * mask
    else:
        token_rewards = algo.sequence_to_last_token(rewards, mask)
    stats: dict[str, float] = {}
    if a.kl_mode == "reward" and ev.ref_logprobs is not None:
        assert ev.old_logprobs is not None
        kl = algo.kl_estimate(ev.old_logprobs, ev.ref_logprobs, a.kl_estimator) * mask
        rewards, token_rewards = algo.kl_penalized_rewards(
            batch.rewards, kl, mask, coef=kl_ctl.value, token_rewards=batch.turn_rewards
        )
        kl_mean = float(kl.sum() / mask.sum().clamp(min=1))
        stats.update({"train/kl_reward": kl_mean, "train/kl_coef": kl_ctl.value})
        kl_ctl.update(kl_mean, batch.size)
    res = algo.compute_advantages(
        a.advantage,
        mask=mask,
        rewards=rewards,
        token_rewards=token_rewards,
        group_ids=batch.group_ids,
        values=ev.old_values,
        gamma=a.gamma,
        lam=a.lam,
        whiten=a.whiten_advantages,
    )
    return Advantages(adv=res.advantages, mask=mask, returns=res.returns), stats
