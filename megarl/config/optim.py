"""The ``optim`` section: the actor's Adam optimizer and LR schedule, and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from megarl.config.rules import fail


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final LR of the cosine schedule."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR schedule after warm-up; the cosine decays over ``train.steps`` − ``warmup_steps`` steps at
    the starting batch, counted in responses trained (the coordinator may change the batch)."""
    warmup_steps: int = 0
    """Linear warm-up, RL steps at the starting batch: over warmup_steps × rollout.num_prompts ×
    samples_per_prompt responses trained (``megarl.planning.schedule_lr``)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam ε."""
    clip_grad: float = 1.0
    """Global grad-norm clip (0 = off)."""

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("warmup_steps",)

    def validate(self) -> None:
        """A positive LR above the schedule's floor; Adam's β in [0, 1), ε > 0; clip and decay >= 0."""
        if not self.lr > 0:
            fail("optim.lr", self.lr, "must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            fail("optim.min_lr", self.min_lr, f"must be in [0, optim.lr={self.lr}]")
        if not 0 < self.adam_eps or not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1:
            fail(
                "optim.adam_beta1/adam_beta2/adam_eps",
                (self.adam_beta1, self.adam_beta2, self.adam_eps),
                "need β in [0, 1), ε > 0",
            )
        if self.clip_grad < 0 or self.weight_decay < 0:
            fail("optim.clip_grad/weight_decay", (self.clip_grad, self.weight_decay), "must be >= 0")
