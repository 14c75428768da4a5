"""The ``warm_start`` section: supervised steps on the reference answers before RL (teaches the
answer format; :func:`megarl.warm_start.warm_start`), and its own check. Whether its batch
splits over the DP ranks is :mod:`megarl.config.cross`'s rule.

``stop_at_exact`` ends the warm start on what it has taught rather than after a fixed count:
a small model learns to copy (a tool call's operands from the prompt, the tool's result into
its answer) abruptly, at a step that varies by seed, and greedy accuracy jumps from 0 to near
its ceiling within ~10 steps (benchmarks/agent_learning.py). A fixed ``steps`` then leaves RL either
no reward at all or little left to learn, by the luck of the seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megarl.config.rules import fail


@dataclass(kw_only=True)
class WarmStartConfig:
    steps: int = 0
    """Supervised steps on the task's reference answers before RL (the most, with stop_at_exact; 0 = none)."""
    lr: float = 1e-3
    """SFT learning rate."""
    batch_size: int = 64
    """SFT sequences per step."""
    stop_at_exact: float = 0.0
    """Stop before ``steps`` once this share of a step's examples is reproduced exactly: every learned
    id the model's top choice given the ones before (teacher-forced, so what greedy decoding would
    write on those training rows), measured on the step's batch before its update. 0 = always run
    ``steps``. A share in (0, 1) leaves RL a policy with some greedy reward and room above it."""

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("steps",)

    def validate(self) -> None:
        """A positive LR; a stopping share in [0, 1]."""
        if not self.lr > 0:
            fail("warm_start.lr", self.lr, "must be > 0")
        if not 0 <= self.stop_at_exact <= 1:
            fail("warm_start.stop_at_exact", self.stop_at_exact, "must be in [0, 1] (a share of the examples)")
