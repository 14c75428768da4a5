"""The ``critic`` section: PPO's value model (its own Adam, value clip, initialisation) and its
own parallel layout (``critic.parallel``), and its own checks. Whether that layout splits the
model and the batch is :mod:`megarl.config.cross`'s rule (it needs the actor's layout and the
world size)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megarl.config.rules import fail


@dataclass(kw_only=True)
class CriticParallelConfig:
    tensor_parallel: int = 0
    """Critic tensor-parallel size (0 = parallel.tensor_parallel, the actor's)."""
    pipeline_parallel: int = 0
    """Critic pipeline stages (0 = parallel.pipeline_parallel). The critic's data-parallel size
    follows: trainer world size / (critic TP × PP)."""

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("tensor_parallel", "pipeline_parallel")  # 0: the actor's


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

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("warmup_steps",)

    def validate(self) -> None:
        """A value clip >= 0 and a positive LR."""
        if self.value_clip < 0:
            fail("critic.value_clip", self.value_clip, "must be >= 0 (0: no clipping)")
        if not self.lr > 0:
            fail("critic.lr", self.lr, "must be > 0")
