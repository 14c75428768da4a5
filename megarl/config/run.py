"""The whole run config: :class:`RunConfig`, which holds one of each section, and
:func:`validate`, every rule before any process group starts.

The order is the order errors are reported in (a config with two problems names the first):
every field's generic rules (ints positive, floats finite: :mod:`megarl.config.rules`), then
the sections' own rules (each section's ``validate()``, beside its fields) and the rules across
sections (:mod:`megarl.config.cross`, which check the model the run builds: ``model.init_from``'s,
when set), in the order :func:`validate` gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config import cross
from megarl.config.algo import AlgoConfig
from megarl.config.coordinator import CoordinatorConfig
from megarl.config.critic import CriticConfig
from megarl.config.data import DataConfig
from megarl.config.hf import resolved_model
from megarl.config.model import ModelConfig
from megarl.config.optim import OptimConfig
from megarl.config.parallel import ParallelConfig
from megarl.config.reward import RewardConfig
from megarl.config.rollout import RolloutConfig
from megarl.config.rules import finite_floats, positive_ints
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


def validate(cfg: RunConfig, world_size: int) -> None:
    """Every rule, before any process group starts; the first broken one raises ConfigError
    naming the field, the value and the rule. (data, reward and weight_sync have no rules of
    their own here: rewards are imported and checked by ``megarl.prelaunch``, transports against
    what this machine runs by ``cross``.)

    The order keeps the one it had as a single list of rules as closely as one ``validate()``
    per section allows: the sections whose rules came first, then those the cross-section rules
    rely on (the rollout's KV cache size, the model's shape, the algorithm's name), the cross
    rules, and last coordinator and train, whose rules came last and nothing relies on."""
    positive_ints(cfg)
    finite_floats(cfg)
    for section in (cfg.critic, cfg.optim, cfg.warm_start, cfg.rollout, cfg.model, cfg.parallel, cfg.algo):
        section.validate()
    cross.check(cfg, resolved_model(cfg.model), world_size)
    cfg.coordinator.validate()
    cfg.train.validate()
