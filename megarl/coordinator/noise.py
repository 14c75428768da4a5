"""Gradient noise scale B_simple = tr(Σ)/|G|² from data-parallel gradient norms.

Source: McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
Training", arXiv 1812.06162. With G the true gradient, Σ the per-sample gradient covariance
and G_B the mean gradient of B i.i.d. samples,

    E|G_B|² = |G|² + tr(Σ)/B                                   (§2.2 and App. A)

so two batch sizes B_small < B_big give unbiased estimates (App. A):

    |G|²  ≈ (B_big·|G_big|² - B_small·|G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)

and the "simple" noise scale (§2.2) is B_simple = tr(Σ)/|G|². Per-step estimates are very
noisy (|G|² can come out negative), so the two are smoothed by separate EMAs and B_simple is
the ratio of the EMAs (App. A), never an EMA of ratios.

Where the two batches come from:

* data parallel (`dp_estimates`): B_small is one rank's batch (its local gradient before the
  all-reduce), B_big the global batch (the averaged gradient) — free, no extra backward;
* one rank (`microbatch_estimates`): B_small is a micro-batch, B_big the whole step.

Units: a "sample" is whatever the loss averages over — a response when the loss is
sequence-averaged, a token when it is token-averaged (then B_simple is in tokens). The
callers must pass batches in that unit; the coordinator converts to responses.

Degrees of freedom: with K parts the tr(Σ) estimate is, in effect, a variance over K parts
(K - 1 degrees of freedom, the whole-batch mean being fitted); `parts_dof` counts them and the
estimator weights each step by them (see `NoiseScaleEstimator`).

Parts must be independent: a GRPO advantage is centred on its group's mean, so responses of
one group are negatively correlated; a part holding whole groups keeps the parts independent,
a part that splits groups does not (the trainer's micro-batches hold whole groups when the
micro-batch size is a multiple of the group size, docs/COORDINATOR.md §1).

Expert parallelism (EP > 1): the routed experts' parameters are estimated apart from the
others, each class from its own parts, and the two estimates are added
(`expert_parallel_estimates` has the derivation).

Adam-preconditioned variant (``coordinator.noise_kind: adam``): the trainer's probe weighs
every part's gradient and the reduced one element-wise by Adam's P = 1/(√v̂+ε) of the step
(``megarl.model.grad_stats``); the algebra here is unchanged, only its inputs are |P·g|².

Invariants: all functions are pure, take Python floats and return Python floats; nothing
here knows about processes or torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

GradAverage = Literal["samples", "ranks"]


def two_batch_estimates(g2_small: float, b_small: float, g2_big: float, b_big: float) -> tuple[float, float]:
    """Unbiased (|G|², tr Σ) from squared gradient norms at two batch sizes.

    McCandlish et al. 2018, App. A:
        |G|²  = (b_big·g2_big - b_small·g2_small) / (b_big - b_small)
        tr(Σ) = (g2_small - g2_big) / (1/b_small - 1/b_big)

    Args:
        g2_small: E-estimate of |G_small|², the squared norm of a mean gradient over b_small
            samples (may be an average of several such norms).
        b_small: samples in the small batch (> 0).
        g2_big: squared norm of the mean gradient over b_big samples.
        b_big: samples in the big batch (> b_small).

    Returns:
        (g2_true, tr_sigma); either can be negative on a single step.
    """
    if not b_small > 0:
        raise ValueError(f"b_small={b_small} must be > 0")
    if not b_big > b_small:
        raise ValueError(f"b_big={b_big} must be > b_small={b_small}")
    g2_true = (b_big * g2_big - b_small * g2_small) / (b_big - b_small)
    tr_sigma = (g2_small - g2_big) / (1.0 / b_small - 1.0 / b_big)
    return g2_true, tr_sigma


def _check_parts(sq_norms: Sequence[float], batches: Sequence[float], what: str) -> None:
    if len(sq_norms) != len(batches):
        raise ValueError(f"{what}: got {len(sq_norms)} squared norms but {len(batches)} batch sizes")
    if len(sq_norms) < 2:
        raise ValueError(f"{what}: need at least 2 parts for a two-batch estimate, got {len(sq_norms)}")
    for i, b in enumerate(batches):
        if not b > 0:
            raise ValueError(f"{what}: batch[{i}]={b} must be > 0")


def dp_estimates(
    local_sq_norms: Sequence[float],
    local_batches: Sequence[float],
    global_sq_norm: float,
    *,
    grad_average: GradAverage = "samples",
) -> tuple[float, float]:
    """(|G|², tr Σ) from one data-parallel step: per-rank local norms + the global norm.

    Derivation for unequal per-rank batches b_r (r = 1..D, B = Σ b_r). Each rank's local
    mean gradient G_r is independent with E|G_r|² = |G|² + tr(Σ)/b_r. The global gradient is
    G_big = Σ_r w_r·G_r with Σ w_r = 1, hence

        E|G_big|² = |G|² + tr(Σ)·Σ_r w_r²/b_r =: |G|² + tr(Σ)/B_big_eff.

    * grad_average="samples" (w_r = b_r/B, the true mean over all samples, e.g. a loss
      normalised by the global sample count): B_big_eff = B.
    * grad_average="ranks" (w_r = 1/D, each rank averages its own samples, then the
      all-reduce averages ranks — Megatron DDP's default): B_big_eff = D²/Σ_r(1/b_r).

    On the small side any convex combination Σ a_r|G_r|² has expectation
    |G|² + tr(Σ)·Σ a_r/b_r. We weight ranks by their sample count, a_r = b_r/B (ranks with
    more samples have less noisy norms), which gives Σ a_r/b_r = D/B, i.e. an effective
    small batch B_small_eff = B/D, the mean per-rank batch. With equal batches both cases
    reduce exactly to the textbook one (B_small = b, B_big = D·b, g2_small = mean of local
    norms). Both effective sizes are then fed to `two_batch_estimates`, which stays
    unbiased because only these expectations enter its derivation.

    Args:
        local_sq_norms: |G_r|² per DP rank, of the rank-local mean gradient before the
            all-reduce.
        local_batches: samples per rank (responses or tokens: the loss's averaging unit).
        global_sq_norm: |G_big|² of the gradient after the all-reduce.
        grad_average: how the global gradient weights ranks (see above).

    Returns:
        (g2_true, tr_sigma) for this step.
    """
    _check_parts(local_sq_norms, local_batches, "dp_estimates")
    d = len(local_batches)
    total = float(sum(local_batches))
    g2_small = sum(b * g for b, g in zip(local_batches, local_sq_norms, strict=True)) / total
    b_small = total / d
    if grad_average == "samples":
        b_big = total
    elif grad_average == "ranks":
        b_big = d * d / sum(1.0 / b for b in local_batches)
    else:
        raise ValueError(f"grad_average={grad_average!r} must be 'samples' or 'ranks'")
    if not b_big > b_small:
        raise ValueError(
            f"dp_estimates: per-rank batches {list(local_batches)} are too unbalanced for "
            f"grad_average={grad_average!r} (effective big batch {b_big:.4g} <= mean rank "
            f"batch {b_small:.4g})"
        )
    return two_batch_estimates(g2_small, b_small, global_sq_norm, b_big)


def microbatch_estimates(
    micro_sq_norms: Sequence[float],
    micro_batches: Sequence[float],
    step_sq_norm: float,
    *,
    grad_average: GradAverage = "ranks",
) -> tuple[float, float]:
    """(|G|², tr Σ) on a single rank from micro-batch norms and the accumulated step norm.

    Same derivation as `dp_estimates` with micro-batches in place of ranks: |G_small|² is the
    sample-weighted mean of the squared norms of each micro-batch's own mean gradient (the
    trainer must difference the accumulated gradient, not report the running sum), and
    |G_big|² the squared norm of the step gradient. The default grad_average="ranks" matches
    gradient accumulation where each micro-batch loss is a mean scaled by 1/num_micro.
    """
    _check_parts(micro_sq_norms, micro_batches, "microbatch_estimates")
    return dp_estimates(micro_sq_norms, micro_batches, step_sq_norm, grad_average=grad_average)


def expert_parallel_estimates(
    dense: tuple[float, float, int], experts: tuple[float, float, int]
) -> tuple[float, float, float]:
    """(|G|², tr Σ, dof) of a model whose routed experts are split over an EP group, from the
    two parameter classes' own estimates, each given as (|G_c|², tr Σ_c, parts).

    Why two classes. Megatron puts expert parallelism inside data parallelism: an expert lives
    on one rank of its EP group (E ranks), and in micro-batch k the all-to-all sends it every
    token of the group's micro-batches k that routes to it. So on rank r the dense gradient of
    micro-batch k is that of rank r's own n units, but its local experts' gradient is that of
    the union U_k of the E ranks' micro-batches k (E·n units). The whole buffer's change read as
    one part of n units (the old reading: with the loss over D units, its experts' share is
    (E·n/D)·ḡ_U, rescaled × (D/n)²) has E|g|² = |G_d|² + tr Σ_d/n + E²·(|G_e,r|² + tr Σ_e,r/(E·n))
    for rank r's experts e,r: over the group, E·|G_e|² in place of |G_e|², biased (tr Σ +44 % and
    |G|² −10 % in tests/coordinator/test_noise.py's example).

    With θ = (θ_d, θ_e) the per-sample gradient covariance splits into blocks, so

        |G|² = |G_d|² + |G_e|²,    tr Σ = tr Σ_dd + tr Σ_ee,

    and for any part P of m i.i.d. units (whole GRPO groups) each class's block of its mean
    gradient obeys E|ḡ_P,c|² = |G_c|² + tr Σ_cc/m (McCandlish et al. App. A, per block). So
    `dp_estimates` over the dense parts (each rank's own parts, n units) is unbiased for
    (|G_d|², tr Σ_dd), and over the expert parts (the unions U, E·n units) for (|G_e|², tr Σ_ee):
    an expert part's squared norm is Σ over the group's ranks of their local experts' |Δg|²,
    since the experts are disjoint across the group — each expert once, none lost. The sums are
    unbiased for (|G|², tr Σ). An expert part is independent of the others as a union of parts
    that are. At EP = 1 the classes share their parts and one estimate over all parameters is
    the same thing (the trainer then reports one class).

    Degrees of freedom: the expert class has E× fewer parts; the sum's tr Σ is no more certain
    than its less certain term, so the step counts the fewer parts' dof (`parts_dof`).
    """
    g2 = dense[0] + experts[0]
    tr_sigma = dense[1] + experts[1]
    return g2, tr_sigma, parts_dof(min(dense[2], experts[2]))


def parts_dof(parts: int) -> float:
    """Degrees of freedom of a two-batch estimate from `parts` independent parts: parts - 1."""
    if parts < 2:
        raise ValueError(f"need at least 2 parts for a noise estimate, got {parts}")
    return float(parts - 1)


@dataclass
class _Moments:
    """Weighted EMA sums: Σ β^age·w·x, Σ β^age·w·x², Σ β^age·w and Σ (β^age·w)²."""

    m1: float = 0.0
    m2: float = 0.0
    w: float = 0.0
    w2: float = 0.0

    def update(self, x: float, weight: float, beta: float) -> None:
        self.m1 = beta * self.m1 + weight * x
        self.m2 = beta * self.m2 + weight * x * x
        self.w = beta * self.w + weight
        self.w2 = beta * beta * self.w2 + weight * weight

    @property
    def mean(self) -> float:
        return self.m1 / self.w

    def stderr(self) -> float | None:
        """Standard error of `mean` for independent values with variance ∝ 1/weight.

        With normalised weights u_k = w_k/Σw the mean's variance is s²·Σu_k² (s² the
        per-unit-weight variance estimated from the same sums, reliability-weights form).
        """
        if self.w <= 0.0:
            return None
        u2 = self.w2 / (self.w * self.w)  # Σ u_k², 1/effective number of steps
        if u2 >= 1.0 - 1e-12:
            return None
        mean = self.mean
        var = max(self.m2 / self.w - mean * mean, 0.0) / (1.0 - u2)
        return math.sqrt(var * u2)


def decay_for(dof: float, horizon: float) -> float:
    """Per-step EMA decay for a horizon in degrees of freedom: exp(-dof/horizon).

    A fixed decay β per step holds ~1/(1-β) steps, i.e. ~(K-1)/(1-β) degrees of freedom for
    K = B/b parts a step, so the estimate's precision, and with it the hold band, follows the
    batch it is measured at: a small batch's band is wide enough to keep the batch where it
    is, whatever the point estimate says. A step of d degrees of freedom decaying the older
    ones by exp(-d/H) keeps the total weight near H (Σ_k d·e^{-k·d/H} = d/(1 - e^{-d/H}) ≈
    H + d/2) at any batch: the estimate holds the same information at 128 responses and at
    2048, over more steps where the steps are smaller."""
    if not (dof > 0 and horizon > 0):
        raise ValueError(f"decay_for: dof={dof} and horizon={horizon} must be > 0")
    return math.exp(-dof / horizon)


class NoiseScaleEstimator:
    """Smoothed |G|², tr(Σ) and B_simple = EMA(tr Σ)/EMA(|G|²) with an approximate band.

    Each step's (|G|², tr Σ) enters with weight β^age·dof, dof = its parts' degrees of freedom
    (`parts_dof`): the per-step estimates are unbiased and their variance falls ~1/dof, so
    weighting by dof is the inverse-variance (minimum-variance) combination, and a step from
    2 parts (1 dof) counts a seventh of one from 8 parts. The weighted mean Σβ^a·w·x / Σβ^a·w
    needs no bias correction (with equal weights it equals Adam's raw/(1-β^t)), so the first
    update returns the first value exactly. B_simple is None while EMA(|G|²) <= 0 (the signal
    is not yet resolved: the noise scale is effectively unbounded, and claiming a number
    would be wrong); it is clamped to 0 when EMA(tr Σ) <= 0 (no measurable noise).

    Band (approximate, documented as such): the same weighted sums of x² give the spread of
    the per-step values and hence the standard errors se_T, se_G of EMA(tr Σ) and EMA(|G|²)
    (`_Moments.stderr`). The band is the corner interval

        low  = max(0, T - z·se_T) / (G + z·se_G),
        high = (T + z·se_T) / (G - z·se_G)   (inf when G - z·se_G <= 0).

    The two per-step estimates are negatively correlated (an unlucky |G_small|² raises T and
    lowers G), so pairing the pessimistic ends is the relevant worst case. Per-step values
    are not independent when parameters move, so treat it as a z-sigma-ish band, not a
    confidence interval.
    """

    def __init__(self, beta: float = 0.95, z: float = 2.0, horizon_dof: float = 0.0):
        """``horizon_dof`` > 0: each step decays the older ones by exp(-dof/horizon_dof)
        (`decay_for`) instead of by ``beta``."""
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta={beta} must be in [0, 1)")
        if not z > 0:
            raise ValueError(f"z={z} must be > 0")
        if not (horizon_dof >= 0 and math.isfinite(horizon_dof)):
            raise ValueError(f"horizon_dof={horizon_dof} must be 0 (beta per step) or > 0 degrees of freedom")
        self.beta = beta
        self.z = z
        self.horizon_dof = horizon_dof
        self.steps = 0
        self.dof = 0.0
        """Discounted degrees of freedom behind the estimate, Σ β^age·dof."""
        self._g2 = _Moments()
        self._tr = _Moments()

    def update(self, g2: float, tr_sigma: float, dof: float = 1.0) -> None:
        """Add one step's (|G|², tr Σ) estimate (either may be negative) made with `dof`."""
        if not (math.isfinite(g2) and math.isfinite(tr_sigma)):
            raise ValueError(f"non-finite noise statistics: g2={g2}, tr_sigma={tr_sigma}")
        if not (dof > 0 and math.isfinite(dof)):
            raise ValueError(f"dof={dof} must be finite and > 0")
        b = decay_for(dof, self.horizon_dof) if self.horizon_dof else self.beta
        self.steps += 1
        self._g2.update(g2, dof, b)
        self._tr.update(tr_sigma, dof, b)
        self.dof = self._g2.w

    @property
    def g2(self) -> float | None:
        """Weighted EMA of |G|² (None before the first update)."""
        return self._g2.mean if self.steps else None

    @property
    def tr_sigma(self) -> float | None:
        """Weighted EMA of tr(Σ) (None before the first update)."""
        return self._tr.mean if self.steps else None

    @property
    def b_simple(self) -> float | None:
        """EMA(tr Σ)/EMA(|G|²) in samples; None while EMA(|G|²) <= 0 or before any update."""
        g2, tr = self.g2, self.tr_sigma
        if g2 is None or tr is None or g2 <= 0.0:
            return None
        return max(tr, 0.0) / g2

    def band(self) -> tuple[float, float] | None:
        """(low, high) approximate z-sigma band on B_simple; None before 2 updates."""
        g2, tr = self.g2, self.tr_sigma
        if g2 is None or tr is None or self.steps < 2:
            return None
        se_g, se_t = self._g2.stderr(), self._tr.stderr()
        if se_g is None or se_t is None:
            return None
        lo_den = g2 + self.z * se_g
        hi_den = g2 - self.z * se_g
        lo = max(tr - self.z * se_t, 0.0) / lo_den if lo_den > 0 else 0.0
        hi = max(tr + self.z * se_t, 0.0) / hi_den if hi_den > 0 else math.inf
        return lo, hi

    @property
    def b_simple_low(self) -> float | None:
        """Lower end of `band()` (None when the band is unknown)."""
        b = self.band()
        return None if b is None else b[0]

    @property
    def b_simple_high(self) -> float | None:
        """Upper end of `band()`; math.inf when |G|² is not resolved from zero."""
        b = self.band()
        return None if b is None else b[1]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (finite floats, ints and strings only)."""
        return {
            "beta": self.beta,
            "horizon_dof": self.horizon_dof,
            "z": self.z,
            "steps": self.steps,
            "g2": [self._g2.m1, self._g2.m2, self._g2.w, self._g2.w2],
            "tr": [self._tr.m1, self._tr.m2, self._tr.w, self._tr.w2],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; beta must match this estimator's."""
        if float(state["beta"]) != self.beta:
            raise ValueError(f"noise estimator state has beta={state['beta']}; this estimator has beta={self.beta}")
        horizon = float(state.get("horizon_dof", 0.0))  # absent before session 13: per-step beta
        if horizon != self.horizon_dof:
            raise ValueError(
                f"noise estimator state has horizon_dof={horizon}; this estimator has horizon_dof={self.horizon_dof}"
            )
        self.z = float(state["z"])
        self.steps = int(state["steps"])
        self._g2 = _Moments(*(float(x) for x in state["g2"]))
        self._tr = _Moments(*(float(x) for x in state["tr"]))
        self.dof = self._g2.w
