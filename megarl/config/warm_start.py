"""The ``warm_start`` section: supervised steps on the reference answers before RL (teaches the
answer format; :func:`megarl.warm_start.warm_start`), and its own check. Whether its batch
splits over the DP ranks is :mod:`megarl.config.cross`'s rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megarl.config.rules import fail


@dataclass(kw_only=True)
class WarmStartConfig:
    steps: int = 0
    """Supervised steps on the task's reference answers before RL (0 = none)."""
    lr: float = 1e-3
    """SFT learning rate."""
    batch_size: int = 64
    """SFT sequences per step."""

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("steps",)

    def validate(self) -> None:
        """A positive LR."""
        if not self.lr > 0:
            fail("warm_start.lr", self.lr, "must be > 0")
