"""The gradient noise split by prompt: between-prompt and within-prompt variance, from the
same micro-batch gradients the two-batch estimate reads (docs/COORDINATOR.md §1, "Between and
within prompts").

Model. A GRPO step trains P prompts × S samples. The S gradients of one prompt are exchangeable
(the group-centred advantage makes them depend on each other, so not independent): per unit
(response or token) tr Var(g) = V and tr Cov(g_i, g_j) = C for two units of one prompt, and
prompts are independent. The mean over P·S units then has

    tr Var(Ḡ) = (V + (S-1)·C)/(P·S) = σ_b²/P + σ_w²/(P·S),   σ_b² = C,  σ_w² = V - C,

σ_b² the variance of the prompt-mean gradients (what more prompts average away), σ_w² the
within-prompt variance (what more samples per prompt average away). With i.i.d. samples around
a prompt mean, C is the variance of that mean; a group-centred advantage makes C smaller (it can
even be negative), and both depend somewhat on S (the baseline's own noise): the estimates are
exact at the measured S and extrapolated to other S by holding σ_b², σ_w² fixed.

Parts. The probe reads, for each part p (one GRPO group, n_p units with signal, its two halves
h1, h2 each holding half the group's responses, n_1 + n_2 = n_p): the squared norm of the part's
mean gradient |ḡ_p|² (the two-batch estimate's small batches) and of its halves' difference of
sums, per the part's units: |d_p|² = |Σ_{h1} g - Σ_{h2} g|²/n_p².

Within (halves within a prompt): the prompt's shared part cancels in the difference, so

    E|Σ_{h1} g - Σ_{h2} g|² = (n_1 - n_2)²·(|G|² + C) + n_p·(V - C)

(for n_1 = n_2 only the second term), and E|Σ_p g|² = n_p²·(|G|² + C) + n_p·(V - C). With
c_p = ((n_1 - n_2)/n_p)², E[|d_p|² - c_p·|ḡ_p|²]·n_p² = n_p·(1 - c_p)·σ_w², hence the unbiased

    σ̂_w² = Σ_p n_p²·(|d_p|² - c_p·|ḡ_p|²) / Σ_p n_p·(1 - c_p).

Between (halves by prompt): the two-batch estimate over whole-group parts (``dp_estimates``,
sample-weighted, McCandlish et al. 2018 App. A) has E[T̂] = n_eff·σ_b² + σ_w² with
n_eff = (N - Σ n_p²/N)/(K - 1) for K parts of N units (= n for K equal parts: the per-response
noise at group size S is S·σ_b² + σ_w²). So σ̂_b² = (T̂ - σ̂_w²)/n_eff, unbiased as a linear
combination of unbiased terms. Comparing two whole groups, E|ḡ_p - ḡ_q|² = 2σ_b² + 2σ_w²/n;
two halves of one group, E|ḡ_{p,1} - ḡ_{p,2}|² = 4σ_w²/n: the estimate is that comparison
over every part at once.

Invariants: pure Python floats in and out; nothing here knows about processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from megarl.coordinator.noise import _Moments, decay_for, dp_estimates


def within_variance(part_sq: Sequence[float], diff_sq: Sequence[float], halves: Sequence[tuple[float, float]]) -> float:
    """σ̂_w², per unit, from each part's |ḡ_p|², its halves' |d_p|² and the halves' units (n_1, n_2)."""
    if not len(part_sq) == len(diff_sq) == len(halves):
        raise ValueError(f"within_variance: {len(part_sq)} parts, {len(diff_sq)} differences, {len(halves)} halves")
    num = den = 0.0
    for sq, d, (n1, n2) in zip(part_sq, diff_sq, halves, strict=True):
        if n1 < 0 or n2 < 0:
            raise ValueError(f"within_variance: half units ({n1}, {n2}) must be >= 0")
        n = n1 + n2
        if n <= 0:
            continue
        c = ((n1 - n2) / n) ** 2
        num += n * n * (d - c * sq)
        den += n * (1.0 - c)
    if den <= 0:
        raise ValueError("within_variance: no part has units in both halves")
    return num / den


def effective_group(batches: Sequence[float]) -> float:
    """n_eff = (N - Σ n_p²/N)/(K - 1): units per part the sample-weighted tr Σ counts σ_b² at."""
    if len(batches) < 2:
        raise ValueError(f"effective_group: need at least 2 parts, got {len(batches)}")
    total = float(sum(batches))
    return (total - sum(b * b for b in batches) / total) / (len(batches) - 1)


def prompt_split(
    part_sq: Sequence[float],
    batches: Sequence[float],
    global_sq: float,
    diff_sq: Sequence[float],
    halves: Sequence[tuple[float, float]],
) -> tuple[float, float]:
    """(σ̂_b², σ̂_w²) per unit of one step: parts are single GRPO groups (``batches``: their
    units), ``global_sq`` the step's |Ḡ|² (sample-weighted mean of the parts)."""
    _, tr_sigma = dp_estimates(part_sq, batches, global_sq, grad_average="samples")
    within = within_variance(part_sq, diff_sq, halves)
    return (tr_sigma - within) / effective_group(batches), within


def within_share(between: float, within: float, units_per_group: float) -> float | None:
    """σ_w²/(n·σ_b² + σ_w²), the within-prompt share of the per-unit noise at n units a group,
    each part clamped at 0 (a noisy estimate can come out negative); None when both are <= 0."""
    b, w = max(between, 0.0), max(within, 0.0)
    total = units_per_group * b + w
    return None if total <= 0 else w / total


def noise_ratio(share: float, samples: float, samples_ref: float) -> float:
    """B_noise(S)/B_noise(S_ref) = T(S)/T(S_ref) for T(S) = S·σ_b² + σ_w² (per response) and the
    within share ``share`` of T(S_ref): (1 - share)·S/S_ref + share."""
    return (1.0 - share) * samples / samples_ref + share


def effective_batch(prompts: float, samples: float, share: float, samples_ref: float) -> float:
    """The batch at S_ref whose mean gradient is as noisy as P prompts × S samples:
    tr Var = T(S)/(P·S) = T(S_ref)/B_eff, so B_eff = P·S/noise_ratio(share, S, S_ref). Equals P·S
    at S = S_ref; P·S_ref when all the noise is between prompts; P·S when all of it is within."""
    return prompts * samples / noise_ratio(share, samples, samples_ref)


class SplitEstimator:
    """Smoothed σ_b², σ_w² (per unit) and units per group, each step weighted by its degrees of
    freedom and decayed like the model's `noise.NoiseScaleEstimator` (``beta`` per step, or
    exp(-dof/horizon_dof)), so the split and B_simple average the same steps."""

    def __init__(self, beta: float, horizon_dof: float = 0.0):
        self.beta, self.horizon_dof = beta, horizon_dof
        self.steps = 0
        self._between, self._within, self._units = _Moments(), _Moments(), _Moments()

    def update(self, between: float, within: float, units_per_response: float, dof: float) -> None:
        """Add one step's (σ̂_b², σ̂_w², n_eff/S) made with ``dof`` degrees of freedom."""
        if not all(math.isfinite(x) for x in (between, within, units_per_response)):
            raise ValueError(f"non-finite noise split: between={between}, within={within}, units={units_per_response}")
        b = decay_for(dof, self.horizon_dof) if self.horizon_dof else self.beta
        self.steps += 1
        for m, x in ((self._between, between), (self._within, within), (self._units, units_per_response)):
            m.update(x, dof, b)

    @property
    def between(self) -> float | None:
        """EMA of σ_b², per unit (None before the first update)."""
        return self._between.mean if self.steps else None

    @property
    def within(self) -> float | None:
        """EMA of σ_w², per unit (None before the first update)."""
        return self._within.mean if self.steps else None

    @property
    def units_per_response(self) -> float | None:
        """EMA of the units (responses or tokens) per response of the groups measured: n_eff/S."""
        return self._units.mean if self.steps else None

    def share(self, samples: float) -> float | None:
        """The within-prompt share of the per-unit noise at ``samples`` per prompt (`within_share`)."""
        if not self.steps:
            return None
        return within_share(self._between.mean, self._within.mean, self._units.mean * samples)

    def state_dict(self) -> dict[str, Any]:
        """JSON types."""
        ms = (self._between, self._within, self._units)
        return {"steps": self.steps, "moments": [[m.m1, m.m2, m.w, m.w2] for m in ms]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self._between, self._within, self._units = (_Moments(*(float(x) for x in m)) for m in state["moments"])
