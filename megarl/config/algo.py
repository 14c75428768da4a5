"""The ``algo`` section: the RL algorithm (advantage estimator, PPO clip, KL, loss aggregation,
DAPO filters, TIS) and its own checks. The rules it shares with the rollout (group size,
response length, staleness) are :mod:`megarl.config.cross`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from megarl.config.rules import fail

if TYPE_CHECKING:
    from megarl.config.model import ModelConfig


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
    router_replay: Literal["off", "trainer", "rollout"] = "off"
    """MoE routing replay (R3): off | trainer (the old-log-prob forward's experts per token
    replayed in the update's forwards) | rollout (the engines' experts per token, returned by
    vLLM's V2 runner: GPU only; replayed in the old-log-prob forward and the update's)."""

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("overlong_buffer_len",)

    def validate(self) -> None:
        """Signs and ranges of the coefficients; known estimators and aggregation modes; PPO's
        critic and GAE go together."""
        for name in ("clip_high", "kl_coef", "entropy_coef", "kl_target", "kl_horizon"):
            if getattr(self, name) < 0:
                fail(f"algo.{name}", getattr(self, name), "must be >= 0")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                fail(f"algo.{name}", getattr(self, name), "must be in [0, 1]")
        if self.clip_low >= 1 or self.clip_low < 0:
            fail("algo.clip_low", self.clip_low, "must be in [0, 1)")
        if self.name == "ppo" and self.advantage != "gae":
            fail("algo.advantage", self.advantage, "must be 'gae' when algo.name='ppo' (critic)")
        if self.name == "grpo" and self.advantage == "gae":
            fail("algo.advantage", "gae", "needs a critic: set algo.name='ppo'")
        from megarl.algo import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES

        if self.advantage not in ADVANTAGE_ESTIMATORS:
            fail("algo.advantage", self.advantage, f"must be one of {sorted(ADVANTAGE_ESTIMATORS)}")
        if self.loss_agg not in LOSS_AGG_MODES:
            fail("algo.loss_agg", self.loss_agg, f"must be one of {list(LOSS_AGG_MODES)}")
        if self.dual_clip and self.dual_clip <= 1:
            fail("algo.dual_clip", self.dual_clip, "must be > 1 (or 0 = off)")

    def check_model(self, m: ModelConfig, episodes: bool = False, sequence_parallel: bool = False) -> None:
        """Routing replay needs routers (``m`` the model the run builds) and whole rows on each
        TP rank (no sequence parallelism); the engines' routes need vLLM's V2 model runner, which
        needs Triton: GPU only, and single-turn samples (``episodes``: env.fn / env.agent, each
        turn a request of its own)."""
        import torch

        mode = self.router_replay
        if mode != "off" and not m.is_moe:
            fail("algo.router_replay", mode, f"needs a mixture-of-experts model; model.arch={m.arch} has a dense MLP")
        if mode != "off" and sequence_parallel:
            fail(
                "algo.router_replay",
                mode,
                "with parallel.sequence_parallel: routes are replayed per token of whole rows, but under sequence "
                "parallelism each TP rank's routers see only its slice of a micro-batch",
            )
        if mode == "rollout" and not torch.cuda.is_available():
            fail(
                "algo.router_replay",
                mode,
                "needs the engines' routes (vLLM's V2 runner, GPU only), not on CPU; use trainer",
            )
        if mode == "rollout" and episodes:
            fail("algo.router_replay", mode, "takes single-turn samples' routes; not with env.fn / env.agent episodes")
