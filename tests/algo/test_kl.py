"""KL estimators and controllers against loop references and exact KL."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    make_kl_controller,
)


def ref_kl(lp: float, ref: float, kind: str, clamp: float = 10.0) -> float:
    lr = lp - ref
    if kind == "k1":
        return lr
    if kind == "k2":
        return 0.5 * lr * lr
    lr = min(max(lr, -clamp), clamp)
    return math.exp(-lr) - 1.0 + lr


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_matches_loop(seed: int, kind: str) -> None:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 5
    ref = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 5
    lp[0, 0], ref[0, 0] = -30.0, -1.0  # log_ratio -29: k3 clamps at -10
    out = kl_estimate(lp, ref, kind)
    assert out.shape == (4, 6)
    for i in range(4):
        for j in range(6):
            expected = ref_kl(float(lp[i, j]), float(ref[i, j]), kind)
            assert out[i, j].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_k3_clamp_keeps_values_finite() -> None:
    lp = torch.tensor([[-200.0, 0.0, -1e-3]], requires_grad=True)
    ref = torch.tensor([[0.0, -200.0, -1e-3]])
    out = kl_estimate(lp, ref, "k3")
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == pytest.approx(math.exp(10) - 11, rel=1e-6)
    assert out[0, 1].item() == pytest.approx(math.exp(-10) - 1 + 10, rel=1e-6)
    assert out[0, 2].item() == 0.0
    out.sum().backward()
    assert lp.grad is not None
    assert lp.grad[0, :2].tolist() == [0.0, 0.0]  # clamped: no gradient
    wider = kl_estimate(lp.detach(), ref, "k3", k3_clamp=20.0)
    assert wider[0, 0].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    assert kl_estimate(lp.half(), ref.half(), "k3").dtype == torch.float32


def test_k1_k3_unbiased_against_exact_kl() -> None:
    """Tokens sampled from π: mean of k1 and k3 ≈ KL(π || π_ref); k3 >= 0 everywhere."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.0, 0.2, -0.5, 0.0, -1.5], dtype=torch.float64)
    ref_logits = torch.tensor([0.3, 0.6, -0.2, -0.4, -1.0], dtype=torch.float64)
    logp, ref_logp = logits.log_softmax(0), ref_logits.log_softmax(0)
    exact = float((logp.exp() * (logp - ref_logp)).sum())
    tokens = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=g)
    lp, rp = logp[tokens][None, :], ref_logp[tokens][None, :]
    for kind in ("k1", "k3"):
        assert kl_estimate(lp, rp, kind).mean().item() == pytest.approx(exact, rel=0.05)
    assert (kl_estimate(lp, rp, "k3") >= 0).all()
    assert exact > 0.05  # the two policies really differ


def test_kl_errors() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator kind 'k4'"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), "k4")
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(2, 1), "k1")


def test_adaptive_controller_matches_loop() -> None:
    ctl = AdaptiveKLController(0.1, target_kl=6.0, horizon=10_000)
    beta = 0.1
    for kl, n in [(6.0, 256), (12.0, 256), (1.0, 512), (6.6, 128), (0.0, 1000)]:
        ctl.update(kl, n)
        error = min(max(kl / 6.0 - 1.0, -0.2), 0.2)
        beta *= 1.0 + error * n / 10_000
        assert ctl.value == pytest.approx(beta, rel=1e-12)
    # kl=12 is clipped to +0.2: beta grew by exactly 1 + 0.2 * 256 / 10000 at step 2.
    fresh = AdaptiveKLController(0.1, target_kl=6.0, horizon=10_000)
    fresh.update(12.0, 256)
    assert fresh.value == pytest.approx(0.1 * 1.00512, rel=1e-12)


def test_controllers_state_dict_round_trip() -> None:
    ctl = AdaptiveKLController(0.2, target_kl=1.0, horizon=100)
    ctl.update(3.0, 50)
    restored = AdaptiveKLController(0.2, target_kl=1.0, horizon=100)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value == pytest.approx(0.22)
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    fixed.load_state_dict({"kl_coef": 0.3})
    assert fixed.state_dict() == {"kl_coef": 0.3}
    with pytest.raises(ValueError, match="expected keys"):
        fixed.load_state_dict({"value": 0.3})


def test_make_kl_controller() -> None:
    assert isinstance(make_kl_controller("fixed", kl_coef=0.1), FixedKLController)
    ctl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=2.0, horizon=50)
    assert isinstance(ctl, AdaptiveKLController)
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        make_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown KL controller 'pid'"):
        make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="horizon=0"):
        AdaptiveKLController(0.1, target_kl=1.0, horizon=0)
