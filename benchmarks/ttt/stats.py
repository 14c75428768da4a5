"""Paired ratios that can decide (#45 item 4): geometric mean, a one-sided lower bound, power.

Per seed i the two arms give a ratio r_i = t_other / t_method (> 1: the method is faster); with
x_i = ln r_i, mean x̄ and sample standard deviation s over n seeds, the geometric mean is e^x̄
and the one-sided (1 − α) lower bound is

    LB = exp(x̄ − t_{1−α, n−1} · s / √n)            (Student's t on the log ratios)

which assumes the log ratios are normal and the seeds independent. The seed count a bar needs
(:func:`seeds_needed`) is the smallest n with

    x̄ − ln bar ≥ (t_{1−α, n−1} + t_{power, n−1}) · σ / √n,

the usual normal-approximation power rule with t quantiles at n − 1 degrees of freedom: at the
pilot's effect x̄ and spread σ, the lower bound clears the bar with probability ≈ ``power``.

Student's t without scipy: the CDF through the regularized incomplete beta function
(Numerical Recipes 3rd ed. §6.4, continued fraction by the modified Lentz method), the quantile
by bisection. Tested against closed forms (n − 1 = 1: tan(π(p − ½)); 2: (2p − 1)/√(2p(1 − p))).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LEVEL = 0.9
"""One-sided confidence of the lower bounds (the issue's bars)."""


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (NR3 ``betacf``)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """q with t_cdf(q, df) = p (bisection to 1e-12)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile: need 0 < p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    while hi - lo > 1e-12 * max(1.0, abs(hi)):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Paired:
    """Paired ratios over seeds (see the module docstring)."""

    n: int
    gm: float
    """Geometric mean of the ratios."""
    lower: float | None
    """One-sided ``level`` lower bound of the geometric mean (None with one seed)."""
    sigma_log: float | None
    """Sample standard deviation of the log ratios."""
    level: float = LEVEL

    def to_dict(self) -> dict[str, float | int | None]:
        r = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return {"n": self.n, "gm": r(self.gm), "lower": r(self.lower), "sigma_log": r(self.sigma_log)}


def paired(ratios: list[float], level: float = LEVEL) -> Paired | None:
    """Geometric mean and lower bound of per-seed ratios (None without any)."""
    xs = [math.log(r) for r in ratios if r > 0]
    if not xs:
        return None
    n, m = len(xs), statistics.fmean(xs)
    if n < 2:
        return Paired(n, math.exp(m), None, None, level)
    s = statistics.stdev(xs)
    return Paired(n, math.exp(m), math.exp(m - t_quantile(level, n - 1) * s / math.sqrt(n)), s, level)


def seeds_needed(
    effect: float, sigma: float, bar: float, level: float = LEVEL, power: float = 0.8, most: int = 200
) -> int | None:
    """Smallest n ≥ 2 whose ``level`` lower bound clears ``bar`` with probability ≈ ``power``
    when the true geometric mean is ``effect`` and log ratios spread ``sigma``; None when the
    effect does not exceed the bar (no n does) or more than ``most`` are needed."""
    gap = math.log(effect) - math.log(bar)
    if gap <= 0:
        return None
    if sigma <= 0:
        return 2
    for n in range(2, most + 1):
        if gap >= (t_quantile(level, n - 1) + t_quantile(power, n - 1)) * sigma / math.sqrt(n):
            return n
    return None


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))
