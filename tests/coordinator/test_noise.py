"""Noise-scale estimators on a noisy quadratic with known |G|² and tr(Σ).

Model: per-sample gradient g_i = H(θ - θ*) + ξ_i with ξ_i ~ N(0, diag(sd²)), at a fixed θ.
Then G = H(θ - θ*), tr(Σ) = Σ sd², and B_simple = tr(Σ)/|G|² is known exactly.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from megarl.coordinator.noise import (
    NoiseScaleEstimator,
    _Moments,
    decay_for,
    dp_estimates,
    microbatch_estimates,
    parts_dof,
    two_batch_estimates,
)

DIM = 24
B_SIMPLE_TRUE = 64.0


def _problem(seed: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(G, per-coordinate noise std, |G|², tr Σ) with tr Σ / |G|² = B_SIMPLE_TRUE."""
    rng = np.random.default_rng(seed)
    h = rng.uniform(0.5, 2.0, DIM)
    g = h * rng.normal(size=DIM)  # H(θ - θ*) with H = diag(h)
    g2 = float(g @ g)
    sd = rng.uniform(0.5, 1.5, DIM)
    sd *= math.sqrt(B_SIMPLE_TRUE * g2 / float(np.sum(sd**2)))
    return g, sd, g2, float(np.sum(sd**2))


def _rank_means(
    rng: np.random.Generator, g: np.ndarray, sd: np.ndarray, batches: list[int], steps: int
) -> list[np.ndarray]:
    """Per rank: (steps, DIM) means of that rank's per-sample gradients."""
    out = []
    for b in batches:
        per_sample = g + rng.normal(size=(steps, b, DIM)) * sd  # (steps, b, DIM)
        out.append(per_sample.mean(axis=1))
    return out


def _simulate_dp(
    seed: int, batches: list[int], grad_average: str, steps: int = 3000, beta: float = 0.999
) -> tuple[NoiseScaleEstimator, np.ndarray, float, float]:
    g, sd, g2_true, tr_true = _problem(seed)
    rng = np.random.default_rng(seed + 1000)
    locs = _rank_means(rng, g, sd, batches, steps)
    total = sum(batches)
    if grad_average == "samples":
        glob = np.einsum("r,rtd->td", np.asarray(batches, dtype=float), np.stack(locs)) / total
    else:
        glob = np.stack(locs).mean(axis=0)
    est = NoiseScaleEstimator(beta)
    per_step = np.empty((steps, 2))
    for t in range(steps):
        g2, tr = dp_estimates(
            [float(loc[t] @ loc[t]) for loc in locs],
            [float(b) for b in batches],
            float(glob[t] @ glob[t]),
            grad_average=grad_average,  # type: ignore[arg-type]
        )
        per_step[t] = (g2, tr)
        est.update(g2, tr)
    return est, per_step, g2_true, tr_true


def test_two_batch_recovers_exact_expectations() -> None:
    g2, tr = 3.0, 120.0
    for b_small, b_big in [(4.0, 16.0), (8.0, 64.0), (1.0, 2.0)]:
        got = two_batch_estimates(g2 + tr / b_small, b_small, g2 + tr / b_big, b_big)
        assert got == pytest.approx((g2, tr), rel=1e-12)


def test_dp_equal_batches_is_the_textbook_two_batch_estimate() -> None:
    rng = np.random.default_rng(0)
    local = [float(x) for x in rng.uniform(5, 9, size=4)]
    glob = 4.2
    got = dp_estimates(local, [8.0] * 4, glob)
    want = two_batch_estimates(sum(local) / 4, 8.0, glob, 32.0)
    assert got == pytest.approx(want, rel=1e-12)
    # With equal batches the two ways of averaging the global gradient coincide.
    assert dp_estimates(local, [8.0] * 4, glob, grad_average="ranks") == pytest.approx(
        want, rel=1e-12
    )


@pytest.mark.parametrize("grad_average", ["samples", "ranks"])
def test_dp_unequal_batches_exact_on_expectations(grad_average: str) -> None:
    """Plug E|G_r|² and E|G_big|² in: the derivation must return |G|² and tr Σ exactly."""
    g2, tr = 2.0, 90.0
    batches = [3.0, 5.0, 12.0, 20.0]
    d, total = len(batches), sum(batches)
    weights = [b / total for b in batches] if grad_average == "samples" else [1.0 / d] * d
    big = g2 + tr * sum(w * w / b for w, b in zip(weights, batches, strict=True))
    local = [g2 + tr / b for b in batches]
    got = dp_estimates(local, batches, big, grad_average=grad_average)  # type: ignore[arg-type]
    assert got == pytest.approx((g2, tr), rel=1e-12)


@pytest.mark.parametrize(
    ("batches", "grad_average"),
    [([8, 8, 8, 8], "samples"), ([4, 8, 12, 16], "samples"), ([4, 8, 12, 16], "ranks")],
)
def test_dp_estimator_recovers_b_simple_on_noisy_quadratic(
    batches: list[int], grad_average: str
) -> None:
    est, per_step, g2_true, tr_true = _simulate_dp(7, batches, grad_average)
    b = est.b_simple
    assert b is not None
    assert b == pytest.approx(B_SIMPLE_TRUE, rel=0.10)
    # Per-step estimates are unbiased: their plain means are within a few percent.
    assert per_step[:, 0].mean() == pytest.approx(g2_true, rel=0.05)
    assert per_step[:, 1].mean() == pytest.approx(tr_true, rel=0.03)
    # ...but single steps are noisy enough that |G|² comes out negative sometimes.
    assert (per_step[:, 0] < 0).any()
    band = est.band()
    assert band is not None
    lo, hi = band
    assert lo < B_SIMPLE_TRUE < hi
    assert lo < b < hi
    assert hi / lo < 1.6


def test_dp_estimate_agrees_with_direct_two_batch_estimate() -> None:
    """Same steps: DP (all ranks as small batches) vs direct (rank 0 only as small batch)."""
    g, sd, _, _ = _problem(3)
    rng = np.random.default_rng(33)
    batches = [8, 8, 8, 8]
    steps = 3000
    locs = _rank_means(rng, g, sd, batches, steps)
    glob = np.stack(locs).mean(axis=0)
    dp, direct = NoiseScaleEstimator(0.999), NoiseScaleEstimator(0.999)
    tr_dp, tr_direct = [], []
    for t in range(steps):
        big = float(glob[t] @ glob[t])
        g2, tr = dp_estimates([float(loc[t] @ loc[t]) for loc in locs], [8.0] * 4, big)
        dp.update(g2, tr)
        tr_dp.append(tr)
        g2d, trd = two_batch_estimates(float(locs[0][t] @ locs[0][t]), 8.0, big, 32.0)
        direct.update(g2d, trd)
        tr_direct.append(trd)
    assert dp.b_simple is not None
    assert direct.b_simple is not None
    assert dp.b_simple == pytest.approx(direct.b_simple, rel=0.10)
    assert dp.b_simple == pytest.approx(B_SIMPLE_TRUE, rel=0.10)
    assert direct.b_simple == pytest.approx(B_SIMPLE_TRUE, rel=0.15)
    # Averaging over the 4 ranks makes the per-step tr(Σ) estimate clearly less noisy.
    assert np.var(tr_dp) < 0.7 * np.var(tr_direct)


def test_microbatch_fallback_on_one_rank() -> None:
    g, sd, _, _ = _problem(11)
    rng = np.random.default_rng(111)
    micro = [6, 6, 6, 6]
    steps = 3000
    means = _rank_means(rng, g, sd, micro, steps)
    step_grad = np.stack(means).mean(axis=0)  # gradient accumulation of mean micro-batch losses
    est = NoiseScaleEstimator(0.999)
    for t in range(steps):
        est.update(
            *microbatch_estimates(
                [float(m[t] @ m[t]) for m in means], [6.0] * 4, float(step_grad[t] @ step_grad[t])
            )
        )
    assert est.b_simple == pytest.approx(B_SIMPLE_TRUE, rel=0.10)


def test_dp_estimates_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="at least 2 parts"):
        dp_estimates([1.0], [8.0], 1.0)
    with pytest.raises(ValueError, match="3 squared norms but 2 batch sizes"):
        dp_estimates([1.0, 2.0, 3.0], [8.0, 8.0], 1.0)
    with pytest.raises(ValueError, match=r"batch\[1\]=0"):
        dp_estimates([1.0, 2.0], [8.0, 0.0], 1.0)
    with pytest.raises(ValueError, match="too unbalanced"):
        dp_estimates([1.0, 2.0], [1.0, 1000.0], 1.0, grad_average="ranks")
    with pytest.raises(ValueError, match=re.escape("b_big=4.0 must be > b_small=4.0")):
        two_batch_estimates(1.0, 4.0, 1.0, 4.0)


def test_estimator_bias_correction_and_degenerate_cases() -> None:
    est = NoiseScaleEstimator(0.9)
    assert est.b_simple is None
    assert est.g2 is None
    assert est.band() is None
    est.update(2.0, 100.0)
    assert est.g2 == pytest.approx(2.0, rel=1e-12)  # bias-corrected: first value exactly
    assert est.tr_sigma == pytest.approx(100.0, rel=1e-12)
    assert est.b_simple == pytest.approx(50.0, rel=1e-12)
    assert est.band() is None  # one sample has no spread
    est.update(4.0, 40.0)
    # Bias-corrected 2-step EMA: weights (0.1·0.9, 0.1)/(1 - 0.81) on (first, second).
    w1, w2 = 0.09 / 0.19, 0.1 / 0.19
    assert est.g2 == pytest.approx(w1 * 2.0 + w2 * 4.0, rel=1e-12)
    assert est.b_simple == pytest.approx((w1 * 100 + w2 * 40) / (w1 * 2 + w2 * 4), rel=1e-12)

    neg = NoiseScaleEstimator(0.9)
    neg.update(-1.0, 50.0)
    assert neg.b_simple is None  # |G|² not resolved: no number
    no_noise = NoiseScaleEstimator(0.9)
    no_noise.update(1.0, -3.0)
    assert no_noise.b_simple == 0.0
    with pytest.raises(ValueError, match="non-finite"):
        no_noise.update(math.nan, 1.0)


def test_weighted_moments_match_brute_force() -> None:
    """Mean and standard error of the dof-weighted EMA against explicit weights."""
    rng = np.random.default_rng(3)
    for beta, t in [(0.9, 2), (0.9, 5), (0.99, 300), (0.5, 40)]:
        xs = rng.normal(5.0, 2.0, size=t)
        dofs = rng.integers(1, 16, size=t).astype(float)
        m = _Moments()
        for x, d in zip(xs, dofs, strict=True):
            m.update(float(x), float(d), beta)
        w = dofs * beta ** np.arange(t - 1, -1, -1)  # newest step has age 0
        u = w / w.sum()
        mean = float(u @ xs)
        var = float(u @ (xs - mean) ** 2) / (1.0 - float(u @ u))
        assert m.mean == pytest.approx(mean, rel=1e-10)
        se = m.stderr()
        assert se is not None
        assert se == pytest.approx(math.sqrt(var * float(u @ u)), rel=1e-8)


def test_steps_are_weighted_by_their_degrees_of_freedom() -> None:
    """A 1-dof step counts a seventh of a 7-dof step (the old estimator weighted them alike)."""
    est = NoiseScaleEstimator(0.9)
    est.update(1.0, 100.0, dof=1.0)
    est.update(1.0, 800.0, dof=7.0)
    # weights 0.9·1 and 7 -> tr = (0.9·100 + 7·800)/7.9
    assert est.tr_sigma == pytest.approx((0.9 * 100 + 7 * 800) / 7.9, rel=1e-12)
    assert est.dof == pytest.approx(7.9)
    unweighted = (0.9 * 100 + 800) / 1.9  # what equal weights would give
    assert abs((est.tr_sigma or 0.0) - unweighted) > 200


def test_band_narrows_with_more_steps() -> None:
    short, _, _, _ = _simulate_dp(2, [8, 8, 8, 8], "samples", steps=200, beta=0.999)
    long, _, _, _ = _simulate_dp(2, [8, 8, 8, 8], "samples", steps=2000, beta=0.999)
    b_short, b_long = short.band(), long.band()
    assert b_short is not None
    assert b_long is not None
    assert (b_long[1] - b_long[0]) < 0.5 * (b_short[1] - b_short[0])


def test_estimator_state_round_trip_is_exact() -> None:
    est = NoiseScaleEstimator(0.95, z=3.0)
    rng = np.random.default_rng(4)
    for _ in range(20):
        est.update(float(rng.normal(2, 1)), float(rng.normal(100, 30)))
    state = json.loads(json.dumps(est.state_dict()))
    copy = NoiseScaleEstimator(0.95)
    copy.load_state_dict(state)
    for x in (est, copy):
        x.update(1.5, 80.0)
    assert copy.b_simple == est.b_simple
    assert copy.band() == est.band()
    with pytest.raises(ValueError, match=re.escape("beta=0.95")):
        NoiseScaleEstimator(0.9).load_state_dict(state)


def _lower_band_ratio(batch: int, part: int, steps: int, horizon: float | None, replicates: int = 200) -> float:
    """Median over replicates of B_simple's lower band end / B_simple after `steps` steps of
    `batch` samples cut into parts of `part` (the micro-batch probe at DP = 1)."""
    g, sd, _, _ = _problem(5)
    k = batch // part
    ratios = []
    for seed in range(replicates):
        locs = _rank_means(np.random.default_rng(seed), g, sd, [part] * k, steps)
        est = NoiseScaleEstimator(0.9, horizon_dof=horizon or 0.0)
        for t in range(steps):
            whole = np.mean([loc[t] for loc in locs], axis=0)
            plain = microbatch_estimates(
                [float(loc[t] @ loc[t]) for loc in locs], [float(part)] * k, float(whole @ whole)
            )
            est.update(*plain, dof=parts_dof(k))
        b, low = est.b_simple, est.b_simple_low
        if b and low is not None:
            ratios.append(low / b)
    assert len(ratios) > 0.9 * replicates
    return float(np.median(ratios))


def test_a_dof_horizon_keeps_the_band_width_whatever_the_batch() -> None:
    """Per-step decay: 2 parts a step (1 dof) leave the band's lower end at ~0.45 of the
    estimate against ~0.76 with 8 parts, so a small batch sits inside a wide band and is held
    (the ratchet of docs/COORDINATOR.md §1). A horizon in dof, tuned to equal the per-step
    decay at 8 parts, brings the small batch's band to within a few percent of the large one's."""
    horizon = -7 / math.log(0.9)  # exp(-7/H) = 0.9: the same decay as ema_beta at 8 parts
    step_small, step_large = _lower_band_ratio(16, 8, 160, None), _lower_band_ratio(64, 8, 40, None)
    dof_small, dof_large = _lower_band_ratio(16, 8, 400, horizon), _lower_band_ratio(64, 8, 60, horizon)
    assert step_large - step_small > 0.2
    assert dof_large == pytest.approx(step_large, abs=0.02)  # same decay at 8 parts
    assert abs(dof_large - dof_small) < 0.1


def test_decay_for_holds_the_horizon_in_dof() -> None:
    assert decay_for(7.0, 70.0) == pytest.approx(math.exp(-0.1))
    for d in (1.0, 7.0, 31.0):
        est = NoiseScaleEstimator(0.9, horizon_dof=60.0)
        for _ in range(2000):
            est.update(1.0, 50.0, dof=d)
        assert est.dof == pytest.approx(d / (1 - math.exp(-d / 60.0)), rel=1e-9)
        assert 60.0 <= est.dof <= 60.0 + d  # ~H + d/2 at any batch
    with pytest.raises(ValueError, match="horizon"):
        decay_for(1.0, 0.0)
    with pytest.raises(ValueError, match="horizon_dof"):
        NoiseScaleEstimator(0.9, horizon_dof=-1.0)
    state = NoiseScaleEstimator(0.9, horizon_dof=60.0).state_dict()
    with pytest.raises(ValueError, match="horizon_dof=60.0"):
        NoiseScaleEstimator(0.9).load_state_dict(state)


def test_expert_parallel_classes_are_unbiased_where_one_mixed_part_per_rank_is_not() -> None:
    """DP = 4 ranks, EP = 2 (two EP groups of two ranks), 2 micro-batches of n = 4 samples a rank;
    4 experts of 3 coordinates, experts {0, 1} on EP rank 0 and {2, 3} on EP rank 1. A rank's
    dense gradient is its own micro-batch's; its experts' gradient is that of the union of its
    group's micro-batches (2n samples). Averaged over many draws, the coordinator's two-class
    estimate (dense parts per rank, expert parts per EP group, `expert_parallel_estimates`) hits
    the true |G|² and tr Σ; the old reading — one part per rank, the change of its whole
    buffer (its dense part and its experts' share of the union) rescaled as n samples — is
    biased far outside the noise (its experts' signal counted E× over)."""
    from megarl.coordinator.estimates import grad_updates
    from megarl.coordinator.records import ExpertGradStats, ModelGradStats

    rng = np.random.default_rng(0)
    dp, ep, k, n, dense_dim = 4, 2, 2, 4, 12
    g = rng.normal(size=dense_dim + 12)
    sd = np.concatenate([np.full(dense_dim, 1.0), np.full(12, 3.0)])  # the experts' noise dominates
    true_g2, true_tr = float(g @ g), float(np.sum(sd**2))
    dense, expert = slice(0, dense_dim), slice(dense_dim, None)
    own = [slice(dense_dim, dense_dim + 6), slice(dense_dim + 6, None)]  # EP rank e's experts
    new, old = [], []
    for _ in range(3000):
        x = g + rng.normal(size=(dp, k, n, g.size)) * sd  # (rank, micro-batch, sample, coordinate)
        mb = x.mean(2)  # (rank, micro-batch, coordinate): each micro-batch's mean gradient
        union = x.reshape(dp // ep, ep, k, n, -1).mean((1, 3))  # (EP group, micro-batch, coordinate)
        step = x.mean((0, 1, 2))
        stats = ModelGradStats(
            model="actor",
            local_sq_norms=[float(v[dense] @ v[dense]) for v in mb.reshape(-1, g.size)],
            local_batches=[float(n)] * (dp * k),
            global_sq_norm=float(step[dense] @ step[dense]),
            source="microbatch",
            experts=ExpertGradStats(
                sq_norms=[float(v[expert] @ v[expert]) for v in union.reshape(-1, g.size)],
                batches=[float(ep * n)] * (dp // ep * k),
                global_sq_norm=float(step[expert] @ step[expert]),
            ),
        )
        (u,) = grad_updates([stats], {"actor": 1.0}, {})
        new.append((u.g2, u.tr_sigma))
        assert u.dof == dp // ep * k - 1  # the fewer (expert) parts' degrees of freedom
        # rank r = (group, EP rank e): its buffer's change, its dense part's n/D·mean plus its
        # experts' E·n/D·mean of the union, rescaled as n units (× (D/n)²)
        mixed = [
            float(mb[r, j, dense] @ mb[r, j, dense])
            + ep**2 * float(union[r // ep, j, own[r % ep]] @ union[r // ep, j, own[r % ep]])
            for r in range(dp)
            for j in range(k)
        ]
        old.append(microbatch_estimates(mixed, [float(n)] * (dp * k), float(step @ step), grad_average="samples"))
    for name, values in (("two classes", np.array(new)), ("one mixed part a rank", np.array(old))):
        mean, se = values.mean(0), values.std(0) / math.sqrt(len(values))
        print(f"{name}: |G|² {mean[0]:.3f} ± {se[0]:.3f} (true {true_g2:.3f}), tr Σ {mean[1]:.2f} ± {se[1]:.2f} (true {true_tr:.2f})")
        z = np.abs(mean - [true_g2, true_tr]) / se
        if name == "two classes":
            assert (z < 4).all(), z
        else:
            assert (z > 20).all(), z  # E·|G_e|² in place of |G_e|² on the small side
