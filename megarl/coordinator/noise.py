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

Adam-preconditioned variant: the trainer may also report squared norms of the gradient
scaled element-wise by 1/(sqrt(v̂)+eps) (Adam's second-moment estimate). Because the
preconditioner is a fixed linear map P for one step, P·G_B is the mean of the P·g_i, so the
algebra above holds verbatim with G → P·G and Σ → P·Σ·Pᵀ. The estimator is the same object;
only its `kind` label ("adam" instead of "plain") differs. Merrill et al. 2025
(arXiv 2505.23971) report that under Adam the plain proxy can underestimate the critical
batch; the preconditioned one is closer to what Adam actually sees.

Invariants: all functions are pure, take Python floats and return Python floats; nothing
here knows about processes or torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

NoiseKind = Literal["plain", "adam"]
GradAverage = Literal["samples", "ranks"]

KIND_PLAIN: NoiseKind = "plain"
"""Estimator fed with raw gradient norms."""
KIND_ADAM: NoiseKind = "adam"
"""Estimator fed with norms of Adam-preconditioned gradients g/(sqrt(v̂)+eps)."""


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


def _ema_weight_sq_sum(beta: float, t: int) -> float:
    """Σ w_k² of the normalised weights of a bias-corrected EMA after t updates.

    w_k = (1-β)β^k/(1-β^t), k = 0..t-1  ⇒  Σ w_k² = (1-β)(1+β^t) / ((1+β)(1-β^t)).
    Its inverse is the EMA's effective number of samples.
    """
    if beta == 0.0:
        return 1.0
    bt = beta**t
    return (1.0 - beta) * (1.0 + bt) / ((1.0 + beta) * (1.0 - bt))


@dataclass
class _Moments:
    """Bias-corrected EMA of x and x² (Adam-style: raw/(1-β^t))."""

    m1: float = 0.0
    m2: float = 0.0

    def update(self, x: float, beta: float) -> None:
        self.m1 = beta * self.m1 + (1.0 - beta) * x
        self.m2 = beta * self.m2 + (1.0 - beta) * x * x


class NoiseScaleEstimator:
    """Smoothed |G|², tr(Σ) and B_simple = EMA(tr Σ)/EMA(|G|²) with an approximate band.

    EMAs are bias-corrected like Adam's moments (raw/(1-β^t)), so the first update returns
    the first value exactly. B_simple is None while EMA(|G|²) <= 0 (the signal is not yet
    resolved: the noise scale is effectively unbounded, and claiming a number would be
    wrong); it is clamped to 0 when EMA(tr Σ) <= 0 (no measurable noise).

    Band (approximate, documented as such): the same EMAs of x² give a reliability-weighted
    variance s² of the per-step values, and the variance of a bias-corrected EMA of
    independent values is s²·Σw² (see `_ema_weight_sq_sum`). With se_T, se_G the standard
    errors of EMA(tr Σ) and EMA(|G|²) the band is the corner interval

        low  = max(0, T - z·se_T) / (G + z·se_G),
        high = (T + z·se_T) / (G - z·se_G)   (inf when G - z·se_G <= 0).

    The two per-step estimates are negatively correlated (an unlucky |G_small|² raises T and
    lowers G), so pairing the pessimistic ends is the relevant worst case. Per-step values
    are not independent when parameters move, so treat it as a z-sigma-ish band, not a
    confidence interval.
    """

    def __init__(self, beta: float = 0.95, kind: NoiseKind = KIND_PLAIN, z: float = 2.0):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta={beta} must be in [0, 1)")
        if kind not in (KIND_PLAIN, KIND_ADAM):
            raise ValueError(f"kind={kind!r} must be {KIND_PLAIN!r} or {KIND_ADAM!r}")
        if not z > 0:
            raise ValueError(f"z={z} must be > 0")
        self.beta = beta
        self.kind: NoiseKind = kind
        self.z = z
        self.steps = 0
        self._g2 = _Moments()
        self._tr = _Moments()

    def update(self, g2: float, tr_sigma: float) -> None:
        """Add one step's (|G|², tr Σ) estimate (either may be negative)."""
        if not (math.isfinite(g2) and math.isfinite(tr_sigma)):
            raise ValueError(f"non-finite noise statistics: g2={g2}, tr_sigma={tr_sigma}")
        self.steps += 1
        self._g2.update(g2, self.beta)
        self._tr.update(tr_sigma, self.beta)

    def _correction(self) -> float:
        return 1.0 - self.beta**self.steps

    @property
    def g2(self) -> float | None:
        """Bias-corrected EMA of |G|² (None before the first update)."""
        return self._g2.m1 / self._correction() if self.steps else None

    @property
    def tr_sigma(self) -> float | None:
        """Bias-corrected EMA of tr(Σ) (None before the first update)."""
        return self._tr.m1 / self._correction() if self.steps else None

    @property
    def b_simple(self) -> float | None:
        """EMA(tr Σ)/EMA(|G|²) in samples; None while EMA(|G|²) <= 0 or before any update."""
        g2, tr = self.g2, self.tr_sigma
        if g2 is None or tr is None or g2 <= 0.0:
            return None
        return max(tr, 0.0) / g2

    def _stderr(self, m: _Moments) -> float | None:
        if self.steps < 2:
            return None
        c = self._correction()
        mean, mean_sq = m.m1 / c, m.m2 / c
        w2 = _ema_weight_sq_sum(self.beta, self.steps)
        if w2 >= 1.0:
            return None
        # Reliability-weights unbiased variance: (E_w[x²] - E_w[x]²) / (1 - Σw²).
        var = max(mean_sq - mean * mean, 0.0) / (1.0 - w2)
        return math.sqrt(var * w2)

    def band(self) -> tuple[float, float] | None:
        """(low, high) approximate z-sigma band on B_simple; None before 2 updates."""
        g2, tr = self.g2, self.tr_sigma
        se_g, se_t = self._stderr(self._g2), self._stderr(self._tr)
        if g2 is None or tr is None or se_g is None or se_t is None:
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
            "kind": self.kind,
            "z": self.z,
            "steps": self.steps,
            "g2": [self._g2.m1, self._g2.m2],
            "tr": [self._tr.m1, self._tr.m2],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; beta and kind must match this estimator's."""
        if float(state["beta"]) != self.beta or state["kind"] != self.kind:
            raise ValueError(
                f"noise estimator state has beta={state['beta']}, kind={state['kind']!r}; "
                f"this estimator has beta={self.beta}, kind={self.kind!r}"
            )
        self.z = float(state["z"])
        self.steps = int(state["steps"])
        self._g2 = _Moments(float(state["g2"][0]), float(state["g2"][1]))
        self._tr = _Moments(float(state["tr"][0]), float(state["tr"][1]))
