"""Per-turn rewards in phase 3 (``RolloutBatch.turn_rewards``, multi-turn episodes): token-level
estimators see each reward at the turn that earned it (so ``algo.gamma`` discounts a late
reward against an early one); outcome estimators see the sum, exactly as before; in KL-reward
mode the penalty comes off the placed rewards and both views still agree."""

from __future__ import annotations

import dataclasses

import torch

from megarl import algo
from megarl.config import AlgoConfig
from megarl.types import PolicyEval, RolloutBatch
from megarl.update.advantages import rollout_advantages

B, S = 4, 8


def _batch(turn_rewards: bool) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(B, S)
    mask[:, 2:7] = 1.0
    mask[:, 4] = 0.0  # an observation id between two turns
    placed = torch.zeros(B, S)
    placed[:, 3] = torch.tensor([0.5, 0.0, 0.5, 0.0])  # a step reward at turn 1's last id
    placed[:, 6] = torch.tensor([1.0, 1.0, 0.0, 0.0])  # the final score at the last id
    return RolloutBatch(
        tokens=torch.randint(0, 50, (B, S), generator=g),
        mask=mask,
        engine_logprobs=None,
        rewards=placed.sum(dim=1),
        group_ids=torch.tensor([0, 0, 1, 1]),
        response_lens=torch.full((B,), 5),
        truncated=torch.zeros(B, dtype=torch.bool),
        version=1,
        turn_rewards=placed if turn_rewards else None,
    )


def _adv(a: AlgoConfig, batch: RolloutBatch, ev: PolicyEval | None = None) -> torch.Tensor:
    ctl = algo.make_kl_controller(a.kl_controller, kl_coef=a.kl_coef, target_kl=a.kl_target, horizon=int(a.kl_horizon))
    out, _ = rollout_advantages(a, ctl, batch, ev or PolicyEval())
    return out.adv


def test_token_estimators_see_each_reward_at_its_turn() -> None:
    a = AlgoConfig(advantage="reinforce_pp", gamma=0.5, whiten_advantages=False)
    placed, last = _adv(a, _batch(True)), _adv(a, _batch(False))
    m = _batch(True).mask.bool()
    want = algo.compute_advantages(
        "reinforce_pp", mask=_batch(True).mask, token_rewards=_batch(True).turn_rewards, gamma=0.5, lam=1.0, whiten=False
    ).advantages
    assert torch.allclose(placed, want)
    assert not torch.allclose(placed[m], last[m])  # the early reward moved, so did the early advantages


def test_outcome_estimators_see_the_sum_exactly_as_before() -> None:
    a = AlgoConfig(advantage="grpo")
    assert torch.equal(_adv(a, _batch(True)), _adv(a, _batch(False)))


def test_kl_in_the_reward_comes_off_the_placed_rewards() -> None:
    a = dataclasses.replace(AlgoConfig(advantage="reinforce_pp", gamma=1.0), kl_mode="reward", kl_coef=0.1)
    g = torch.Generator().manual_seed(1)
    ev = PolicyEval(old_logprobs=-torch.rand(B, S, generator=g), ref_logprobs=-torch.rand(B, S, generator=g))
    got = _adv(a, _batch(True), ev)  # (the estimator checks both views agree row by row)
    assert got.shape == (B, S) and torch.isfinite(got).all()
