"""Online step-time models: exact fits, the one-batch prior, the window, constraints, state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megarl.coordinator.throughput import LinearTimeModel, StepTimeModel


def test_exact_fit_from_noiseless_observations() -> None:
    m = LinearTimeModel(window=8)
    for b in (64, 128, 256, 128):
        m.observe(b, 12.0 + 0.05 * b)
    alpha, beta = m.coefficients()
    assert alpha == pytest.approx(12.0, rel=1e-12)
    assert beta == pytest.approx(0.05, rel=1e-12)
    assert m.predict(1000) == pytest.approx(62.0, rel=1e-12)


def test_noisy_fit_is_close() -> None:
    rng = np.random.default_rng(0)
    m = LinearTimeModel(window=64)
    for _ in range(64):
        b = float(rng.choice([32, 64, 128, 256, 512]))
        m.observe(b, 5.0 + 0.02 * b + float(rng.normal(0, 0.2)))
    alpha, beta = m.coefficients()
    assert alpha == pytest.approx(5.0, rel=0.05)
    assert beta == pytest.approx(0.02, rel=0.05)


def test_prior_with_one_distinct_batch() -> None:
    m = LinearTimeModel(prior_fixed_fraction=0.25)
    assert not m.ready
    with pytest.raises(ValueError, match="no observations"):
        m.predict(10)
    m.observe(100, 9.0)
    m.observe(100, 11.0)
    assert m.num_distinct_batches == 1
    alpha, beta = m.coefficients()
    assert alpha == pytest.approx(0.25 * 10.0)
    assert beta == pytest.approx(0.75 * 10.0 / 100)
    assert m.predict(100) == pytest.approx(10.0)
    assert m.predict(200) == pytest.approx(17.5)


def test_window_forgets_old_regime() -> None:
    """Each batch size keeps its last `window` times: a new regime replaces the old one."""
    m = LinearTimeModel(window=4)
    for b in (10, 20, 10, 20):
        m.observe(b, 1.0 + 0.1 * b)
    for b in (10, 20) * 4:
        m.observe(b, 3.0 + 0.2 * b)
    assert m.coefficients() == pytest.approx((3.0, 0.2), rel=1e-12)


def test_a_batch_size_once_measured_is_not_forgotten() -> None:
    """40 steps at 256 after 8 at 1024 (window 32): the fit still sees 1024. The old single
    window over steps kept only the 256 steps and fell back to its prior (fixed fraction 0.3:
    alpha = 0.3·t(256)), predicting 1024 at 0.3·0.43 + 0.7·0.43·4 = 1.33 s instead of 1.43 s,
    and the slope from two close batches was at the mercy of timing noise."""
    m = LinearTimeModel(window=32)
    for _ in range(8):
        m.observe(1024, 0.07 + 0.00136 * 1024)
    for _ in range(40):
        m.observe(256, 0.07 + 0.00136 * 256)
    assert m.num_distinct_batches == 2
    assert m.coefficients() == pytest.approx((0.07, 0.00136), rel=1e-9)


def test_constraints_keep_time_non_decreasing() -> None:
    m = LinearTimeModel()
    m.observe(10, 5.0)
    m.observe(20, 4.0)  # noise made the larger batch faster
    assert m.coefficients() == pytest.approx((4.5, 0.0))
    m2 = LinearTimeModel()
    m2.observe(10, 0.5)
    m2.observe(20, 2.5)  # OLS intercept would be -1.5
    alpha, beta = m2.coefficients()
    assert alpha == 0.0
    assert beta == pytest.approx((10 * 0.5 + 20 * 2.5) / (100 + 400))


def test_step_time_model_sums_phases_and_reports_tokens_per_s() -> None:
    m = StepTimeModel(ema_beta=0.5)
    for b in (64, 128):
        m.observe(
            responses=b,
            tokens=b * 200,
            generate_s=4.0 + 0.01 * b,
            train_s=1.0 + 0.02 * b,
            other_s=2.0,
        )
    assert m.predict(256) == pytest.approx((4 + 2.56) + (1 + 5.12) + 2.0, rel=1e-12)
    assert m.throughput(256) == pytest.approx(256 / 14.68, rel=1e-12)
    assert m.tokens_per_response == pytest.approx(200.0)
    assert m.generation_tokens_per_s(256) == pytest.approx(256 * 200 / 6.56, rel=1e-12)
    assert m.train_s_per_sample(100) == pytest.approx(3.0 / 100, rel=1e-12)
    with pytest.raises(ValueError, match="rollout_responses=0"):
        m.observe(responses=0, tokens=0, generate_s=1.0, train_s=1.0, other_s=0.0)


def test_state_round_trip() -> None:
    m = StepTimeModel(window=5)
    rng = np.random.default_rng(1)
    for _ in range(9):
        b = int(rng.integers(16, 256))
        m.observe(
            responses=b,
            tokens=b * 50,
            generate_s=float(rng.uniform(1, 9)),
            train_s=float(rng.uniform(1, 9)),
            other_s=0.5,
        )
    copy = StepTimeModel()
    copy.load_state_dict(json.loads(json.dumps(m.state_dict())))
    for x in (8.0, 100.0, 1000.0):
        assert copy.predict(x) == m.predict(x)
        assert copy.generation_tokens_per_s(x) == m.generation_tokens_per_s(x)
    assert copy.generate.window == 5
