"""The between/within-prompt split on synthetic gradients with known σ_b², σ_w².

Model: unit gradient g_{p,i} = G + a_p + e_{p,i}, a_p ~ N(0, σ_b²/DIM·I) per prompt, e ~ N(0,
σ_w²/DIM·I) per unit: tr Cov within a prompt is σ_b², the rest of the variance σ_w². Each step
has K prompts (parts); the estimator sees only what the probe reads: each part's |ḡ_p|², its
halves' |Σ_{h1} g - Σ_{h2} g|²/n_p², and the step's |Ḡ|².
"""

from __future__ import annotations

import numpy as np
import pytest

from megarl.coordinator.noise_split import (
    effective_batch,
    effective_group,
    noise_ratio,
    prompt_split,
    within_share,
    within_variance,
)

DIM = 16
SIGMA_B, SIGMA_W = 3.0, 40.0  # tr Cov between prompts, within


def _readings(rng: np.random.Generator, halves: list[tuple[int, int]], steps: int) -> tuple[np.ndarray, ...]:
    """Per step (rows) and part (columns): |ḡ_p|², |d_p|²; per step |Ḡ|²; and the units n_p."""
    n1, n2 = (np.array([h[i] for h in halves], dtype=float) for i in (0, 1))
    k = len(halves)
    g = np.full(DIM, 0.5)
    a = rng.normal(size=(steps, k, DIM)) * np.sqrt(SIGMA_B / DIM)
    # a sum of n i.i.d. N(0, σ²/DIM) vectors is N(0, n·σ²/DIM): drawn directly
    e1 = rng.normal(size=(steps, k, DIM)) * np.sqrt(n1[:, None] * SIGMA_W / DIM)
    e2 = rng.normal(size=(steps, k, DIM)) * np.sqrt(n2[:, None] * SIGMA_W / DIM)
    s1 = n1[:, None] * (g + a) + e1
    s2 = n2[:, None] * (g + a) + e2
    n = n1 + n2
    part_sq = ((s1 + s2) ** 2).sum(-1) / n**2
    diff_sq = ((s1 - s2) ** 2).sum(-1) / n**2
    big = (s1 + s2).sum(1) / n.sum()
    return part_sq, diff_sq, (big**2).sum(-1), n


@pytest.mark.parametrize(
    "halves",
    [
        [(4, 4)] * 8,  # responses: 8 groups of 8 samples, halves of 4
        [(30, 41), (52, 38), (12, 27), (45, 45), (20, 9), (33, 60)],  # tokens: unequal halves and groups
    ],
)
def test_split_is_unbiased(halves: list[tuple[int, int]]) -> None:
    part_sq, diff_sq, big, units = _readings(np.random.default_rng(1), halves, 4000)
    h = [(float(a), float(b)) for a, b in halves]
    est_a = np.array(
        [prompt_split(list(p), list(units), float(g), list(d), h) for p, d, g in zip(part_sq, diff_sq, big)]
    )
    mean, se = est_a.mean(0), est_a.std(0) / np.sqrt(len(est_a))
    # unbiased: within 4 standard errors of the truth, and the standard errors resolve it to a few %
    assert abs(mean[0] - SIGMA_B) < 4 * se[0], (mean, se)
    assert abs(mean[1] - SIGMA_W) < 4 * se[1], (mean, se)
    assert se[0] < 0.05 * SIGMA_B and se[1] < 0.02 * SIGMA_W, se


def test_naive_halves_difference_is_biased_for_unequal_halves() -> None:
    """Without the (n_1 - n_2)² correction the token halves' difference carries |G|² + σ_b²: the
    correction is what makes the unequal case unbiased (it is measurably off without it)."""
    halves = [(10, 50), (50, 10), (15, 45), (45, 15)]
    part_sq, diff_sq, _, units = _readings(np.random.default_rng(2), halves, 3000)
    naive = (units**2 * diff_sq).sum(1) / units.sum()
    h = [(float(a), float(b)) for a, b in halves]
    fixed = [within_variance(list(p), list(d), h) for p, d in zip(part_sq, diff_sq)]
    assert abs(np.mean(fixed) / SIGMA_W - 1) < 0.03
    assert np.mean(naive) / SIGMA_W - 1 > 0.15  # (n1-n2)²/n·(|G|²+σ_b²)/σ_w² ≈ 0.3 here


def test_effective_group_and_ratios() -> None:
    assert effective_group([8.0] * 5) == pytest.approx(8.0)
    assert effective_group([2.0, 6.0]) == pytest.approx((8 - 40 / 8) / 1)
    share = within_share(between=1.0, within=8.0, units_per_group=8.0)  # T = 8·1 + 8
    assert share == pytest.approx(0.5)
    assert within_share(-1.0, -2.0, 8.0) is None
    assert within_share(-1.0, 2.0, 8.0) == 1.0  # a negative σ_b² counts as none
    # T(16)/T(8) = (16 + 8)/(8 + 8)
    assert noise_ratio(0.5, 16, 8) == pytest.approx(24 / 16)
    assert effective_batch(10, 8, 0.5, 8) == pytest.approx(80)
    assert effective_batch(10, 16, 0.0, 8) == pytest.approx(80)  # only prompts count
    assert effective_batch(10, 16, 1.0, 8) == pytest.approx(160)  # every response counts


def test_within_variance_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="2 parts, 1 differences"):
        within_variance([1.0, 2.0], [1.0], [(1, 1), (1, 1)])
    with pytest.raises(ValueError, match="no part has units in both halves"):
        within_variance([1.0], [1.0], [(0.0, 0.0)])
