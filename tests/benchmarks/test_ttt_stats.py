"""benchmarks/ttt/stats.py: Student's t without scipy, paired ratios with a one-sided lower bound,
and the seed count a bar needs — against closed forms worked by hand."""

import math

import pytest

from benchmarks.ttt.stats import paired, seeds_needed, t_cdf, t_quantile


def t1(p):  # Student's t, 1 degree of freedom (Cauchy): tan(π(p − ½))
    return math.tan(math.pi * (p - 0.5))


def t2(p):  # 2 degrees of freedom: (2p − 1) / √(2p(1 − p))
    return (2 * p - 1) / math.sqrt(2 * p * (1 - p))


@pytest.mark.parametrize("p", [0.6, 0.8, 0.9, 0.95, 0.99, 0.1])
def test_t_quantile_matches_the_closed_forms_at_one_and_two_degrees_of_freedom(p):
    assert t_quantile(p, 1) == pytest.approx(t1(p), rel=1e-9)
    assert t_quantile(p, 2) == pytest.approx(t2(p), rel=1e-9)


def test_t_quantile_matches_printed_tables_and_tends_to_the_normal():
    # one-sided 90 % and 80 % points (any t table): df 9 → 1.383, 0.883; df 7 → 1.415
    assert t_quantile(0.9, 9) == pytest.approx(1.383029, abs=1e-6)
    assert t_quantile(0.8, 9) == pytest.approx(0.883404, abs=1e-6)
    assert t_quantile(0.9, 7) == pytest.approx(1.414924, abs=1e-6)
    assert t_quantile(0.9, 1e6) == pytest.approx(1.281552, abs=1e-5)  # z_0.9
    assert t_cdf(0.0, 5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="0 < p < 1"):
        t_quantile(1.0, 3)


def test_paired_geometric_mean_and_lower_bound_by_hand():
    # log ratios 0.1, 0.3, 0.2: mean 0.2, sample sd 0.1, n 3 → LB = exp(0.2 − t_{0.9,2} · 0.1/√3)
    p = paired([math.exp(0.1), math.exp(0.3), math.exp(0.2)])
    assert p.n == 3 and p.gm == pytest.approx(math.exp(0.2)) and p.sigma_log == pytest.approx(0.1)
    assert p.lower == pytest.approx(math.exp(0.2 - t2(0.9) * 0.1 / math.sqrt(3)), rel=1e-9)
    assert p.lower == pytest.approx(1.0954, abs=1e-4)
    one = paired([1.5])
    assert one.gm == pytest.approx(1.5) and one.lower is None  # no spread from one seed
    assert paired([]) is None


def test_seeds_needed_is_the_first_n_whose_expected_bound_clears_the_bar():
    # gap ln(1.2) = 0.1823; n = 2 needs (t9 + t8)(df 1)·σ/√2 = 3.1495σ, n = 3 needs (df 2)/√3 = 1.7010σ
    assert (t1(0.9) + t1(0.8)) / math.sqrt(2) == pytest.approx(3.14950, abs=1e-5)
    assert (t2(0.9) + t2(0.8)) / math.sqrt(3) == pytest.approx(1.70103, abs=1e-5)
    assert seeds_needed(1.2, 0.05, 1.0) == 2  # 3.1495 · 0.05 = 0.157 ≤ 0.182
    assert seeds_needed(1.2, 0.1, 1.0) == 3  # 0.315 > 0.182 ≥ 0.170
    assert seeds_needed(1.2, 0.11, 1.0) > 3  # 0.187 > 0.182
    assert seeds_needed(1.0, 0.1, 1.05) is None  # the effect is below the bar: no n does
    assert seeds_needed(1.06, 2.0, 1.05) is None  # more than 200
