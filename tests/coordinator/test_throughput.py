"""Online step-time models: exact fits, the one-batch prior, the window, constraints, state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megarl.coordinator.throughput import ERA_RECENT, LinearTimeModel, StepTimeModel


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


def test_timing_noise_alone_never_starts_a_new_era() -> None:
    """2000 steps at one size with 5 % (CPU-like) or 1 % (GPU-like) independent noise: no
    change of era is seen, so no size's times are ever dropped."""
    rng = np.random.default_rng(4)
    for noise in (0.05, 0.01):
        m = LinearTimeModel(window=32)
        for _ in range(2000):
            m.observe(256, 1.0 + noise * float(rng.normal()))
        assert m.eras == 0


def test_a_slower_machine_starts_a_new_era_and_the_shape_is_kept() -> None:
    """t = 2 + 0.01·B measured at 256, then at 512 (5 % noise): alpha/beta ≈ 200 responses. Then
    the machine runs 2x slower while the run stays at 512. Fitted across the eras (fast 256
    against slow 512) the line has no fixed cost (alpha 0: the goodput optimum at the grid's
    bottom); instead the change is seen within ERA_RECENT steps, 256's fast times are dropped,
    and 512 keeps the shape of the last fit at its new, slow level."""
    rng = np.random.default_rng(0)
    m = LinearTimeModel(window=32)
    for k in range(60):
        b = 256 if k < 20 else 512
        m.observe(b, (2 + 0.01 * b) * (1 + 0.05 * float(rng.normal())))
    a0, b0 = m.coefficients()
    assert a0 / b0 == pytest.approx(200, rel=0.3) and m.eras == 0
    slow = []
    for _ in range(ERA_RECENT):
        slow.append(2 * (2 + 0.01 * 512) * (1 + 0.05 * float(rng.normal())))
        m.observe(512, slow[-1])
    assert m.eras == 1 and m.num_distinct_batches == 1
    alpha, beta = m.coefficients()
    assert alpha / beta == pytest.approx(a0 / b0, rel=1e-9)
    assert alpha + beta * 512 == pytest.approx(float(np.mean(slow)), rel=1e-9)
    assert m.predict(256) == pytest.approx(2 * (2 + 0.01 * 256), rel=0.15)
    mixed = LinearTimeModel(window=32)  # the kept means of the two eras, fitted together
    for b, t in ((256, 2 + 2.56), (512, 2 * 7.12)):
        mixed.observe(b, t)
    assert mixed.coefficients()[0] == 0.0


def test_state_round_trip_keeps_the_shape_and_reads_older_states() -> None:
    m = LinearTimeModel(window=16)
    for k in range(40):
        m.observe(64 if k < 20 else 128, 1.0 + 0.01 * (64 if k < 20 else 128) + 0.001 * (k % 3))
    for _ in range(ERA_RECENT):
        m.observe(128, 5.0)  # a new era: 128 alone, on the kept shape
    assert m.eras == 1 and m.num_distinct_batches == 1
    state = json.loads(json.dumps(m.state_dict(), allow_nan=False))
    copy = LinearTimeModel()
    copy.load_state_dict(state)
    assert copy.coefficients() == m.coefficients() and copy.eras == 1
    for x in (5.1, 4.9):
        m.observe(64, x)
        copy.observe(64, x)
    assert copy.coefficients() == m.coefficients()
    flat = LinearTimeModel()
    for b in (64, 128):
        flat.observe(b, 3.0)  # beta 0: alpha/beta is infinite, saved as "inf"
    again = LinearTimeModel()
    again.load_state_dict(json.loads(json.dumps(flat.state_dict(), allow_nan=False)))
    assert again.coefficients() == flat.coefficients() == (3.0, 0.0)
    legacy = LinearTimeModel()  # saved before eras: no shape, the prior for one size
    legacy.load_state_dict({k: state[k] for k in ("window", "prior_fixed_fraction", "obs")})
    assert legacy.eras == 0
    assert legacy.coefficients()[0] == pytest.approx(0.3 * 5.0)


def test_a_measured_fixed_share_replaces_the_prior_until_a_second_size_is_measured() -> None:
    m = LinearTimeModel(prior_fixed_fraction=0.3, window=4)
    for seconds, fixed in ((1.0, 0.04), (1.2, 0.08), (1.0, 0.06)):
        m.observe(512, seconds, fixed_s=fixed)  # shares 0.04, 0.0667, 0.06
    share = (0.04 + 0.08 / 1.2 + 0.06) / 3
    assert m.fixed_fraction == pytest.approx(share)
    t = (1.0 + 1.2 + 1.0) / 3
    assert m.coefficients() == pytest.approx((share * t, (1 - share) * t / 512))
    assert m.predict(1024) == pytest.approx(t * (2 - share))  # 2× the batch: ~2× the time, not 1.7×
    for _ in range(3):
        m.observe(512, 1.0, fixed_s=0.5)  # a window of 4 shares: the oldest three go
    assert m.fixed_fraction == pytest.approx((0.06 + 3 * 0.5) / 4)
    for _ in range(4):
        m.observe(256, 0.75, fixed_s=0.0)  # a second size: the fit over sizes, not the shares
    alpha, beta = m.coefficients()
    assert beta == pytest.approx((np.mean([1.0, 1.0, 1.0, 1.0]) - 0.75) / 256)
    assert alpha == pytest.approx(0.5)
    unmeasured = LinearTimeModel(prior_fixed_fraction=0.3)
    unmeasured.observe(512, 1.0)  # generation: nothing to measure, the configured prior
    assert unmeasured.fixed_fraction == 0.3 and unmeasured.coefficients()[0] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="fixed_s=-0.1"):
        m.observe(512, 1.0, fixed_s=-0.1)
    over = LinearTimeModel()
    over.observe(100, 1.0, fixed_s=1.3)  # two clocks read apart: a share above 1 counts as 1
    assert over.fixed_fraction == 1.0 and over.coefficients() == (1.0, 0.0)


def test_measured_shares_survive_a_checkpoint_and_older_states_load_without_them() -> None:
    m = StepTimeModel(window=8)
    for k in range(3):
        m.observe(responses=512, tokens=4096, generate_s=0.2, train_s=0.4 + 0.01 * k, other_s=0.05,
                  logprobs_s=0.2, train_fixed_s=0.02, logprobs_fixed_s=0.01)
    state = json.loads(json.dumps(m.state_dict(), allow_nan=False))
    copy = StepTimeModel()
    copy.load_state_dict(state)
    assert copy.train.fixed_fraction == m.train.fixed_fraction == pytest.approx(np.mean([0.02 / (0.4 + 0.01 * k) for k in range(3)]))
    assert copy.logprobs.fixed_fraction == pytest.approx(0.05)
    assert copy.generate.fixed_fraction == 0.3  # never measured
    assert copy.predict(1024) == m.predict(1024)
    del state["train"]["fixed"]  # saved before session 19
    legacy = StepTimeModel()
    legacy.load_state_dict(state)
    assert legacy.train.fixed_fraction == 0.3
