"""Goodput batch choice: known argmax, brute force over the grid, hysteresis, the grid."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import pytest

from megarl.coordinator.goodput import BatchGrid, choose_batch, efficiency, goodput
from megarl.coordinator.throughput import LinearTimeModel


@dataclass
class Affine:
    """Synthetic step time alpha + beta·B (+ gamma·B² for a saturating curve)."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def predict(self, b: float) -> float:
        return self.alpha + self.beta * b + self.gamma * b * b


def _brute_force(grid: BatchGrid, b_noise: float, tm: Affine) -> int:
    spp = grid.samples_per_prompt
    scores = {p: goodput(p * spp, b_noise, 64.0, tm.predict(p * spp)) for p in grid.prompts()}
    return max(scores, key=lambda p: scores[p])


def test_efficiency_and_goodput_formulas() -> None:
    assert efficiency(64, 200, 64) == 1.0
    assert efficiency(256, 200, 64) == pytest.approx(264 / 456, rel=1e-12)
    assert efficiency(16, 200, 64) == pytest.approx(264 / 216, rel=1e-12)
    assert efficiency(1000, 0.0, 10) == pytest.approx(0.01)  # no noise: only steps count
    assert goodput(256, 200, 64, 8.0) == pytest.approx(32 * 264 / 456, rel=1e-12)


def test_unbounded_noise_scale_counts_every_sample_fully() -> None:
    """B_noise = inf is the band's upper end while |G|² is not resolved. Its limit is efficiency
    1 at every batch (not inf/inf = nan), so the goodput optimum there is the throughput optimum,
    the grid's top for t = α + β·B; with nan every comparison failed and the optimum came out as
    whatever batch was current, which put the band's upper end at the current batch."""
    assert efficiency(4096, math.inf, 64) == 1.0 and efficiency(8, math.inf, 64) == 1.0
    assert goodput(512, math.inf, 64, 2.0) == 256.0
    grid = BatchGrid(samples_per_prompt=8, min_prompts=4, max_prompts=256)
    for current in (4, 32, 256):
        assert choose_batch(grid, math.inf, Affine(13.0, 0.05), current, min_gain=0.0).best_prompts == 256
    assert choose_batch(grid, 1e12, Affine(13.0, 0.05), 32, min_gain=0.0).best_prompts == 256  # the finite limit


def test_grid_respects_bounds_divisibility_and_spacing() -> None:
    grid = BatchGrid(samples_per_prompt=8, min_prompts=5, max_prompts=500, factor=2.0, divisor=48)
    ps = grid.prompts()
    assert grid.prompt_step == 6
    assert ps[0] == 6
    assert ps[-1] == 498
    assert all(p % 6 == 0 and (p * 8) % 48 == 0 and 5 <= p <= 500 for p in ps)
    ratios = [b / a for a, b in itertools.pairwise(ps)]
    assert all(1.3 < r < 2.7 for r in ratios[:-1])  # geometric, up to rounding to 6
    with pytest.raises(ValueError, match="divisor=64"):
        BatchGrid(samples_per_prompt=4, min_prompts=1, max_prompts=15, divisor=64).prompts()
    with pytest.raises(ValueError, match=re.escape("grid_factor=1.0")):
        BatchGrid(samples_per_prompt=4, min_prompts=1, max_prompts=15, factor=1.0).prompts()


def test_choose_batch_hits_closed_form_optimum() -> None:
    # t(B) = 20 + 0.05·B, B_noise = 500 → B* = √(20·500/0.05) = 447.2 responses ≈ 55.9 prompts.
    tm = Affine(20.0, 0.05)
    b_star = math.sqrt(20.0 * 500.0 / 0.05)
    fine = BatchGrid(samples_per_prompt=8, min_prompts=1, max_prompts=400, factor=1.001)
    assert fine.prompts() == list(range(1, 401))
    choice = choose_batch(fine, 500.0, tm, current=4, min_gain=0.0)
    assert choice.switched
    assert choice.num_prompts == choice.best_prompts
    assert choice.num_prompts in (55, 56)
    assert abs(choice.num_prompts * 8 - b_star) < 8
    assert choice.num_prompts == _brute_force(fine, 500.0, tm)
    # Goodput of the chosen batch beats the initial one by the predicted ratio.
    g4 = goodput(32, 500.0, 32, tm.predict(32))
    assert choice.gain == pytest.approx(choice.goodput / g4 - 1, rel=1e-12)


@pytest.mark.parametrize("b_noise", [10.0, 200.0, 3000.0, 1e5])
def test_choose_batch_matches_brute_force_on_saturating_curve(b_noise: float) -> None:
    tm = Affine(8.0, 0.01, 2e-5)  # throughput peaks and then falls (memory pressure)
    grid = BatchGrid(samples_per_prompt=16, min_prompts=2, max_prompts=1024, divisor=32)
    choice = choose_batch(grid, b_noise, tm, current=2, min_gain=0.0)
    assert choice.best_prompts == _brute_force(grid, b_noise, tm)
    # b0 is only a unit: it must not move the argmax.
    other = choose_batch(grid, b_noise, tm, current=2, min_gain=0.0, b0=5000.0)
    assert other.best_prompts == choice.best_prompts


def test_more_noise_means_larger_batch() -> None:
    tm = Affine(20.0, 0.05)
    grid = BatchGrid(samples_per_prompt=8, min_prompts=1, max_prompts=1024)
    chosen = [
        choose_batch(grid, bn, tm, current=8, min_gain=0.0).best_prompts
        for bn in (10.0, 100.0, 1000.0, 10000.0)
    ]
    assert chosen == sorted(chosen)
    assert chosen[0] < chosen[-1]


def test_hysteresis_blocks_small_gains() -> None:
    tm = Affine(20.0, 0.05)
    grid = BatchGrid(samples_per_prompt=8, min_prompts=8, max_prompts=256, factor=2.0)
    assert grid.prompts() == [8, 16, 32, 64, 128, 256]
    best = choose_batch(grid, 500.0, tm, current=8, min_gain=0.0)
    assert best.best_prompts == 64
    # From 32 prompts the gain to 64 is 7.5%: (64·8/45.6·564/1012) / (32·8/32.8·564/756) - 1.
    keep = choose_batch(grid, 500.0, tm, current=32, min_gain=0.10)
    assert keep.gain == pytest.approx((512 / 45.6 / 1012) / (256 / 32.8 / 756) - 1, rel=1e-12)
    assert 0.05 < keep.gain < 0.10
    assert not keep.switched
    assert keep.num_prompts == 32
    assert keep.best_prompts == 64
    assert "min_gain 10.0%" in keep.reason
    move = choose_batch(grid, 500.0, tm, current=32, min_gain=0.05)
    assert move.switched
    assert move.num_prompts == 64
    stay = choose_batch(grid, 500.0, tm, current=64, min_gain=0.05)
    assert not stay.switched
    assert stay.gain == 0.0


def test_choose_batch_with_fitted_time_model() -> None:
    m = LinearTimeModel()
    for b in (64, 128, 64, 128):
        m.observe(b, 20.0 + 0.05 * b)
    grid = BatchGrid(samples_per_prompt=8, min_prompts=1, max_prompts=400, factor=1.001)
    assert choose_batch(grid, 500.0, m, current=8).num_prompts in (55, 56)
