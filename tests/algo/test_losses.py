"""PPO policy/value losses and TIS weights against element-wise python references."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.losses import policy_loss, tis_weights, value_loss

SEEDS = range(4)


def _inputs(seed: int, b: int = 5, t: int = 8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    # ratios spread over ~[0.3, 3.3] so every clipping branch is exercised
    new = old + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 2.4
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0], lengths[1] = t, 0  # a full and an empty response
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    # row 0 is full: pin one token on each branch (high clip, low clip, dual clip, none)
    pinned = torch.tensor([1.5, 0.5, 3.0, 0.5], dtype=torch.float64)
    new[0, :4] = old[0, :4] + pinned.log()
    adv[0, :4] = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    return new, old, adv, mask


def ref_policy(lp, old, a, cl, ch, dual, w):
    """Loss and d loss / d lp for one token."""
    ratio = math.exp(lp - old)
    unclipped, clipped = -a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch)
    loss, grad = (unclipped, -a * ratio) if unclipped >= clipped else (clipped, 0.0)
    if dual is not None and a < 0 and -dual * a < loss:
        loss, grad = -dual * a, 0.0
    return loss * w, grad * w


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("cl", "ch", "dual", "use_w"),
    [(0.2, 0.2, None, False), (0.2, 0.28, None, False), (0.1, 0.3, 2.0, True)],
)
def test_policy_loss_and_grad_match_loop(seed, cl, ch, dual, use_w) -> None:
    new, old, adv, mask = _inputs(seed)
    g = torch.Generator().manual_seed(seed + 99)
    w = torch.rand(new.shape, generator=g, dtype=torch.float64) * 2 if use_w else None
    lp = new.clone().requires_grad_(True)
    loss, stats = policy_loss(
        lp, old, adv, mask, clip_low=cl, clip_high=ch, dual_clip=dual, tis_weights=w
    )
    loss.sum().backward()
    assert lp.grad is not None
    n_valid, n_clip, n_low, n_high, n_dual = 0, 0, 0, 0, 0
    for i in range(new.shape[0]):
        for j in range(new.shape[1]):
            if not mask[i, j]:
                assert loss[i, j].item() == 0.0 and lp.grad[i, j].item() == 0.0
                continue
            wij = float(w[i, j]) if w is not None else 1.0
            a, ratio = float(adv[i, j]), math.exp(float(new[i, j] - old[i, j]))
            ref_l, ref_g = ref_policy(float(new[i, j]), float(old[i, j]), a, cl, ch, dual, wij)
            assert loss[i, j].item() == pytest.approx(ref_l, abs=1e-12)
            assert lp.grad[i, j].item() == pytest.approx(ref_g, abs=1e-12)
            n_valid += 1
            n_low += a < 0 and ratio < 1 - cl
            n_high += a > 0 and ratio > 1 + ch
            n_clip += -a * min(max(ratio, 1 - cl), 1 + ch) > -a * ratio
            n_dual += dual is not None and a < 0 and ratio > dual
    assert stats["clipfrac"].item() == pytest.approx(n_clip / n_valid)
    assert stats["clipfrac_low"].item() == pytest.approx(n_low / n_valid)
    assert stats["clipfrac_high"].item() == pytest.approx(n_high / n_valid)
    assert stats["dual_clipfrac"].item() == pytest.approx(n_dual / n_valid)
    assert n_low > 0 and n_high > 0  # the inputs really exercise both clip sides
    assert dual is None or n_dual > 0


def test_policy_stats_values() -> None:
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[0.5, 1.0, 2.0]]))
    _, stats = policy_loss(new, old, torch.ones(1, 3), torch.ones(1, 3))
    # k3 of KL(old || new): mean of (r - 1) - log r
    expected_kl = ((0.5 - 1 - math.log(0.5)) + (2 - 1 - math.log(2.0))) / 3
    assert stats["approx_kl"].item() == pytest.approx(expected_kl, rel=1e-6)
    assert stats["ratio_mean"].item() == pytest.approx(3.5 / 3, rel=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(2.0, rel=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)  # only r=2 with A>0


def test_clip_higher_asymmetry() -> None:
    """r = 1.25, A > 0: clipped with eps_high 0.2, not with 0.28; r = 0.75, A < 0: both clip."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.log(torch.tensor([[1.25, 0.75]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    sym, _ = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    asym, stats = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert sym[0, 0].item() == pytest.approx(-1.2)
    assert asym[0, 0].item() == pytest.approx(-1.25)
    assert sym[0, 1].item() == pytest.approx(0.8) and asym[0, 1].item() == pytest.approx(0.8)
    (grad_sym,) = torch.autograd.grad(sym.sum(), new)
    (grad_asym,) = torch.autograd.grad(asym.sum(), new)
    assert grad_sym[0, 0].item() == 0.0
    assert grad_asym[0, 0].item() == pytest.approx(-1.25)
    assert stats["clipfrac_high"].item() == 0.0
    assert stats["clipfrac_low"].item() == pytest.approx(0.5)


def test_dual_clip_only_for_negative_advantages() -> None:
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[10.0, 10.0, 2.0, 0.1]]))
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    plain, _ = policy_loss(new, old, adv, mask)
    dual, stats = policy_loss(new, old, adv, mask, dual_clip=3.0)
    assert plain[0].tolist() == pytest.approx([-1.2, 10.0, 2.0, 0.8])
    # A > 0 untouched; A < 0: capped at -c*A = 3 only where the surrogate exceeds it
    assert dual[0].tolist() == pytest.approx([-1.2, 3.0, 2.0, 0.8])
    assert stats["dual_clipfrac"].item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="dual_clip=1.0"):
        policy_loss(new, old, adv, mask, dual_clip=1.0)


def test_tis_weights_are_constants_in_the_loss() -> None:
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    w = torch.tensor([[0.5, 2.0]], requires_grad=True)
    loss, _ = policy_loss(new, new.detach(), torch.ones(1, 2), torch.ones(1, 2), tis_weights=w)
    assert loss[0].tolist() == pytest.approx([-0.5, -2.0])
    loss.sum().backward()
    assert w.grad is None
    assert new.grad is not None and new.grad[0].tolist() == pytest.approx([-0.5, -2.0])


def test_empty_mask_no_nan() -> None:
    new = torch.full((2, 3), math.nan)
    loss, stats = policy_loss(new, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert torch.equal(loss, torch.zeros(2, 3))
    assert all(torch.isfinite(v) and v.item() == 0.0 for v in stats.values())
    weights, tstats = tis_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert torch.equal(weights, torch.zeros(2, 3))
    assert all(torch.isfinite(v) for v in tstats.values())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_loop(seed: int, clip: float | None) -> None:
    g = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    old = values + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    returns = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) < 0.7
    out = value_loss(values, old, returns, mask, clip=clip)
    n_clip_active = 0
    for i in range(shape[0]):
        for j in range(shape[1]):
            v, o, r = float(values[i, j]), float(old[i, j]), float(returns[i, j])
            expected = 0.5 * (v - r) ** 2
            if clip is not None:
                vc = min(max(v, o - clip), o + clip)
                n_clip_active += (vc - r) ** 2 > (v - r) ** 2
                expected = 0.5 * max((v - r) ** 2, (vc - r) ** 2)
            expected = expected if mask[i, j] else 0.0
            assert out[i, j].item() == pytest.approx(expected, abs=1e-12)
    if clip is not None:
        assert n_clip_active > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_tis_weights_match_loop(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 4
    engine = old + torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.8
    engine[0, 0] = old[0, 0] - 50.0  # ratio e^50: must cap without overflow
    mask = torch.rand(4, 7, generator=g) < 0.7
    mask[0, 0] = True
    weights, stats = tis_weights(old, engine, mask, cap=2.0)
    diffs, capped = [], 0
    for i in range(4):
        for j in range(7):
            d = float(old[i, j] - engine[i, j])
            expected = min(math.exp(d), 2.0) if mask[i, j] else 0.0
            assert weights[i, j].item() == pytest.approx(expected, rel=1e-6)
            if mask[i, j]:
                diffs.append(d)
                capped += math.exp(d) > 2.0
    assert stats["mean_abs_logp_diff"].item() == pytest.approx(
        sum(abs(d) for d in diffs) / len(diffs), rel=1e-6
    )
    assert stats["max_ratio"].item() == pytest.approx(math.exp(20.0), rel=1e-6)  # clamped
    assert stats["capped_frac"].item() == pytest.approx(capped / len(diffs))
    assert not weights.requires_grad
