"""The sweep's arithmetic (pure; tested in tests/benchmarks/test_ttt_fit.py): the critical
batch fitted from steps vs samples to target, and the ratios the benchmark reports.

**Critical batch** (McCandlish et al. 2018, arXiv 1812.06162, eq. 2.11): runs at batch B that
reach the same target need S steps and E = B·S samples with

    (S/S_min − 1)(E/E_min − 1) = 1,   B_crit = E_min / S_min.

Solving with E = B·S gives S = S_min + E_min/B: S is linear in 1/B with intercept S_min and
slope E_min. The fit is least squares on *relative* residuals (weights 1/S²), since a step
count's noise grows with the count. It needs two or more batch sizes, and is refused
(None with the reason) when the intercept or the slope is not positive — then the sweep does not
bracket the critical batch and B_crit is not identified.

**Ratios** are ``other time / coordinator time`` (> 1: the coordinator is faster). A run that
never reached the target counts with its whole training time, a lower bound, so a coordinator
failure lowers its ratios and a baseline failure is not held against the coordinator beyond
what was run; the JSON line says how many such censored runs entered.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class CriticalBatchFit:
    s_min: float
    """Steps to target at infinite batch."""
    e_min: float
    """Samples (responses) to target at batch → 0."""

    @property
    def b_crit(self) -> float:
        """Critical batch, responses."""
        return self.e_min / self.s_min

    def steps_at(self, batch: float) -> float:
        return self.s_min + self.e_min / batch


def fit_critical_batch(points: list[tuple[float, float]]) -> tuple[CriticalBatchFit | None, str]:
    """Fit (S_min, E_min) to (batch, steps-to-target) points; returns (fit, '') or (None, why)."""
    batches = sorted({b for b, _ in points})
    if len(batches) < 2:
        return None, f"need steps to target at 2+ batch sizes, have {batches}"
    # weighted least squares of S on x = 1/B, weights w = 1/S²
    w = [1.0 / s**2 for _, s in points]
    x = [1.0 / b for b, _ in points]
    y = [s for _, s in points]
    sw = sum(w)
    mx = sum(wi * xi for wi, xi in zip(w, x)) / sw
    my = sum(wi * yi for wi, yi in zip(w, y)) / sw
    sxx = sum(wi * (xi - mx) ** 2 for wi, xi in zip(w, x))
    slope = sum(wi * (xi - mx) * (yi - my) for wi, xi, yi in zip(w, x, y)) / sxx
    intercept = my - slope * mx
    if intercept <= 0:
        return None, (
            f"fitted S_min = {intercept:.3g} <= 0: steps still fall like 1/B up to batch {batches[-1]} "
            "(critical batch above the sweep)"
        )
    if slope <= 0:
        return None, (
            f"fitted E_min = {slope:.3g} <= 0: steps do not fall with batch from {batches[0]} "
            "(critical batch below the sweep)"
        )
    return CriticalBatchFit(s_min=intercept, e_min=slope), ""


def best_steps_per_batch(runs: list[tuple[float, float, bool]]) -> list[tuple[float, float]]:
    """(batch, fewest steps to target) over the LRs tried at each batch, reached runs only.

    ``runs`` holds (batch, steps, reached); the fit wants each batch at its best LR."""
    best: dict[float, float] = {}
    for b, s, reached in runs:
        if reached and s > 0:
            best[b] = min(best.get(b, math.inf), s)
    return sorted(best.items())


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in xs) / len(xs))


def paired_ratio(other: dict[int, float], coord: dict[int, float]) -> tuple[float | None, dict[int, float]]:
    """Geometric mean over common seeds of other[seed] / coord[seed], and the per-seed ratios."""
    per_seed = {s: other[s] / coord[s] for s in sorted(set(other) & set(coord)) if coord[s] > 0 and other[s] > 0}
    return (geomean(list(per_seed.values())) if per_seed else None), per_seed


def median_ratio(sweep_times: list[float], coord: dict[int, float]) -> float | None:
    """Median fixed setting's time / the coordinator's geometric-mean time over seeds."""
    coord_times = [t for t in coord.values() if t > 0]
    if not sweep_times or not coord_times:
        return None
    return statistics.median(sweep_times) / geomean(coord_times)


@dataclass(frozen=True)
class BarResolution:
    """What the per-seed bars can resolve, from the fixed setting's own seed-to-seed spread.

    A method whose time to target has the fixed setting's distribution but is drawn
    independently of it (seeds do not pair runs that train at different batches: their
    samples differ from the first step) gives per-seed ratios t_fixed / t_method spread like
    two independent draws. ``p_every_seed`` is the chance that such an *equally good* method
    shows ratio ≥ ``floor`` on all ``seeds`` seeds: over all ordered pairs of the fixed run's
    own seeds (no distribution assumed), the fraction with t_i / t_j ≥ floor, to the power
    ``seeds``. ``speedup_for_even_odds`` is how much faster than the fixed setting (a factor on
    its geometric-mean time) a method must be to pass that bar on half of such trials, with
    log-times normal at the fixed setting's spread σ: (ln k − ln floor) / (σ√2) = Φ⁻¹(0.5^(1/seeds)).
    ``pairing`` is the correlation over seeds of the fixed and each method's log-times (≈ 0:
    the seed does not pair them; > 0 would narrow the ratio's spread by √(1 − ρ))."""

    seeds: int
    floor: float
    sigma_log: float
    p_every_seed: float
    speedup_for_even_odds: float
    pairing: dict[str, float]


def bar_resolution(
    fixed: dict[int, float], others: dict[str, dict[int, float]], floor: float = 0.9
) -> BarResolution | None:
    """See :class:`BarResolution`; None with fewer than 3 seeds of the fixed setting."""
    times = [t for t in fixed.values() if t > 0]
    if len(times) < 3:
        return None
    logs = [math.log(t) for t in times]
    sigma = statistics.stdev(logs)
    pairs = [a / b >= floor for i, a in enumerate(times) for j, b in enumerate(times) if i != j]
    p_one = sum(pairs) / len(pairs)
    n = len(times)
    z = statistics.NormalDist().inv_cdf(0.5 ** (1.0 / n))
    pairing = {}
    for name, t in others.items():
        common = sorted(s for s in set(fixed) & set(t) if fixed[s] > 0 and t[s] > 0)
        if len(common) >= 3:
            a, b = [math.log(fixed[s]) for s in common], [math.log(t[s]) for s in common]
            if statistics.pstdev(a) > 0 and statistics.pstdev(b) > 0:
                pairing[name] = statistics.correlation(a, b)
    return BarResolution(
        seeds=n,
        floor=floor,
        sigma_log=sigma,
        p_every_seed=p_one**n,
        speedup_for_even_odds=math.exp(math.log(floor) + z * sigma * math.sqrt(2.0)),
        pairing=pairing,
    )
