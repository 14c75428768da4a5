"""Masked reductions against python-loop references; garbage outside the mask is ignored."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten


def _inputs(seed: int, b: int = 5, t: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, dtype=torch.float64) * 3 + 1
    mask = torch.rand(b, t, generator=g) < 0.6
    x[~mask] = math.nan  # must never leak into results
    return x, mask


def _valid(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [
        float(x[i, j]) for i in range(x.shape[0]) for j in range(x.shape[1]) if bool(mask[i, j])
    ]


@pytest.mark.parametrize("seed", range(4))
def test_sum_mean_var_match_loops(seed: int) -> None:
    x, mask = _inputs(seed)
    vals = _valid(x, mask)
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    assert masked_sum(x, mask).item() == pytest.approx(sum(vals), abs=1e-12)
    assert masked_mean(x, mask).item() == pytest.approx(mean, abs=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(var, abs=1e-12)
    unbiased = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    assert masked_var(x, mask, unbiased=True).item() == pytest.approx(unbiased, abs=1e-12)
    row_means = masked_mean(x, mask.float(), dim=1)
    for i in range(x.shape[0]):
        row = [float(x[i, j]) for j in range(x.shape[1]) if mask[i, j]]
        expected = sum(row) / len(row) if row else 0.0
        assert row_means[i].item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_whiten_matches_loop(seed: int) -> None:
    x, mask = _inputs(seed)
    vals = _valid(x, mask)
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals) + 1e-8)
    out = masked_whiten(x, mask)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            expected = (float(x[i, j]) - mean) / std if mask[i, j] else 0.0
            assert out[i, j].item() == pytest.approx(expected, abs=1e-10)
    kept = masked_whiten(x, mask, shift_mean=False)
    assert masked_mean(kept, mask).item() == pytest.approx(mean, abs=1e-10)


def test_empty_mask_gives_zeros_not_nan() -> None:
    x = torch.full((3, 4), math.nan)
    mask = torch.zeros(3, 4)
    assert masked_mean(x, mask).item() == 0.0
    assert masked_var(x, mask).item() == 0.0
    assert torch.equal(masked_whiten(x, mask), torch.zeros(3, 4))
    one = torch.zeros(3, 4)
    one[1, 2] = 1.0
    assert torch.equal(masked_whiten(torch.ones(3, 4), one), torch.zeros(3, 4))
