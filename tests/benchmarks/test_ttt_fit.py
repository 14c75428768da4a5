"""benchmarks/ttt/fit.py: the critical-batch fit recovers a known B_crit from synthetic
steps-to-target, refuses a sweep that does not bracket it, and the ratio arithmetic."""

import math
import random

import pytest

from benchmarks.ttt import fit
from benchmarks.ttt.fit import best_steps_per_batch, fit_critical_batch, median_ratio, paired_ratio


def _steps(s_min, e_min, b):
    return s_min * (1 + (e_min / s_min) / b)  # McCandlish eq. 2.11: S = S_min (1 + B_crit/B)


def test_fit_recovers_known_critical_batch_exactly():
    s_min, e_min = 30.0, 15000.0  # B_crit = 500 responses
    pts = [(b, _steps(s_min, e_min, b)) for b in (128, 256, 512, 1024)]
    cb, why = fit_critical_batch(pts)
    assert why == ""
    assert cb.s_min == pytest.approx(30.0)
    assert cb.e_min == pytest.approx(15000.0)
    assert cb.b_crit == pytest.approx(500.0)
    # the fitted curve satisfies (S/S_min - 1)(E/E_min - 1) = 1 at every batch
    for b, s in pts:
        assert (s / cb.s_min - 1) * (b * s / cb.e_min - 1) == pytest.approx(1.0)


def test_fit_with_10_percent_noise_stays_within_a_factor_1_5():
    rng = random.Random(0)
    s_min, e_min = 40.0, 40.0 * 300  # B_crit = 300
    pts = [
        (b, _steps(s_min, e_min, b) * math.exp(rng.gauss(0, 0.1))) for b in (64, 128, 256, 512, 1024) for _ in range(3)
    ]
    cb, _ = fit_critical_batch(pts)
    assert 200 < cb.b_crit < 450


def test_fit_refuses_when_steps_fall_like_one_over_batch():
    pts = [(b, 20000.0 / b) for b in (128, 256, 512)]  # perfect scaling: S_min = 0
    cb, why = fit_critical_batch(pts[:1])
    assert cb is None and "2+ batch sizes" in why
    pts = [(128, 160.0), (256, 78.0), (512, 38.0)]  # faster than 1/B: intercept < 0
    cb, why = fit_critical_batch(pts)
    assert cb is None and "S_min" in why and "above the sweep" in why
    cb, why = fit_critical_batch([(128, 40.0), (512, 50.0)])  # more steps at larger batch
    assert cb is None and "E_min" in why


def test_best_steps_per_batch_takes_the_best_lr_and_skips_unreached():
    runs = [(128, 90.0, True), (128, 70.0, True), (128, 10.0, False), (512, 30.0, True), (1024, 150.0, False)]
    assert best_steps_per_batch(runs) == [(128, 70.0), (512, 30.0)]


def test_paired_ratio_is_a_geometric_mean_over_common_seeds():
    best = {1: 100.0, 2: 120.0, 3: 80.0}
    coord = {1: 50.0, 2: 240.0, 3: 80.0, 4: 1.0}  # seed 4 has no partner: ignored
    gm, per_seed = paired_ratio(best, coord)
    assert per_seed == {1: 2.0, 2: 0.5, 3: 1.0}
    assert gm == pytest.approx(1.0)  # (2 · 0.5 · 1)^(1/3)
    assert paired_ratio({}, coord) == (None, {})


def test_median_ratio_uses_the_middle_setting_and_the_coordinator_geomean():
    assert median_ratio([10.0, 40.0, 30.0], {1: 10.0, 2: 40.0}) == pytest.approx(30.0 / 20.0)
    assert median_ratio([], {1: 1.0}) is None


def test_bar_resolution_from_the_fixed_settings_own_seed_spread():
    # times 10 / 20 / 40 s: ordered-pair ratios 1/2, 1/4, 2, 1/2, 4, 2 -> 3 of 6 are >= 0.9,
    # so an equally good independent method passes on all 3 seeds with p = 0.5³
    fixed = {1: 10.0, 2: 20.0, 3: 40.0}
    same_order = {1: 5.0, 2: 11.0, 3: 30.0}
    reversed_order = {1: 40.0, 2: 20.0, 3: 10.0}
    res = fit.bar_resolution(fixed, {"a": same_order, "b": reversed_order, "short": {1: 1.0, 2: 2.0}})
    assert res is not None
    assert res.seeds == 3 and res.floor == 0.9
    assert res.p_every_seed == pytest.approx(0.125)
    assert res.sigma_log == pytest.approx(math.log(2.0))  # log-times 0, ln2, 2ln2 (+ ln10)
    # (ln k − ln 0.9) / (σ√2) = Φ⁻¹(0.5^(1/3)) = 0.8202 (tables) -> k = 0.9·exp(0.8202·ln2·√2)
    assert res.speedup_for_even_odds == pytest.approx(0.9 * math.exp(0.8202 * math.log(2.0) * math.sqrt(2.0)), rel=1e-3)
    assert res.pairing["a"] > 0.95 and res.pairing["b"] == pytest.approx(-1.0)
    assert "short" not in res.pairing  # two common seeds: no correlation reported


def test_bar_resolution_needs_three_seeds_and_a_tighter_spread_raises_the_odds():
    assert fit.bar_resolution({1: 10.0, 2: 12.0}, {}) is None
    wide = fit.bar_resolution({1: 10.0, 2: 20.0, 3: 40.0, 4: 15.0}, {})
    tight = fit.bar_resolution({1: 10.0, 2: 10.5, 3: 11.0, 4: 10.2}, {})
    assert wide is not None and tight is not None
    assert tight.p_every_seed > wide.p_every_seed and tight.speedup_for_even_odds < wide.speedup_for_even_odds
    # with 4 seeds within 10 % of each other every ordered pair is >= 0.9: an equal method always passes
    assert tight.p_every_seed == 1.0
