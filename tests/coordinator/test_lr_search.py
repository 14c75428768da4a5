"""The online LR multiplier (coordinator.lr_search) on a noisy quadratic, and in the coordinator.

The quadratic: loss ½ Σ h_i θ_i², h log-spaced over two decades, gradient noise σ/√B per
coordinate, Adam (β 0.9 / 0.999). The multiplier sees only cos(g_{t+1}, Δθ_t), as in a run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megarl.config import CoordinatorConfig
from megarl.coordinator import Coordinator, CoordinatorRun, ModelGradStats, StepTimings
from megarl.coordinator.lr_search import LrSearch

BASE = 0.1  # the best fixed LR of this problem on a ×2 grid (the sweep below checks it)


def adam_on_quadratic(lr: float, search: bool, seed: int, steps: int = 150, dim: int = 50) -> tuple[float, float]:
    """(final loss, final multiplier)."""
    rng = np.random.default_rng(seed)
    h = np.logspace(-1, 1, dim)
    theta = rng.normal(size=dim) * 3
    m, v = np.zeros(dim), np.zeros(dim)
    s = LrSearch() if search else None
    prev = None
    for t in range(steps):
        g = h * theta + rng.normal(size=dim) / 4
        if s is not None and prev is not None:
            d = theta - prev
            s.update(float(g @ d / math.sqrt((g @ g) * (d @ d))))
        prev = theta.copy()
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        step = (m / (1 - 0.9 ** (t + 1))) / (np.sqrt(v / (1 - 0.999 ** (t + 1))) + 1e-8)
        theta = theta - lr * (s.multiplier if s else 1.0) * step
    return 0.5 * float(h @ (theta * theta)), s.multiplier if s else 1.0


def median_loss(lr: float, search: bool) -> float:
    return float(np.median([adam_on_quadratic(lr, search, seed)[0] for seed in range(5)]))


def test_search_recovers_from_a_wrong_lr_either_way() -> None:
    fixed = {f: median_loss(BASE * f, False) for f in (1 / 4, 1 / 2, 1, 2, 8)}
    best = min(fixed.values())
    assert min(fixed, key=lambda f: fixed[f]) == 1
    for f in (1 / 4, 8):  # 4x too low, 8x too high
        assert fixed[f] > 8 * best, (f, fixed)  # the wrong LR alone is far off
        searched = median_loss(BASE * f, True)
        assert searched < 1.5 * best, (f, searched, best)
    # it moves the right way: up from too low, down from too high
    assert all(adam_on_quadratic(BASE / 4, True, s)[1] > 2 for s in range(3))
    assert all(adam_on_quadratic(BASE * 8, True, s)[1] < 0.25 for s in range(3))


def test_update_rule_closed_form_and_bounds() -> None:
    s = LrSearch(rate=0.1, beta=0.9, range=2.0)
    s.update(0.3)  # first reading: m/√v = sign = +1 (overshoot): log M -= rate
    assert s.log_mult == pytest.approx(-0.1)
    s.update(-0.3)  # m = 0.9·0.03 - 0.03 = -0.003, v = 0.009; corrected by 1 - 0.81
    m, v = (0.9 * 0.03 - 0.03) / 0.19, (0.9 * 0.009 + 0.009) / 0.19
    assert s.log_mult == pytest.approx(-0.1 - 0.1 * m / math.sqrt(v))
    for _ in range(50):
        s.update(0.5)
    assert s.multiplier == pytest.approx(0.5)  # clipped at 1/range
    with pytest.raises(ValueError, match="step cosine"):
        s.update(float("nan"))
    restored = LrSearch(rate=0.1, beta=0.9, range=2.0)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def _grads(cos: float | None) -> list[ModelGradStats]:
    return [
        ModelGradStats(
            model="actor",
            local_sq_norms=[2.0, 2.2, 1.8, 2.1],
            local_batches=[16.0] * 4,
            global_sq_norm=1.0,
            step_cosine=cos,
        )
    ]


def _timings() -> StepTimings:
    return StepTimings(generate_s=1.0, train_s=1.0, rollout_responses=64, rollout_tokens=640)


def test_coordinator_multiplies_the_rule_lr_and_checkpoints_it() -> None:
    run = CoordinatorRun(samples_per_prompt=8, initial_prompts=8, lr_ref={"actor": 1e-4})
    cfg = CoordinatorConfig(enabled=True, lr_search=True, min_gain=1e9)  # min_gain: keep the batch
    c = Coordinator(cfg, run)
    assert c.next_plan().lr["actor"] == pytest.approx(1e-4)
    c.observe(0, _grads(None), _timings())  # no Δθ yet: no reading
    assert c.lr_multiplier("actor") == 1.0
    for step in range(1, 6):
        c.observe(step, _grads(0.05), _timings())  # the loss rises along the step: too large
    mult = c.lr_multiplier("actor")
    assert mult == pytest.approx(math.exp(-0.5))
    plan = c.next_plan()
    assert plan.num_prompts == 8
    assert plan.lr["actor"] == pytest.approx(1e-4 * mult)
    assert c.metrics()["coord/lr_mult/actor"] == pytest.approx(mult)
    again = Coordinator(cfg, run)
    again.load_state_dict(c.state_dict())
    assert again.next_plan().lr == plan.lr
    off = Coordinator(CoordinatorConfig(enabled=True, min_gain=1e9), run)
    for step in range(6):
        off.observe(step, _grads(0.05), _timings())
    assert off.next_plan().lr["actor"] == pytest.approx(1e-4)  # lr_search off: cosines ignored
    with pytest.raises(ValueError, match="step_cosine"):
        c.observe(6, _grads(1.5), _timings())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lr_search_rate", 0.0, "lr_search_rate=0.0 must be finite and > 0"),
        ("lr_search_beta", 1.0, r"lr_search_beta=1.0 must be in \[0, 1\)"),
        ("lr_search_range", 0.5, "lr_search_range=0.5 must be finite and >= 1"),
    ],
)
def test_bad_settings_are_named(field: str, value: float, message: str) -> None:
    run = CoordinatorRun(samples_per_prompt=8, initial_prompts=8, lr_ref={"actor": 1e-4})
    with pytest.raises(ValueError, match=message):
        Coordinator(CoordinatorConfig(enabled=True, lr_search=True, **{field: value}), run)
