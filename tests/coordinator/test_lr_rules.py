"""LR rules against their closed forms, their limits, the surge peak and clipping."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from megarl.coordinator.lr_rules import (
    LR_RULES,
    LrInputs,
    adascale_gain,
    adascale_sqrt_rule,
    apply_lr_rule,
    clip_lr,
    linear_rule,
    sqrt_rule,
    surge_lr_max,
    surge_rule,
)


def test_sqrt_and_linear_closed_forms() -> None:
    assert sqrt_rule(64, 16, 1e-3) == pytest.approx(2e-3, rel=1e-12)
    assert sqrt_rule(4, 16, 1e-3) == pytest.approx(5e-4, rel=1e-12)
    assert sqrt_rule(50, 8, 3e-4) == pytest.approx(3e-4 * 2.5, rel=1e-12)
    assert linear_rule(64, 16, 1e-3) == pytest.approx(4e-3, rel=1e-12)
    assert linear_rule(12, 48, 2e-4) == pytest.approx(5e-5, rel=1e-12)
    with pytest.raises(ValueError, match="b_ref=0"):
        sqrt_rule(4, 0, 1e-3)


def test_adascale_gain_closed_form_and_bounds() -> None:
    # S = 4, σ² = tr/b_ref = 32/16 = 2, μ² = 1: r = (2 + 1)/(2/4 + 1) = 2.
    assert adascale_gain(64, 16, 1.0, 32.0) == pytest.approx(2.0, rel=1e-12)
    assert adascale_sqrt_rule(64, 16, 1e-3, 1.0, 32.0) == pytest.approx(1e-3 * math.sqrt(2))
    # S = 1/4: r = (2 + 1)/(2·4 + 1) = 1/3, inside [S, 1].
    assert adascale_gain(4, 16, 1.0, 32.0) == pytest.approx(1 / 3, rel=1e-12)
    # Equivalent B_noise form: r = S·(B_noise + b_ref)/(B_noise + b).
    for b in (2.0, 16.0, 100.0, 1e4):
        bn = 32.0 / 1.0
        assert adascale_gain(b, 16, 1.0, 32.0) == pytest.approx(
            b / 16 * (bn + 16) / (bn + b), rel=1e-12
        )
    # Limits: noise-free → 1 (no change); noise-dominated → S (sqrt rule for Adam).
    assert adascale_gain(64, 16, 1.0, 0.0) == 1.0
    assert adascale_gain(64, 16, 1.0, 1e12) == pytest.approx(4.0, rel=1e-6)
    assert adascale_gain(64, 16, 0.0, 5.0) == 4.0
    # Bounds: √r between 1 and √S on both sides of b_ref.
    rng = np.random.default_rng(0)
    for _ in range(200):
        b, b_ref = float(rng.uniform(1, 1000)), float(rng.uniform(1, 1000))
        g2, tr = float(rng.uniform(1e-3, 10)), float(rng.uniform(0, 1e4))
        s = b / b_ref
        lr = adascale_sqrt_rule(b, b_ref, 1.0, g2, tr)
        assert min(1.0, math.sqrt(s)) - 1e-12 <= lr <= max(1.0, math.sqrt(s)) + 1e-12


def test_surge_peaks_at_b_noise_and_is_calibrated() -> None:
    bn, lr_max = 300.0, 2e-3
    assert surge_rule(bn, bn, lr_max) == pytest.approx(lr_max, rel=1e-12)
    # ½(√(1/4) + √4) = 1.25, symmetric in log B.
    assert surge_rule(4 * bn, bn, lr_max) == pytest.approx(lr_max / 1.25, rel=1e-12)
    assert surge_rule(bn / 4, bn, lr_max) == pytest.approx(lr_max / 1.25, rel=1e-12)
    grid = np.geomspace(1, 1e5, 2001)
    values = [surge_rule(float(b), bn, lr_max) for b in grid]
    assert grid[int(np.argmax(values))] == pytest.approx(bn, rel=0.01)
    # Calibration: the rule goes through (b_ref, lr_ref).
    top = surge_lr_max(64, 1e-3, bn)
    assert surge_rule(64, bn, top) == pytest.approx(1e-3, rel=1e-12)
    assert top == pytest.approx(1e-3 * 0.5 * (math.sqrt(bn / 64) + math.sqrt(64 / bn)))
    # Far below B_noise the calibrated surge rule is the square-root rule.
    x = LrInputs(b=64, b_ref=16, lr_ref=1e-3, b_noise=1e7)
    assert LR_RULES["surge"](x) == pytest.approx(sqrt_rule(64, 16, 1e-3), rel=1e-4)
    # Above B_noise the LR falls again: the surge.
    x_far = LrInputs(b=4000, b_ref=16, lr_ref=1e-3, b_noise=bn)
    x_peak = LrInputs(b=bn, b_ref=16, lr_ref=1e-3, b_noise=bn)
    assert LR_RULES["surge"](x_far) < LR_RULES["surge"](x_peak)


def test_registry_agrees_at_reference_and_falls_back_without_stats() -> None:
    assert sorted(LR_RULES) == ["adascale", "linear", "none", "sqrt", "surge"]
    at_ref = LrInputs(b=32, b_ref=32, lr_ref=7e-4, g2=1.0, tr_sigma=200.0, b_noise=200.0)
    for name in LR_RULES:
        assert apply_lr_rule(name, at_ref, lr_min=0.0, lr_max=1.0) == pytest.approx(7e-4)
    moved = LrInputs(b=128, b_ref=32, lr_ref=7e-4, g2=1.0, tr_sigma=200.0, b_noise=200.0)
    got = {n: apply_lr_rule(n, moved, lr_min=0.0, lr_max=1.0) for n in LR_RULES}
    assert got["none"] == pytest.approx(7e-4)
    assert got["linear"] == pytest.approx(2.8e-3)
    assert got["sqrt"] == pytest.approx(1.4e-3)
    assert got["adascale"] == pytest.approx(7e-4 * math.sqrt(4 * 232 / 328))

    def f(b: float) -> float:
        return 0.5 * (math.sqrt(200 / b) + math.sqrt(b / 200))

    assert got["surge"] == pytest.approx(7e-4 * f(32) / f(128))
    blind = LrInputs(b=128, b_ref=32, lr_ref=7e-4)
    for name in ("adascale", "surge"):
        assert apply_lr_rule(name, blind, lr_min=0.0, lr_max=1.0) == pytest.approx(1.4e-3)


def test_clipping_and_errors() -> None:
    x = LrInputs(b=1024, b_ref=16, lr_ref=1e-3)
    assert apply_lr_rule("linear", x, lr_min=0.0, lr_max=5e-3) == 5e-3
    small = LrInputs(b=1, b_ref=1024, lr_ref=1e-3)
    assert apply_lr_rule("linear", small, lr_min=1e-4, lr_max=1.0) == 1e-4
    assert clip_lr(3e-4, 1e-4, 1e-3) == 3e-4
    with pytest.raises(ValueError, match="lr_rule='cosine' is not one of"):
        apply_lr_rule("cosine", x, lr_min=0.0, lr_max=1.0)
    with pytest.raises(ValueError, match=re.escape("lr_min=0.1 must be <= lr_max=0.01")):
        clip_lr(1.0, 0.1, 0.01)
    with pytest.raises(ValueError, match="b_noise=0"):
        surge_rule(10, 0, 1.0)
