"""Adam's second moments follow a batch change (megarl.model.adam_state), on a real torch Adam
inside megatron's real optimizer wrappers (FP32Optimizer in a ChainedOptimizer, CPU compat).

Gradients are synthetic with a known noise scale: g = G + σ·ξ/√B per element, tr Σ = B_N·|G|²,
so E|g_B|² = |G|²(1 + B_N/B). After 600 steps at B_old = 64 Adam's v holds that batch's
E[g²]; the batch then grows to 256. Scaled by adam_v_scale (the coordinator's factor) v
matches the steady state at 256 at once; unscaled it is ~2.8× too large, and the first
updates are ~1.7× smaller than the ones an optimizer that always ran at 256 makes. With
global-norm clipping in front of Adam (what the coordinator runs with), v follows the clipped
gradient, and so must the factor: ~1 when every step is clipped.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.coordinator import adam_v_scale
from megarl.model.adam_state import scale_adam_second_moments

DIM, B_N, B_OLD, B_NEW = 512, 400.0, 64, 256


@pytest.fixture(autouse=True, scope="module")
def _cpu_compat():  # type: ignore[no-untyped-def]
    """megatron's FP32Optimizer allocates on 'cuda': the CPU compat layer, for this module only."""
    from megarl.compat import cpu

    was_installed = cpu.is_installed()
    installed = cpu.install()
    yield
    if installed and not was_installed:
        cpu.uninstall()


def _optimizer(param: torch.nn.Parameter):  # type: ignore[no-untyped-def]
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    adam = torch.optim.Adam([param], lr=1e-3, betas=(0.9, 0.99))
    cfg = OptimizerConfig(optimizer="adam", lr=1e-3, adam_beta2=0.99, clip_grad=0.0)
    return ChainedOptimizer([FP32Optimizer(adam, cfg, None)]), adam


def _grads(gen: torch.Generator, g: torch.Tensor, sd: float, b: int, steps: int):  # type: ignore[no-untyped-def]
    for _ in range(steps):
        yield g + sd * torch.randn(DIM, generator=gen, dtype=torch.float64).float() / math.sqrt(b)


def _run(opt_inner: torch.optim.Adam, param: torch.nn.Parameter, grads) -> float:  # type: ignore[no-untyped-def]
    """Step through ``grads``; returns the RMS of the parameter change per step."""
    moves = []
    for grad in grads:
        before = param.detach().clone()
        param.grad = grad.clone()
        opt_inner.step()
        moves.append(float((param.detach() - before).pow(2).mean()))
    return math.sqrt(sum(moves) / len(moves))


def _v_sum(adam: torch.optim.Adam) -> float:
    return sum(float(s["exp_avg_sq"].sum()) for s in adam.state.values())


def test_second_moments_match_the_new_batch_after_the_rescale() -> None:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(DIM, generator=gen) * 0.1
    sd = math.sqrt(B_N * float(g @ g) / DIM)
    want_v = lambda b: float(g @ g) * (1 + B_N / b)  # noqa: E731  E|g_B|², summed over elements

    runs = {}
    for rescale in (True, False):
        param = torch.nn.Parameter(torch.zeros(DIM))
        wrapped, adam = _optimizer(param)
        _run(adam, param, _grads(gen, g, sd, B_OLD, 600))
        assert _v_sum(adam) == pytest.approx(want_v(B_OLD), rel=0.1)
        if rescale:
            assert scale_adam_second_moments(wrapped, adam_v_scale(B_OLD, B_NEW, B_N)) == 1
        runs[rescale] = (_v_sum(adam), _run(adam, param, _grads(gen, g, sd, B_NEW, 10)))
    steady_param = torch.nn.Parameter(torch.zeros(DIM))
    _, steady = _optimizer(steady_param)
    _run(steady, steady_param, _grads(gen, g, sd, B_NEW, 600))
    steady_move = _run(steady, steady_param, _grads(gen, g, sd, B_NEW, 10))

    v_scaled, move_scaled = runs[True]
    v_stale, move_stale = runs[False]
    print(f"v/v*: scaled {v_scaled / want_v(B_NEW):.3f}, stale {v_stale / want_v(B_NEW):.3f}")
    print(
        f"first-10-step RMS update / steady: scaled {move_scaled / steady_move:.3f}, stale {move_stale / steady_move:.3f}"
    )
    assert v_scaled == pytest.approx(want_v(B_NEW), rel=0.1)
    assert v_stale / want_v(B_NEW) > 2.3
    assert move_scaled == pytest.approx(steady_move, rel=0.15)
    assert move_stale / steady_move < 0.75


def _run_clipped(adam: torch.optim.Adam, param: torch.nn.Parameter, grads, clip: float) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    """``_run`` with megatron's global-norm clip in front of Adam (clip_grads.py: ×c/(|g| + 1e-6)
    when that is < 1, as torch's clip_grad_norm_); also returns each step's pre-clip |g|²."""
    moves, sq = [], []
    for grad in grads:
        before = param.detach().clone()
        param.grad = grad.clone()
        sq.append(float(torch.nn.utils.clip_grad_norm_([param], clip)) ** 2)
        adam.step()
        moves.append(float((param.detach() - before).pow(2).mean()))
    return math.sqrt(sum(moves) / len(moves)), sq


@pytest.mark.parametrize(
    ("g2", "want_factor"),
    [
        (4.0, 1.0),  # |g| ≈ 5.4 at 64 and 3.2 at 256: clipped on every step at both batches
        (0.3, 0.77),  # |g| ≈ 1.47 at 64 (clipped), 0.88 at 256 (not): E|g̃|² 1 -> 0.77
        (0.05, 64 * 656 / (256 * 464)),  # |g| ≤ 0.6: never clipped, the noise model's ρ = 0.353
    ],
)
def test_the_rescale_follows_the_clipped_gradient_adam_sees(g2: float, want_factor: float) -> None:
    """optim.clip_grad = 1 (the coordinator requires a clip): Adam's v tracks E|g̃|² of the
    clipped gradient, E[min(|g|², 1)], not E|g_B|². The coordinator's factor from the last 32
    pre-clip norms at 64 (adam_v_scale with the clip) lands v on the steady state of a run
    that always trained at 256, and the updates once Adam's first moment has followed (steps 20-40) at its size, in every
    regime; the
    noise-model factor alone (0.353) would leave v at 0.35 of it when clipping is active on
    every step (updates ~1.7x too large), as in the demo run of issue #41 D.1."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(DIM, generator=gen)
    g = g * math.sqrt(g2 / float(g @ g))
    sd = math.sqrt(B_N * g2 / DIM)
    clip = 1.0
    param = torch.nn.Parameter(torch.zeros(DIM))
    wrapped, adam = _optimizer(param)
    _, sq = _run_clipped(adam, param, _grads(gen, g, sd, B_OLD, 600), clip)
    factor = adam_v_scale(B_OLD, B_NEW, B_N, sq_norms=[(B_OLD, x) for x in sq[-32:]], clip=clip)
    assert factor == pytest.approx(want_factor, rel=0.05)
    assert scale_adam_second_moments(wrapped, factor) == 1
    v_scaled = _v_sum(adam)
    # updates of steps 20-40 at 256: the clipped gradient's signal changes with the batch, and
    # Adam's first moment (β1 = 0.9) needs ~20 steps to follow; v (β2 = 0.99) keeps most of a
    # wrong level over those steps (0.99^30 = 0.74)
    _run_clipped(adam, param, _grads(gen, g, sd, B_NEW, 20), clip)
    move = _run_clipped(adam, param, _grads(gen, g, sd, B_NEW, 20), clip)[0]

    steady_param = torch.nn.Parameter(torch.zeros(DIM))
    _, steady = _optimizer(steady_param)
    _run_clipped(steady, steady_param, _grads(gen, g, sd, B_NEW, 600), clip)
    v_steady = _v_sum(steady)
    _run_clipped(steady, steady_param, _grads(gen, g, sd, B_NEW, 20), clip)
    steady_move = _run_clipped(steady, steady_param, _grads(gen, g, sd, B_NEW, 20), clip)[0]
    noise_only = adam_v_scale(B_OLD, B_NEW, B_N)
    print(f"factor {factor:.3f} (noise model {noise_only:.3f}); v/v* {v_scaled / v_steady:.3f}; move/steady {move / steady_move:.3f}")
    assert v_scaled == pytest.approx(v_steady, rel=0.1)
    assert move == pytest.approx(steady_move, rel=0.15)
    if g2 >= 4.0:  # clipped everywhere: the noise model's factor is ~3x off
        assert noise_only * v_scaled / factor / v_steady < 0.4


def test_nothing_to_scale_before_the_first_step_and_bad_factors_refused() -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    wrapped, _ = _optimizer(param)
    assert scale_adam_second_moments(wrapped, 0.5) == 0
    with pytest.raises(ValueError, match="factor nan must be finite and > 0"):
        scale_adam_second_moments(wrapped, math.nan)


class _Buffer:  # the two fields of a megatron grad buffer the preconditioner reads
    def __init__(self, params: list[torch.nn.Parameter], pad: int) -> None:
        self.param_index_map, start = {}, pad  # padding before, between and after the params
        for p in params:
            self.param_index_map[p] = (start, start + p.numel(), 0)
            start += p.numel() + pad
        self.grad_data = torch.full((start,), 7.0)


def test_adam_preconditioner_is_the_factor_adam_applies() -> None:
    """P per grad-buffer element = the factor torch Adam multiplied m̂ by in its last update
    (Δθ = −lr·m̂·P, read off Adam's own step in float64), 0 in the buffer's padding, None
    before the first step. (The probe reads P before a step: v̂ of the steps so far.)"""
    from types import SimpleNamespace

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    from megarl.model.adam_state import adam_preconditioner

    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(3, 4, generator=gen, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))
    lr, beta1, steps = 1e-3, 0.9, 3
    adam = torch.optim.Adam([a, b], lr=lr, betas=(beta1, 0.99), eps=1e-3)
    opt = ChainedOptimizer([FP32Optimizer(adam, OptimizerConfig(optimizer="adam", lr=lr, clip_grad=0.0), None)])
    buf = _Buffer([a, b], pad=2)
    ddp = SimpleNamespace(buffers=[buf])
    assert adam_preconditioner(opt, ddp) is None  # no state before the first step
    for k in range(1, steps + 1):
        for p in (a, b):
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64) * k
        if k == steps:  # m̂ and θ of the last step, to read off the factor it applied
            m_hat = {p: (beta1 * adam.state[p]["exp_avg"] + (1 - beta1) * p.grad) / (1 - beta1**k) for p in (a, b)}
            before = {p: p.detach().clone() for p in (a, b)}
        adam.step()
    w = adam_preconditioner(opt, ddp)
    assert w is not None and len(w) == 1
    for p in (a, b):
        start, end, _ = buf.param_index_map[p]
        applied = (before[p] - p.detach()) / (lr * m_hat[p])
        assert torch.allclose(w[0][start:end].reshape(p.shape).double(), applied, rtol=1e-5), p.shape
    pads = torch.ones_like(w[0], dtype=torch.bool)
    for start, end, _ in buf.param_index_map.values():
        pads[start:end] = False
    assert int(pads.sum()) == 6 and (w[0][pads] == 0).all()
    assert adam_preconditioner(opt, ddp, out=w) is w  # refilled in place


def test_adam_preconditioner_refuses_the_distributed_optimizer() -> None:
    from types import SimpleNamespace

    from megarl.model.adam_state import adam_preconditioner

    DistributedOptimizer = type("DistributedOptimizer", (), {})  # megatron's class, by name
    with pytest.raises(ValueError, match="use_distributed_optimizer = false"):
        adam_preconditioner(DistributedOptimizer(), SimpleNamespace(buffers=[]))
