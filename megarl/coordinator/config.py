"""Settings of the critical-batch-size coordinator (one typed, validated section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.coordinator.goodput import BatchGrid
from megarl.coordinator.lr_rules import LR_RULES
from megarl.coordinator.noise import KIND_ADAM, KIND_PLAIN, NoiseKind


@dataclass(kw_only=True)
class CoordinatorConfig:
    """Settings of the critical-batch-size coordinator."""

    enabled: bool = True
    """Adapt batch and LR; when False the coordinator only measures (batch = initial,
    lr = lr_ref, equal DP shares)."""
    samples_per_prompt: int = 8
    """Responses per prompt (GRPO group size), fixed."""
    initial_prompts: int = 32
    """Prompts per step until the first change."""
    min_prompts: int = 8
    """Smallest prompts per step the coordinator may choose."""
    max_prompts: int = 512
    """Largest prompts per step the coordinator may choose."""
    grid_factor: float = 2.0**0.5
    """Ratio between neighbouring candidate prompt counts (> 1)."""
    batch_divisor: int = 1
    """Responses per step must be a multiple of this (DP size x micro-batch size)."""
    dp_size: int = 1
    """Data-parallel ranks sharing the batch (length of StepPlan.dp_shares)."""
    min_gain: float = 0.05
    """Switch batch only if predicted goodput improves by more than this fraction."""
    warmup_steps: int = 10
    """Observed steps before the batch may change, steps."""
    cooldown_steps: int = 5
    """Steps after a batch change before the next change, steps."""
    ema_beta: float = 0.95
    """EMA decay per step for |G|², tr(Σ), per-rank throughput and other timings."""
    band_z: float = 2.0
    """Width of the reported B_noise band in (approximate) standard errors."""
    noise_kind: NoiseKind = KIND_PLAIN
    """Which noise scale drives decisions: "plain" or "adam" (preconditioned gradients)."""
    noise_calibration: float = 1.0
    """Multiplier on B_simple before use (Merrill et al. 2025: the proxy can underestimate)."""
    batch_models: list[str] | None = None
    """Models whose noise scale decides the batch; None means every observed model."""
    lr_rule: str = "sqrt"
    """LR rule name: "none", "linear", "sqrt", "adascale" or "surge"."""
    lr_min: float = 0.0
    """Lower clip for every planned learning rate."""
    lr_max: float = 1.0
    """Upper clip for every planned learning rate."""
    b_ref: dict[str, float] = field(default_factory=dict)
    """Per model: batch (responses per step) at which lr_ref was tuned; default initial."""
    lr_ref: dict[str, float] = field(default_factory=dict)
    """Per model: learning rate tuned at b_ref; every observed model must have one."""
    time_window: int = 32
    """Observations kept by each step-time least-squares fit, steps."""
    prior_fixed_fraction: float = 0.3
    """Assumed batch-independent fraction of phase time until two batch sizes were seen."""
    measure_first_minibatch_only: bool = True
    """Contract for the trainer: report norms of the first mini-batch of each rollout only
    (later PPO epochs reuse the samples and would bias tr(Σ) low)."""

    @property
    def initial_batch(self) -> int:
        """initial_prompts x samples_per_prompt, responses."""
        return self.initial_prompts * self.samples_per_prompt

    def grid(self) -> BatchGrid:
        """The candidate grid these settings describe."""
        return BatchGrid(
            samples_per_prompt=self.samples_per_prompt,
            min_prompts=self.min_prompts,
            max_prompts=self.max_prompts,
            factor=self.grid_factor,
            divisor=self.batch_divisor,
        )

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the rule."""
        grid = self.grid()
        grid.validate()
        if not grid.is_valid(self.initial_prompts):
            raise ValueError(
                f"initial_prompts={self.initial_prompts} must lie in [min_prompts="
                f"{self.min_prompts}, max_prompts={self.max_prompts}] and make "
                f"initial_prompts x samples_per_prompt={self.samples_per_prompt} divisible "
                f"by batch_divisor={self.batch_divisor}"
            )
        if self.dp_size < 1:
            raise ValueError(f"dp_size={self.dp_size} must be >= 1")
        if not self.min_gain >= 0:
            raise ValueError(f"min_gain={self.min_gain} must be >= 0")
        if self.warmup_steps < 0 or self.cooldown_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} and cooldown_steps={self.cooldown_steps} must be >= 0")
        if not 0.0 <= self.ema_beta < 1.0:
            raise ValueError(f"ema_beta={self.ema_beta} must be in [0, 1)")
        if not self.band_z > 0:
            raise ValueError(f"band_z={self.band_z} must be > 0")
        if self.noise_kind not in (KIND_PLAIN, KIND_ADAM):
            raise ValueError(f"noise_kind={self.noise_kind!r} must be 'plain' or 'adam'")
        if not self.noise_calibration > 0:
            raise ValueError(f"noise_calibration={self.noise_calibration} must be > 0")
        if self.lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule={self.lr_rule!r} must be one of {sorted(LR_RULES)}")
        if not 0.0 <= self.lr_min <= self.lr_max:
            raise ValueError(f"need 0 <= lr_min={self.lr_min} <= lr_max={self.lr_max}")
        for name, b in self.b_ref.items():
            if not b > 0:
                raise ValueError(f"b_ref[{name!r}]={b} must be > 0 responses")
        for name, lr in self.lr_ref.items():
            if not lr > 0:
                raise ValueError(f"lr_ref[{name!r}]={lr} must be > 0")
        for name in self.batch_models or []:
            if name not in self.lr_ref:
                raise ValueError(f"batch_models contains {name!r}, which has no lr_ref (known: {sorted(self.lr_ref)})")
        if self.time_window < 2:
            raise ValueError(f"time_window={self.time_window} must be >= 2")
        if not 0.0 <= self.prior_fixed_fraction < 1.0:
            raise ValueError(f"prior_fixed_fraction={self.prior_fixed_fraction} must be in [0, 1)")
