"""Run config sections for the RL algorithm: losses and advantages, the PPO critic (and
its own layout), the supervised warm start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class AlgoConfig:
    name: Literal["grpo", "ppo"] = "grpo"
    """RL algorithm family."""
    advantage: str = "grpo"
    """Advantage estimator: grpo | drgrpo | rloo | reinforce_pp | reinforce_pp_baseline | gae."""
    loss_agg: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (DAPO clip-higher when > clip_low)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 (0 = off)."""
    kl_coef: float = 0.01
    """KL penalty weight (0 = no reference model forward)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    ppo_epochs: int = 1
    """Passes over one rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch."""
    tis_cap: float = 0.0
    """Truncated importance sampling cap on exp(old - engine) (0 = off)."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """KL as a loss term (GRPO style) or as a per-token reward penalty β·KL_t (PPO/RLHF style;
    outcome estimators then read the sequence reward r − β·Σ_t KL_t, as verl)."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """Fixed kl_coef, or adaptive toward kl_target (Ziegler et al. 2019)."""
    kl_target: float = 0.1
    """Adaptive controller target KL per token, nats."""
    kl_horizon: float = 10000.0
    """Adaptive controller horizon, samples."""
    gamma: float = 1.0
    """Discount for GAE / REINFORCE++ returns."""
    lam: float = 0.95
    """GAE λ."""
    whiten_advantages: bool = True
    """Whiten token advantages over the batch (GAE, REINFORCE++)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill to the planned batch."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: generation rounds before giving up on a full batch."""
    overlong_buffer_len: int = 0
    """DAPO soft overlong penalty: buffer before max_response_len, tokens (0 = off)."""
    overlong_filter: bool = False
    """Mask truncated responses out of the loss (DAPO overlong filtering)."""


@dataclass(kw_only=True)
class CriticParallelConfig:
    tensor_parallel: int = 0
    """Critic tensor-parallel size (0 = parallel.tensor_parallel, the actor's)."""
    pipeline_parallel: int = 0
    """Critic pipeline stages (0 = parallel.pipeline_parallel). The critic's data-parallel size
    follows: trainer world size / (critic TP × PP)."""


@dataclass(kw_only=True)
class CriticConfig:
    parallel: CriticParallelConfig = field(default_factory=CriticParallelConfig)
    """The critic's own layout over the trainer ranks (unset = the actor's)."""
    lr: float = 1e-4
    """Critic peak learning rate (own optimizer)."""
    warmup_steps: int = 0
    """Critic-only RL steps before the actor starts updating."""
    value_clip: float = 0.2
    """Clip of new values around old values (0 = off)."""
    init_from_actor: bool = True
    """Initialise the critic trunk from the (warm-started) actor; the value head starts at 0."""


@dataclass(kw_only=True)
class WarmStartConfig:
    steps: int = 0
    """Supervised steps on the task's reference answers before RL (0 = none)."""
    lr: float = 1e-3
    """SFT learning rate."""
    batch_size: int = 64
    """SFT sequences per step."""
