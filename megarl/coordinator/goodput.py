"""Goodput-maximising choice of the rollout batch (Pollux, Qiao et al., OSDI'21, §3).

Statistical efficiency (Pollux §3.1, with its φ_t = B_noise and M0 = B0):

    efficiency(B) = (B_noise + B0) / (B_noise + B)

Derivation from McCandlish et al. 2018 (arXiv 1812.06162, §2.3): reaching a target
needs E(B) = E_min·(1 + B/B_noise) samples at batch B, so one sample at batch B is worth
E(B0)/E(B) = (B_noise + B0)/(B_noise + B) samples at batch B0. Goodput is then

    goodput(B) = throughput(B) · efficiency(B) = B/step_time(B) · (B_noise + B0)/(B_noise + B)

in **B0-equivalent samples per second**: the rate of statistical progress measured as
"samples processed at the reference batch B0". Time to a target is ∝ 1/goodput. B0 only
scales goodput by a constant, so it never changes the argmax; it does fix the unit of the
reported number (the coordinator uses its initial batch, so the number is comparable over
a run; `choose_batch` defaults to the current batch).

For t(B) = alpha + beta·B the maximum is at B* = √(alpha·B_noise/beta): setting
d/dB [B/((alpha + beta·B)(B_noise + B))] = 0 gives alpha·B_noise = beta·B². Tests use this
closed form.

The grid is over *prompts*: a step has prompts x samples_per_prompt responses (GRPO groups
must stay whole), and the response count must be divisible by `divisor` (e.g. DP size x
micro-batch), i.e. prompts must be a multiple of divisor/gcd(divisor, samples_per_prompt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class TimeModel(Protocol):
    """Anything that predicts seconds per step for a batch of b responses."""

    def predict(self, b: float) -> float: ...


def efficiency(b: float, b_noise: float, b0: float) -> float:
    """(B_noise + B0)/(B_noise + B): per-sample progress at batch b relative to batch b0."""
    if not (b > 0 and b0 > 0):
        raise ValueError(f"batches must be > 0, got b={b}, b0={b0}")
    if not b_noise >= 0:
        raise ValueError(f"b_noise={b_noise} must be >= 0")
    if math.isinf(b_noise):  # the limit: every sample counts fully, whatever the batch
        return 1.0
    return (b_noise + b0) / (b_noise + b)


def goodput(b: float, b_noise: float, b0: float, step_time_s: float) -> float:
    """B0-equivalent samples per second: (b/step_time_s)·efficiency(b, b_noise, b0)."""
    if not step_time_s > 0:
        raise ValueError(f"step_time_s={step_time_s} must be > 0 for batch {b}")
    return b / step_time_s * efficiency(b, b_noise, b0)


@dataclass(frozen=True, kw_only=True)
class BatchGrid:
    """Geometric grid of prompt counts that respects group size and divisibility."""

    samples_per_prompt: int
    """Responses per prompt (GRPO group size)."""
    min_prompts: int
    """Smallest number of prompts per step."""
    max_prompts: int
    """Largest number of prompts per step."""
    factor: float = 2.0**0.5
    """Ratio between neighbouring grid points (> 1)."""
    divisor: int = 1
    """Responses per step must be a multiple of this (e.g. DP size x micro-batch size)."""

    @property
    def prompt_step(self) -> int:
        """Prompt counts must be multiples of this: divisor / gcd(divisor, samples_per_prompt)."""
        return self.divisor // math.gcd(self.divisor, self.samples_per_prompt)

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt={self.samples_per_prompt} must be >= 1")
        if self.min_prompts < 1:
            raise ValueError(f"min_prompts={self.min_prompts} must be >= 1")
        if self.max_prompts < self.min_prompts:
            raise ValueError(f"max_prompts={self.max_prompts} must be >= min_prompts={self.min_prompts}")
        if not self.factor > 1.0:
            raise ValueError(f"grid_factor={self.factor} must be > 1")
        if self.divisor < 1:
            raise ValueError(f"divisor={self.divisor} must be >= 1")
        step = self.prompt_step
        if -(-self.min_prompts // step) * step > self.max_prompts:
            raise ValueError(
                f"no prompt count in [min_prompts={self.min_prompts}, max_prompts="
                f"{self.max_prompts}] is a multiple of {step} (needed so that prompts x "
                f"samples_per_prompt={self.samples_per_prompt} is divisible by "
                f"divisor={self.divisor})"
            )

    def is_valid(self, prompts: int) -> bool:
        """True if `prompts` is inside the bounds and satisfies divisibility."""
        return (
            self.min_prompts <= prompts <= self.max_prompts and (prompts * self.samples_per_prompt) % self.divisor == 0
        )

    def prompts(self) -> list[int]:
        """Sorted distinct valid prompt counts near min·factor^k, including both ends."""
        self.validate()
        step = self.prompt_step
        lo = -(-self.min_prompts // step) * step
        hi = self.max_prompts // step * step
        out = {lo, hi}
        x = float(lo)
        while x < hi:
            q = round(x / step) * step
            out.add(min(max(q, lo), hi))
            x *= self.factor
        return sorted(out)


@dataclass(frozen=True, kw_only=True)
class BatchChoice:
    """Result of `choose_batch`."""

    num_prompts: int
    """Prompts per step to use next."""
    goodput: float
    """Predicted goodput at num_prompts (B0-equivalent responses per second)."""
    current_goodput: float
    """Predicted goodput at the current prompt count (same unit)."""
    best_prompts: int
    """Grid argmax of goodput (may differ from num_prompts because of hysteresis)."""
    gain: float
    """best goodput / current goodput - 1."""
    switched: bool
    """True if num_prompts differs from the current prompt count."""
    reason: str
    """Human-readable explanation for logs."""


def choose_batch(
    grid: BatchGrid,
    b_noise: float,
    time_model: TimeModel,
    current: int,
    *,
    min_gain: float = 0.05,
    b0: float | None = None,
) -> BatchChoice:
    """Pick the prompt count with the best predicted goodput; switch only for > min_gain.

    Args:
        grid: candidate prompt counts and their constraints.
        b_noise: noise scale in responses (>= 0).
        time_model: predicts seconds per step from responses per step.
        current: prompt count in use now (need not lie on the grid).
        min_gain: hysteresis; switch only if best/current - 1 > min_gain.
        b0: reference batch for the goodput unit, responses; defaults to the current batch.

    Returns:
        The choice; `num_prompts == current` unless the gain exceeds min_gain.
    """
    if current < 1:
        raise ValueError(f"current={current} prompts must be >= 1")
    if not min_gain >= 0:
        raise ValueError(f"min_gain={min_gain} must be >= 0")
    spp = grid.samples_per_prompt
    ref = float(b0) if b0 is not None else float(current * spp)

    def score(prompts: int) -> float:
        b = float(prompts * spp)
        return goodput(b, b_noise, ref, time_model.predict(b))

    cur = score(current)
    best_p, best = current, cur
    for p in grid.prompts():
        g = score(p)
        if g > best:
            best_p, best = p, g
    gain = best / cur - 1.0
    if best_p != current and gain > min_gain:
        reason = (
            f"switch {current}->{best_p} prompts: predicted goodput +{100 * gain:.1f}% "
            f"(b_noise={b_noise:.4g} responses)"
        )
        return BatchChoice(
            num_prompts=best_p,
            goodput=best,
            current_goodput=cur,
            best_prompts=best_p,
            gain=gain,
            switched=True,
            reason=reason,
        )
    if best_p == current:
        reason = f"keep {current} prompts: best on grid (b_noise={b_noise:.4g} responses)"
    else:
        reason = f"keep {current} prompts: best {best_p} gains {100 * gain:.1f}% <= min_gain {100 * min_gain:.1f}%"
    return BatchChoice(
        num_prompts=current,
        goodput=cur,
        current_goodput=cur,
        best_prompts=best_p,
        gain=gain,
        switched=False,
        reason=reason,
    )
