"""When to change the batch, and what a change does to Adam: the coordinator's decision rules.

1. **First move straight to the optimum.** Once the noise estimate holds enough degrees of
   freedom (`CoordinatorConfig.min_dof`), the batch jumps to the goodput argmax over the
   whole grid (`choose_batch` with no gain threshold) instead of walking towards it: every
   step spent at a bad batch costs time, and the argmax is as good a guess as any midpoint.

2. **Then hold inside a band (hysteresis).** Goodput is flat near its maximum and the
   estimate is noisy, so re-taking the point argmax every few steps flips between
   neighbours (the demo went 512 → 1024 → 384 → 1024). The optimum B*(B_noise) is
   increasing in B_noise (for t = α + β·B, B* = √(α·B_noise/β)), so the B_noise band
   [low, high] maps to a band of optima [B*(low), B*(high)]. The batch is kept while it
   lies inside that band — the data cannot tell it from the optimum — and moves to the
   point argmax (which lies inside the band) only when it falls outside *and* the
   predicted gain exceeds `min_gain`. An estimate must then drift by more than its own
   uncertainty to move the batch, and one move cannot be undone by noise of the same size.

   The band's upper end is capped at ``band_ratio`` (4×) times the point estimate. The
   B_noise band's upper end is (T + z·se_T)/(G − z·se_G): infinite whenever |G|² is not
   resolved from zero, and then every batch above B*(low) counts as "inside", up to the
   grid's largest. With t = α + β·B, B* = √(α·B_noise/β), so a 4× cap keeps a held batch
   within 2× above the point optimum: the bound of one tracking move. Only the upper end is
   capped (why, and what it did on the benchmark: docs/COORDINATOR.md §2).

   A move after the first jump changes the batch by at most ``track_factor`` (2×): once the
   estimate has settled, B_noise drifts over tens of steps, so a decision asking for more is
   far more likely a dip of the |G|² estimate than news (measured: one such dip sent a run
   from 192 to 704 responses for ten steps, docs/COORDINATOR.md §5); a real change is
   followed in several moves, one per cooldown.

3. **Adam's second moments follow what the optimizer sees** (`adam_v_scale`). Per element,
   Adam's v tracks E[g̃²] of the gradient g̃ it is handed, which under global-norm clipping
   (``optim.clip_grad`` = c; the coordinator requires it) is g̃ = min(1, c/|g|)·g, so summed
   over parameters v tracks E|g̃|² = E[min(|g|², c²)]. Before clipping, the step's gradient
   over its batch B (the optimizer step's batch: B_rollout/mini_batches) has
   E|g_B|² = |G|² + tr(Σ)/B (McCandlish et al. 2018, App. A), so B_old → B_new moves it by

       ρ = (|G|² + tr Σ/B_new)/(|G|² + tr Σ/B_old) = B_old·(B_noise + B_new) / (B_new·(B_noise + B_old)),

   between B_old/B_new (noise-dominated, B ≪ B_noise) and 1 (B ≫ B_noise). The factor for v is
   the change of the *post-clip* expectation. It is taken from the optimizer's own pre-clip
   norms |g_t|² of recent steps (measured at B_t), each carried to a batch B by ρ(B_t → B)
   (the noise model moves only the level of the distribution, not its shape):

       r = mean_t min(ρ(B_t→B_new)·|g_t|², c²) / mean_t min(ρ(B_t→B_old)·|g_t|², c²).

   Clipped on every step at both batches (a demo run: pre-clip norm 1.2–10.9 against c = 1 on
   200 of 200 steps) r = 1: the optimizer saw unit-norm gradients at either batch, and the
   noise-model factor alone (512 → 128 at B_noise 1000: v × 2.98) would have shrunk every later
   update by 0.58 for ~1/(1−β2) steps. Never clipped, r = ρ. Without the rescale, v keeps the
   old batch's level for ~1/(1-β2) steps (1000 at β2 = 0.999). ρ uses the raw noise scale, not
   ``noise_calibration`` (a correction of the batch decision, not of E|g_B|²). One scalar for
   all elements is the approximation (each element has its own signal-to-noise ratio).

Invariants: pure Python, no state; batches in responses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megarl.coordinator.goodput import BatchGrid, TimeModel, choose_batch


@dataclass(frozen=True, kw_only=True)
class Decision:
    """A prompt count and why."""

    prompts: int
    reason: str


def jump(grid: BatchGrid, b_noise: float, time_model: TimeModel, current: int, b0: float) -> Decision:
    """Rule 1: the goodput argmax over the whole grid, whatever the distance."""
    c = choose_batch(grid, b_noise, time_model, current, min_gain=0.0, b0=b0)
    what = f"first estimate: jump {current}->{c.best_prompts}" if c.switched else f"first estimate: keep {current}"
    return Decision(prompts=c.num_prompts, reason=f"{what} prompts (b_noise={b_noise:.4g} responses)")


def optimum_band(
    grid: BatchGrid, band: tuple[float, float], time_model: TimeModel, current: int, b0: float
) -> tuple[int, int]:
    """(B*(low), B*(high)) in prompts: the grid argmax at each end of the B_noise band."""
    lo = choose_batch(grid, band[0], time_model, current, min_gain=0.0, b0=b0).best_prompts
    hi = choose_batch(grid, band[1], time_model, current, min_gain=0.0, b0=b0).best_prompts
    return lo, hi


def hold_or_move(
    grid: BatchGrid,
    b_noise: float,
    band: tuple[float, float] | None,
    time_model: TimeModel,
    current: int,
    *,
    min_gain: float,
    b0: float,
    band_ratio: float = 0.0,
) -> Decision:
    """Rule 2: keep `current` inside the band of optima, else move to the point argmax.

    Without a band (one step observed) the band collapses to the point estimate, i.e. the
    plain argmax with the `min_gain` threshold. ``band_ratio`` r > 0 caps the B_noise band's
    upper end at r·b_noise first (it is infinite while |G|² is not resolved).
    """
    if band is not None and band_ratio > 0:
        band = (band[0], min(band[1], b_noise * band_ratio))
    if band is not None:
        lo, hi = optimum_band(grid, band, time_model, current, b0)
        if lo <= current <= hi:
            return Decision(
                prompts=current,
                reason=f"keep {current} prompts: inside the optimum band [{lo}, {hi}] "
                f"(b_noise band [{band[0]:.4g}, {band[1]:.4g}] responses)",
            )
    c = choose_batch(grid, b_noise, time_model, current, min_gain=min_gain, b0=b0)
    return Decision(prompts=c.num_prompts, reason=c.reason)


def limit_move(grid: BatchGrid, current: int, target: int, factor: float) -> int:
    """Rule 2's step limit: ``target``, or the grid point nearest it within [current/factor,
    current·factor] on its side (``current`` when there is none); ``factor`` 0: no limit."""
    if factor <= 0 or current / factor <= target <= current * factor:
        return target
    if target > current:
        ok = [p for p in grid.prompts() if current < p <= current * factor]
        return max(ok, default=current)
    ok = [p for p in grid.prompts() if current / factor <= p < current]
    return min(ok, default=current)


def noise_sq_ratio(b_from: float, b_to: float, b_noise: float | None) -> float:
    """E|g_{b_to}|² / E|g_{b_from}|² before clipping (rule 3's ρ); B_noise unknown is the
    noise-dominated limit b_from/b_to, B_noise = inf the noise-free 1."""
    if not (b_from > 0 and b_to > 0):
        raise ValueError(f"batches must be > 0, got b_from={b_from}, b_to={b_to}")
    if b_noise is None:
        return b_from / b_to
    if not b_noise >= 0:
        raise ValueError(f"b_noise={b_noise} must be >= 0")
    if math.isinf(b_noise):
        return 1.0
    return b_from * (b_noise + b_to) / (b_to * (b_noise + b_from))


def adam_v_scale(
    b_old: float,
    b_new: float,
    b_noise: float | None,
    *,
    sq_norms: Sequence[tuple[float, float]] = (),
    clip: float = 0.0,
) -> float:
    """Rule 3: E|g̃_{B_new}|² / E|g̃_{B_old}|² of the gradient g̃ the optimizer is handed.

    ``b_old``, ``b_new``: the optimizer step's batch before and after, in the unit of
    ``b_noise`` (the raw noise scale; None while unknown). ``sq_norms``: (batch B_t, pre-clip
    |g_t|²) of recent optimizer steps; ``clip``: the global-norm clip c (0: none). Without
    norms or clip the factor is the noise model's ρ(B_old → B_new)."""
    rho = noise_sq_ratio(b_old, b_new, b_noise)
    if not (clip > 0 and sq_norms):
        return rho
    cap = clip * clip

    def seen(b: float) -> float:  # mean post-clip squared norm at batch b
        return sum(min(sq * noise_sq_ratio(bt, b, b_noise), cap) for bt, sq in sq_norms) / len(sq_norms)

    before = seen(b_old)
    return seen(b_new) / before if before > 0 else rho
