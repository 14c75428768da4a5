"""The whole run config: :class:`RunConfig`, which holds one of each section, and the sizes
derived from several of them (the batch, the critic's layout). Its rules are run by
:func:`megarl.config.cross.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.algo import AlgoConfig
from megarl.config.coordinator import CoordinatorConfig
from megarl.config.critic import CriticConfig
from megarl.config.data import DataConfig
from megarl.config.env import EnvConfig
from megarl.config.model import ModelConfig
from megarl.config.optim import OptimConfig
from megarl.config.parallel import ParallelConfig
from megarl.config.reward import RewardConfig
from megarl.config.rollout import RolloutConfig
from megarl.config.train import TrainConfig
from megarl.config.warm_start import WarmStartConfig
from megarl.config.weight_sync import WeightSyncConfig


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The actor's (and reference's) architecture and size, or an HF folder to start from (``model.init_from``)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the trainer ranks split the actor and reference: tensor / pipeline / data parallel sizes, micro-batches."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The actor's Adam optimizer: peak and minimum LR, schedule, warm-up, weight decay, eps, gradient clip."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where prompts come from (built-in task, JSONL, Parquet, datasets folder), their fields, chat template."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Which reward functions score a response, their weights, and the worker processes that run them."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: prompts × samples per step, lengths, sampling, the vLLM engines and their resources."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes with an environment (agents and tools); unset: single-turn rollouts."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The RL algorithm: advantage estimator, PPO clip, KL, loss aggregation, DAPO filters, TIS."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's value model (its own Adam): LR, warm-up, value clip, initialisation, its own parallel layout."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised steps on the reference answers before RL (teaches the answer format)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the actor's weights reach the engines after every optimizer step, and the integrity check."""
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    """The critical-batch-size coordinator: gradient-noise estimates choose the rollout batch and LR."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The run: steps, seed, output folder, validation cadence, checkpoints, stop rules, trackers."""

    @property
    def batch_size(self) -> int:
        """Responses per RL step."""
        return self.rollout.num_prompts * self.rollout.samples_per_prompt

    def critic_layout(self, world_size: int) -> tuple[int, int, int]:
        """The critic's (TP, PP, DP) in a trainer world of ``world_size`` ranks."""
        c, p = self.critic.parallel, self.parallel
        tp = c.tensor_parallel or p.tensor_parallel
        pp = c.pipeline_parallel or p.pipeline_parallel
        return tp, pp, world_size // (tp * pp)
