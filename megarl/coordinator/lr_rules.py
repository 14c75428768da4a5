"""Learning-rate rules for a changed batch size: lr(b) from a reference (b_ref, lr_ref).

All batches here are in the same unit (the coordinator uses responses per step); b_noise is
the gradient noise scale B_simple in that unit (see `noise.py`).

Rules (S = b/b_ref):

* "none":     lr = lr_ref.
* "linear":   lr = lr_ref·S (Goyal et al. 2017, SGD).
* "sqrt":     lr = lr_ref·√S (square-root rule for Adam; Malladi et al. 2022,
              "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms", NeurIPS).
* "adascale": lr = lr_ref·√r with the AdaScale gain (Johnson et al. 2020, arXiv 2007.05105)
              r = (σ² + μ²)/(σ²/S + μ²). Mapping used here: μ² = |G|² (the true
              gradient's squared norm) and σ² = tr(Σ)/b_ref (the variance of the mean
              gradient at the reference batch, Σ being the per-sample covariance). Then
              r = S·(B_noise + b_ref)/(B_noise + b) with B_noise = tr(Σ)/|G|²: r ∈ [1, S] for
              S >= 1, and the same expression mirrors to r ∈ [S, 1] for S < 1 (a smaller
              batch lowers the LR by between 1 and √S). AdaScale's r scales an SGD step;
              for Adam we take √r, so the rule lies between "none" (noise-free limit)
              and "sqrt" (noise-dominated limit).
* "surge":    ε_opt(B) = ε_max / (½(√(B_noise/B) + √(B/B_noise))) (Li et al. 2024, "Surge
              Phenomenon in Optimal Learning Rate and Batch Size Scaling", arXiv 2405.14578,
              derived for Adam-style updates), peak ε_max at B = B_noise; ε_max is calibrated
              so that ε_opt(b_ref) = lr_ref. For B ≪ B_noise it reduces to the sqrt rule.

Missing statistics: "adascale" and "surge" fall back to the sqrt rule while the noise scale
is unknown (None). Every result is clipped to [lr_min, lr_max] by `apply_lr_rule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


def _check_batches(b: float, b_ref: float) -> None:
    if not b > 0:
        raise ValueError(f"batch b={b} must be > 0")
    if not b_ref > 0:
        raise ValueError(f"reference batch b_ref={b_ref} must be > 0")


def linear_rule(b: float, b_ref: float, lr_ref: float) -> float:
    """lr_ref·b/b_ref (linear scaling)."""
    _check_batches(b, b_ref)
    return lr_ref * b / b_ref


def sqrt_rule(b: float, b_ref: float, lr_ref: float) -> float:
    """lr_ref·√(b/b_ref) (Malladi et al. 2022 square-root scaling for Adam)."""
    _check_batches(b, b_ref)
    return lr_ref * math.sqrt(b / b_ref)


def adascale_gain(b: float, b_ref: float, g2: float, tr_sigma: float) -> float:
    """AdaScale gain r = (σ²+μ²)/(σ²/S+μ²), σ² = tr_sigma/b_ref, μ² = g2, S = b/b_ref.

    Degenerate statistics: g2 <= 0 with tr_sigma > 0 is pure noise (B_noise = ∞) → r = S;
    tr_sigma <= 0 is no noise → r = 1.
    """
    _check_batches(b, b_ref)
    s = b / b_ref
    if tr_sigma <= 0.0:
        return 1.0
    if g2 <= 0.0:
        return s
    sigma2 = tr_sigma / b_ref
    return (sigma2 + g2) / (sigma2 / s + g2)


def adascale_sqrt_rule(b: float, b_ref: float, lr_ref: float, g2: float, tr_sigma: float) -> float:
    """lr_ref·√r with r = `adascale_gain` (Adam form); lies between lr_ref and lr_ref·√S."""
    return lr_ref * math.sqrt(adascale_gain(b, b_ref, g2, tr_sigma))


def _surge_denominator(b: float, b_noise: float) -> float:
    """½(√(B_noise/B) + √(B/B_noise)), minimal (= 1) at B = B_noise."""
    return 0.5 * (math.sqrt(b_noise / b) + math.sqrt(b / b_noise))


def surge_rule(b: float, b_noise: float, lr_max: float) -> float:
    """ε_opt(B) = ε_max / (½(√(B_noise/B) + √(B/B_noise))) (Li et al. 2024)."""
    if not b > 0:
        raise ValueError(f"batch b={b} must be > 0")
    if not b_noise > 0:
        raise ValueError(f"b_noise={b_noise} must be > 0 for the surge rule")
    return lr_max / _surge_denominator(b, b_noise)


def surge_lr_max(b_ref: float, lr_ref: float, b_noise: float) -> float:
    """ε_max such that surge_rule(b_ref, b_noise, ε_max) == lr_ref."""
    if not b_ref > 0:
        raise ValueError(f"reference batch b_ref={b_ref} must be > 0")
    if not b_noise > 0:
        raise ValueError(f"b_noise={b_noise} must be > 0 for the surge rule")
    return lr_ref * _surge_denominator(b_ref, b_noise)


@dataclass(frozen=True, kw_only=True)
class LrInputs:
    """Everything a rule may need; batches in one unit (responses per step)."""

    b: float
    """Planned batch (samples per step)."""
    b_ref: float
    """Batch at which lr_ref was tuned (samples per step)."""
    lr_ref: float
    """Reference learning rate at b_ref."""
    g2: float | None = None
    """Smoothed |G|² (squared gradient norm units); None if not measured yet."""
    tr_sigma: float | None = None
    """Smoothed per-sample tr(Σ) in the same sample unit as b; None if not measured yet."""
    b_noise: float | None = None
    """B_simple = tr(Σ)/|G|² in samples; None if not measured yet."""


def _rule_none(x: LrInputs) -> float:
    return x.lr_ref


def _rule_linear(x: LrInputs) -> float:
    return linear_rule(x.b, x.b_ref, x.lr_ref)


def _rule_sqrt(x: LrInputs) -> float:
    return sqrt_rule(x.b, x.b_ref, x.lr_ref)


def _rule_adascale(x: LrInputs) -> float:
    if x.g2 is None or x.tr_sigma is None:
        return sqrt_rule(x.b, x.b_ref, x.lr_ref)
    return adascale_sqrt_rule(x.b, x.b_ref, x.lr_ref, x.g2, x.tr_sigma)


def _rule_surge(x: LrInputs) -> float:
    if x.b_noise is None or math.isinf(x.b_noise):
        return sqrt_rule(x.b, x.b_ref, x.lr_ref)
    if x.b_noise <= 0.0:
        # Limit B_noise → 0 of the calibrated ratio: lr_ref·√(b_ref/b).
        _check_batches(x.b, x.b_ref)
        return x.lr_ref * math.sqrt(x.b_ref / x.b)
    return surge_rule(x.b, x.b_noise, surge_lr_max(x.b_ref, x.lr_ref, x.b_noise))


LrRule = Callable[[LrInputs], float]

LR_RULES: dict[str, LrRule] = {
    "none": _rule_none,
    "linear": _rule_linear,
    "sqrt": _rule_sqrt,
    "adascale": _rule_adascale,
    "surge": _rule_surge,
}
"""Rules by config name (`CoordinatorConfig.lr_rule`)."""


def clip_lr(lr: float, lr_min: float, lr_max: float) -> float:
    """Clamp lr to [lr_min, lr_max]."""
    if not lr_min <= lr_max:
        raise ValueError(f"lr_min={lr_min} must be <= lr_max={lr_max}")
    return min(max(lr, lr_min), lr_max)


def apply_lr_rule(name: str, inputs: LrInputs, *, lr_min: float, lr_max: float) -> float:
    """LR_RULES[name](inputs) clipped to [lr_min, lr_max]."""
    try:
        rule = LR_RULES[name]
    except KeyError:
        raise ValueError(f"lr_rule={name!r} is not one of {sorted(LR_RULES)}") from None
    return clip_lr(rule(inputs), lr_min, lr_max)
