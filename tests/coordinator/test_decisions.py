"""The coordinator's decision rules (decisions.py) on a synthetic trainer with a known
optimum: it jumps instead of walking, settles, holds inside its band instead of flipping, and
plans with the log-prob phase, the reward-signal fraction and the LR anchor.

The synthetic trainer reports K parts per step (micro-batches across DP ranks), each the mean
gradient of B/K responses with per-sample noise of trace B_NOISE·|G|², and phase times
generate 10 + 0.02·B, log-probs 0.01·B, train 2 + 0.02·B, other 1 s: t(B) = 13 + 0.05·B, so
the goodput optimum is B* = √(13·B_noise/0.05) (goodput.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from megarl.coordinator import (
    Coordinator,
    CoordinatorConfig,
    CoordinatorRun,
    ModelGradStats,
    StepPlan,
    StepTimeModel,
    StepTimings,
    adam_v_scale,
    choose_batch,
    goodput,
    hold_or_move,
    limit_move,
    optimum_band,
)

DIM = 64
B_NOISE = 400.0


class PartsTrainer:
    def __init__(
        self, seed: int, parts: int, b_noise: float = B_NOISE, signal_fraction: float = 1.0, noise_dims: int = DIM
    ):
        """``noise_dims``: the per-sample noise lives in that many directions, with the same
        trace (real gradient noise sits in few, which makes |G_B|² far noisier)."""
        self.rng = np.random.default_rng(seed)
        self.parts = parts
        self.g = self.rng.normal(size=DIM)
        self.sd = math.sqrt(b_noise * float(self.g @ self.g) / noise_dims)
        self.mask = np.arange(DIM) < noise_dims
        self.f = signal_fraction

    def step(self, plan: StepPlan) -> tuple[list[ModelGradStats], StepTimings]:
        b = plan.batch_responses
        n = self.f * b / self.parts  # responses with signal per part
        locs = [self.g + self.mask * self.rng.normal(size=DIM) * self.sd / math.sqrt(n) for _ in range(self.parts)]
        glob = np.mean(locs, axis=0)
        grads = [
            ModelGradStats(
                model="actor",
                local_sq_norms=[float(x @ x) for x in locs],
                local_batches=[n] * self.parts,
                global_sq_norm=float(glob @ glob),
                source="microbatch",
                signal_fraction=self.f,
            )
        ]
        jitter = 1.0 + 0.01 * self.rng.normal(size=4)
        timings = StepTimings(
            generate_s=(10.0 + 0.02 * b) * float(jitter[0]),
            logprobs_s=0.01 * b * float(jitter[1]),
            train_s=(2.0 + 0.02 * b) * float(jitter[2]),
            other_s=1.0 * float(jitter[3]),
            rollout_responses=b,
            rollout_tokens=b * 10,
        )
        return grads, timings


class TrueTime:
    def predict(self, b: float) -> float:
        return 13.0 + 0.05 * b


def _coord(**settings: object) -> Coordinator:
    run = CoordinatorRun(samples_per_prompt=8, initial_prompts=8, batch_divisor=8, dp_size=1, lr_ref={"actor": 1e-3})
    # synthetic gradients: the estimator is unbiased here, so no calibration whatever the default
    # (a calibration may correct the proxy's low reading on real runs, docs/COORDINATOR.md §5)
    kw: dict[str, object] = {"enabled": True, "min_prompts": 4, "max_prompts": 256, "noise_calibration": 1.0}
    kw.update(settings)
    return Coordinator(CoordinatorConfig(**kw), run)  # type: ignore[arg-type]


def _run(coord: Coordinator, trainer: PartsTrainer, steps: int) -> list[int]:
    prompts = []
    for step in range(steps):
        plan = coord.next_plan()
        prompts.append(plan.num_prompts)
        coord.observe(step, *trainer.step(plan))
    return prompts


def _changes(prompts: list[int]) -> list[tuple[int, int, int]]:
    return [(i, a, b) for i, (a, b) in enumerate(zip(prompts, prompts[1:], strict=False), start=1) if a != b]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_jumps_to_the_optimum_and_holds(seed: int) -> None:
    """From 8 prompts (64 responses) with 16 parts a step: the first change comes as soon as
    |G|² is resolved (old policy: after 10 warm-up steps, then a walk with 10-step cooldowns);
    the first jump uses the one-batch time prior, so a second change may correct it, but at
    most 2 changes reach the optimum's grid neighbourhood and the batch then holds for the
    rest of the 200 steps."""
    coord = _coord()
    prompts = _run(coord, PartsTrainer(seed, parts=16), 200)
    best = choose_batch(coord.grid, B_NOISE, TrueTime(), 8, min_gain=0.0, b0=64.0).best_prompts
    grid = coord.grid.prompts()
    changes = _changes(prompts)
    print("changes (step, from, to):", changes, "optimum", best)
    assert changes[0][0] <= 6
    assert len(changes) <= 2
    assert changes[-1][0] <= 20
    assert abs(grid.index(prompts[-1]) - grid.index(best)) <= 1
    assert all(p == prompts[-1] for p in prompts[changes[-1][0] :])


def test_first_change_waits_for_enough_degrees_of_freedom() -> None:
    """Two parts a step (one dof): the first change waits until the discounted dof reach
    min_dof = 6 (Σ_k 0.9^k >= 6 after 9 steps), then jumps; no flip back afterwards."""
    coord = _coord()
    prompts = _run(coord, PartsTrainer(2, parts=2), 150)
    changes = _changes(prompts)
    print("changes (step, from, to):", changes)
    assert changes[0][0] == 9
    assert len(changes) <= 3
    moves = [b for _, _, b in changes]
    assert all(moves[i] != moves[i - 2] for i in range(2, len(moves)))  # no A -> B -> A


def _true_time_model() -> StepTimeModel:
    model = StepTimeModel()
    for b in (64, 128, 256, 512):
        model.observe(
            responses=b, tokens=b, generate_s=10 + 0.02 * b, train_s=2 + 0.02 * b, other_s=1.0, logprobs_s=0.01 * b
        )
    return model


def test_band_keeps_a_batch_the_data_cannot_tell_from_the_optimum() -> None:
    """B_noise band [200, 800] -> optima √(13·B_n/0.05)/8 = 28.5 .. 57 prompts: grid points
    32 and 45 are kept although the point argmax (B_noise 400: 40 prompts) is one of them;
    8 and 128 lie outside and move to the point argmax."""
    coord = _coord()
    model = _true_time_model()
    lo, hi = optimum_band(coord.grid, (200.0, 800.0), model, 8, 64.0)
    assert (lo, hi) in {(23, 45), (23, 64), (32, 45), (32, 64)}
    point = choose_batch(coord.grid, B_NOISE, model, 8, min_gain=0.0).best_prompts
    assert point in (32, 45)
    for current in (32, 45):
        d = hold_or_move(coord.grid, B_NOISE, (200.0, 800.0), model, current, min_gain=0.05, b0=64.0)
        assert d.prompts == current and "inside the optimum band" in d.reason
    for current in (8, 128):
        d = hold_or_move(coord.grid, B_NOISE, (200.0, 800.0), model, current, min_gain=0.05, b0=64.0)
        assert d.prompts == point


def test_band_ratio_clips_an_unbounded_band() -> None:
    """|G|² not resolved from zero: the band (200, inf) makes every batch above B*(200) "inside",
    so the grid's largest batch would be held forever. Its upper end capped at 4× the point estimate
    (B_noise 400 → 1600: optimum √(13·1600/0.05)/8 ≈ 81 prompts, grid 91) it moves to the point
    argmax, while a batch inside the capped band (64 prompts) is still kept."""
    coord = _coord()
    model = _true_time_model()
    point = choose_batch(coord.grid, B_NOISE, model, 8, min_gain=0.0).best_prompts
    top = coord.grid.prompts()[-1]
    band = (200.0, math.inf)
    kept = hold_or_move(coord.grid, B_NOISE, band, model, top, min_gain=0.05, b0=64.0)
    assert kept.prompts == top and "inside the optimum band" in kept.reason
    moved = hold_or_move(coord.grid, B_NOISE, band, model, top, min_gain=0.05, b0=64.0, band_ratio=4.0)
    assert moved.prompts == point
    for current in (128, 181):  # above B*(1600) (grid 91): outside the capped band
        assert hold_or_move(coord.grid, B_NOISE, band, model, current, min_gain=0.05, b0=64.0,
                            band_ratio=4.0).prompts == point  # fmt: skip
    d = hold_or_move(coord.grid, B_NOISE, band, model, 64, min_gain=0.05, b0=64.0, band_ratio=4.0)
    assert d.prompts == 64 and "inside the optimum band" in d.reason
    with pytest.raises(ValueError, match="band_ratio"):
        _coord(band_ratio=0.5)


def test_log_prob_phase_is_linear_in_the_time_model() -> None:
    """t(B) includes the log-prob phase's 0.01·B: predict(512) - predict(256) = 0.05·256
    (the old model put it in the constant part: 0.04·256, and its optimum was ~12 % high)."""
    model = _true_time_model()
    assert model.predict(512) - model.predict(256) == pytest.approx(0.05 * 256, rel=1e-9)
    assert model.predict(0.0001) == pytest.approx(13.0, abs=1e-3)


def test_signal_fraction_scales_the_planned_noise_scale() -> None:
    """Half the groups without reward signal: the estimate is per response with signal
    (B_NOISE), and a rollout of B carries B/2 of them, so B_noise in rollout responses is 2·B_NOISE."""
    coord = _coord()
    _run(coord, PartsTrainer(3, parts=16, signal_fraction=0.5), 60)
    m = coord.metrics()
    assert m["coord/signal_fraction/actor"] == pytest.approx(0.5)
    assert m["coord/b_noise/actor"] == pytest.approx(2 * B_NOISE, rel=0.25)
    est = coord.noise_estimator("actor")
    assert est is not None and est.b_simple is not None
    assert m["coord/b_noise/actor"] == pytest.approx(2 * est.b_simple, rel=1e-9)


def test_lr_anchor_scales_from_the_reference_batch() -> None:
    """lr_ref validated at 512 responses, run started at 64: the sqrt rule plans
    lr_ref·√(64/512) from step 0 (the old coordinator anchored at the starting batch: lr_ref)."""
    run = CoordinatorRun(
        samples_per_prompt=8, initial_prompts=8, batch_divisor=8, lr_ref={"actor": 1e-3}, b_ref={"actor": 512.0}
    )
    for rule, want in (("sqrt", 1e-3 * math.sqrt(64 / 512)), ("linear", 1e-3 * 64 / 512)):
        coord = Coordinator(CoordinatorConfig(enabled=True, min_prompts=4, lr_rule=rule), run)  # type: ignore[arg-type]
        assert coord.next_plan().lr["actor"] == pytest.approx(want, rel=1e-12)


def test_adam_v_scale_on_a_batch_change() -> None:
    """The plan of a change carries E|g_new|²/E|g_old|² = B_old(B_n + B_new)/(B_new(B_n + B_old))."""
    assert adam_v_scale(64, 256, None) == pytest.approx(0.25)
    assert adam_v_scale(64, 256, 0.0) == pytest.approx(1.0)
    assert adam_v_scale(64, 256, 400.0) == pytest.approx(64 * 656 / (256 * 464))
    coord = _coord()
    trainer = PartsTrainer(4, parts=16)
    plan = coord.next_plan()
    assert plan.adam_v_scale == {}
    coord.observe(0, *trainer.step(plan))
    jumped = coord.next_plan()
    assert jumped.num_prompts != 8
    bn = jumped.b_noise["actor"]
    assert bn is not None
    want = adam_v_scale(64, jumped.batch_responses, bn)
    assert jumped.adam_v_scale == {"actor": pytest.approx(want, rel=1e-12)}
    assert _coord(adam_rescale=False).next_plan().adam_v_scale == {}


def _jump_after_one_step(
    coord: Coordinator, grad_norm: float | None = None, trainer: PartsTrainer | None = None
) -> StepPlan:
    """Observe one step of the synthetic trainer (with one optimizer step's pre-clip norm) and
    return the plan after it, which jumps."""
    trainer = trainer or PartsTrainer(4, parts=16)
    grads, timings = trainer.step(coord.next_plan())
    coord.observe(0, grads, timings, None if grad_norm is None else {"actor": [grad_norm] * 4})
    jumped = coord.next_plan()
    assert jumped.num_prompts != 8
    return jumped


def _clipped_coord(clip: float, **settings: object) -> Coordinator:
    run = CoordinatorRun(
        samples_per_prompt=8, initial_prompts=8, batch_divisor=8, lr_ref={"actor": 1e-3}, clip_grad=clip
    )
    kw: dict[str, object] = {"enabled": True, "min_prompts": 4, "max_prompts": 256, "noise_calibration": 1.0}
    kw.update(settings)
    return Coordinator(CoordinatorConfig(**kw), run)  # type: ignore[arg-type]


def test_adam_v_scale_follows_the_clipped_gradient() -> None:
    """optim.clip_grad = 1 and a pre-clip norm of 5 on every step (the demo run: 1.2-10.9, clipped on
    200 of 200 steps): the optimizer saw unit-norm gradients and will at the new batch too, so the
    plan's factor is 1, not the noise model's B_old(B_n + B_new)/(B_new(B_n + B_old)) (which it still
    is when no step was clipped, norm 0.1)."""
    clipped = _jump_after_one_step(_clipped_coord(1.0), grad_norm=5.0)
    noise = adam_v_scale(64, clipped.batch_responses, clipped.b_noise["actor"])
    assert noise < 0.5  # what was applied before: v x noise, updates x 1/sqrt(noise) for ~1/(1-β2) steps
    assert clipped.adam_v_scale == {"actor": pytest.approx(1.0, rel=1e-12)}
    free = _jump_after_one_step(_clipped_coord(1.0), grad_norm=0.1)
    want = adam_v_scale(64, free.batch_responses, free.b_noise["actor"])
    assert free.adam_v_scale == {"actor": pytest.approx(want, rel=1e-12)}
    # partly clipped: each norm carried to the batch by the noise model, then clipped
    mixed = _jump_after_one_step(_clipped_coord(1.0), grad_norm=1.5)
    rho = adam_v_scale(64, mixed.batch_responses, mixed.b_noise["actor"])
    assert mixed.adam_v_scale == {"actor": pytest.approx(min(2.25 * rho, 1.0), rel=1e-12)}


def test_adam_v_scale_uses_the_raw_noise_scale() -> None:
    """noise_calibration multiplies B_noise for the batch decision (Merrill et al.: the proxy reads
    low under Adam); E|g_B|² = |G|² + tr(Σ)/B is the raw estimate's, and so is the rescale."""
    plan = _jump_after_one_step(_coord(noise_calibration=3.0))
    calibrated = plan.b_noise["actor"]
    assert calibrated is not None
    want = adam_v_scale(64, plan.batch_responses, calibrated / 3.0)
    assert want != pytest.approx(adam_v_scale(64, plan.batch_responses, calibrated), rel=0.05)
    assert plan.adam_v_scale == {"actor": pytest.approx(want, rel=1e-12)}


def test_statistical_efficiency_is_per_optimizer_step() -> None:
    """With algo.mini_batches = m a rollout of B responses makes m optimizer steps of B/m, and
    McCandlish's E(B) = E_min(1 + B/B_noise) is per step: per-sample efficiency is
    (B_noise + B0/m)/(B_noise + B/m), i.e. goodput over rollout batches with m·B_noise. For
    t(B) = α + β·B the optimum moves from √(α·B_noise/β) to √(α·m·B_noise/β): 2x at m = 4. Adam's
    rescale on the first change is per step too: 64/m -> B/m responses."""
    plans = {}
    for m in (1, 4):
        run = CoordinatorRun(
            samples_per_prompt=8, initial_prompts=8, batch_divisor=8 * m, lr_ref={"actor": 1e-3}, mini_batches=m
        )
        coord = Coordinator(CoordinatorConfig(enabled=True, min_prompts=4, max_prompts=256, noise_calibration=1.0), run)
        trainer = PartsTrainer(5, parts=16)
        checked = False
        for step in range(30):
            plan = coord.next_plan()
            if plan.adam_v_scale and not checked:  # the first change
                prev = 8 * 8
                bn = plan.b_noise["actor"]
                assert bn is not None
                want = adam_v_scale(prev / m, plan.batch_responses / m, bn)
                assert plan.adam_v_scale == {"actor": pytest.approx(want, rel=1e-12)}
                checked = True
            coord.observe(step, *trainer.step(plan))
        assert checked
        plan = coord.next_plan()
        bn = plan.b_noise["actor"]
        assert bn is not None and plan.predicted_goodput is not None
        t = coord._time.predict(plan.batch_responses)
        assert plan.predicted_goodput == pytest.approx(goodput(plan.batch_responses, m * bn, 64.0, t), rel=1e-12)
        plans[m] = plan.num_prompts
    print("prompts after 30 steps, m = 1 / 4:", plans)
    assert 1.5 <= plans[4] / plans[1] <= 2.9


def test_a_settled_batch_moves_at_most_track_factor_per_change() -> None:
    """limit_move keeps a target within [cur/2, 2·cur] on the grid; on the synthetic trainer a
    6-step dip of |G|² (B_noise ×50) after settling moves the batch at most one
    2× step, and a lasting 8× rise of B_noise is still followed, in several moves."""
    coord = _coord()
    grid = coord.grid.prompts()
    assert limit_move(coord.grid, 16, 64, 2.0) == 32 and limit_move(coord.grid, 16, 23, 2.0) == 23
    assert limit_move(coord.grid, 64, 8, 2.0) == 32 and limit_move(coord.grid, 64, 8, 0.0) == 8
    assert limit_move(coord.grid, grid[-1], 10**6, 2.0) == grid[-1]

    class Dip(PartsTrainer):
        def __init__(self, seed: int, dip: range, rise_at: int) -> None:
            super().__init__(seed, parts=4)
            self.n, self.dip, self.rise_at, self.sd0 = 0, dip, rise_at, self.sd

        def step(self, plan: StepPlan) -> tuple[list[ModelGradStats], StepTimings]:
            scale = 50.0 if self.n in self.dip else 8.0 if self.n >= self.rise_at else 1.0
            self.sd, self.n = self.sd0 * math.sqrt(scale), self.n + 1
            return super().step(plan)

    for seed in (1, 2, 3):
        coord = _coord()
        prompts = _run(coord, Dip(seed, range(60, 66), rise_at=120), 240)
        settled = prompts[59]
        assert max(prompts[60:120]) <= 2 * settled, (seed, settled, _changes(prompts))
        moves = [c for c in _changes(prompts) if c[0] > 120]
        assert all(b <= 2 * a and a <= 2 * b for _, a, b in moves)
        best = choose_batch(coord.grid, 8 * B_NOISE, TrueTime(), 8, min_gain=0.0, b0=64.0).best_prompts
        assert abs(grid.index(prompts[-1]) - grid.index(best)) <= 1, (seed, _changes(prompts), best)


def _mean_relative_goodput(unresolved_as_infinite: bool, b_noise: float, seeds: range) -> list[float]:
    """Per seed: the run's mean goodput (true B_noise, true t(B)) over the optimum's, from 8 prompts,
    4 parts a step, the noise in 4 directions, 150 steps."""
    out = []
    for seed in seeds:
        coord = _coord(unresolved_as_infinite=unresolved_as_infinite)
        best = choose_batch(coord.grid, b_noise, TrueTime(), 8, min_gain=0.0, b0=64.0)
        prompts = _run(coord, PartsTrainer(seed, parts=4, b_noise=b_noise, noise_dims=4), 150)
        rel = [choose_batch(coord.grid, b_noise, TrueTime(), p, min_gain=0.0, b0=64.0).current_goodput / best.goodput
               for p in prompts]  # fmt: skip
        out.append(float(np.mean(rel)))
    return out


def test_unresolved_as_infinite_removes_the_low_reading_of_small_batches() -> None:
    """Today an unresolved |G|² keeps the batch, so the coordinator acts only on readings taken
    after |G|² came out high, which are low (benchmarks/noise_selection_bias.py). Counting it as
    B_noise = inf makes the decision monotone in the estimate. On 8 seeds with the optimum at
    181 prompts (B_noise 8000) the run's mean goodput rises from 0.78 to 0.88 of the optimum's
    and its worst seed from 0.53 to 0.74; where the optimum is near (B_noise 400, 45 prompts)
    it does no harm."""
    far_off, far_on = _mean_relative_goodput(False, 8000.0, range(1, 9)), _mean_relative_goodput(True, 8000.0, range(1, 9))
    print("B_noise 8000, per seed: today", np.round(far_off, 3), "inf", np.round(far_on, 3))
    assert np.mean(far_on) > np.mean(far_off) + 0.05
    assert min(far_on) > min(far_off) + 0.1
    near_off, near_on = _mean_relative_goodput(False, 400.0, range(1, 9)), _mean_relative_goodput(True, 400.0, range(1, 9))
    print("B_noise 400, per seed: today", np.round(near_off, 3), "inf", np.round(near_on, 3))
    assert np.mean(near_on) > np.mean(near_off) - 0.01


class DriftingMachine(PartsTrainer):
    """A shared machine: every phase runs 2x slower for ``period`` steps, then at full speed for
    ``period`` steps, and so on (the demo's steps took 0.5 s and 1.4 s within one run)."""

    def __init__(self, seed: int, period: int = 60):
        super().__init__(seed, parts=16)
        self.period = period
        self.k = 0

    def step(self, plan: StepPlan) -> tuple[list[ModelGradStats], StepTimings]:
        grads, t = super().step(plan)
        s = 2.0 if (self.k // self.period) % 2 else 1.0
        self.k += 1
        slowed = StepTimings(
            generate_s=t.generate_s * s,
            logprobs_s=t.logprobs_s * s,
            train_s=t.train_s * s,
            other_s=t.other_s * s,
            rollout_responses=t.rollout_responses,
            rollout_tokens=t.rollout_tokens,
        )
        return grads, slowed


def _drift_runs(monkeypatch: pytest.MonkeyPatch, detect: bool) -> tuple[list[int], list[float]]:
    """Per seed: batch changes after step 20 and the run's mean goodput over the optimum's (true
    t(B) and B_noise 400: 40 prompts), 300 steps on the drifting machine."""
    import megarl.coordinator.throughput as throughput

    monkeypatch.setattr(throughput, "ERA_REL", 0.15 if detect else math.inf)
    changes, rel = [], []
    for seed in range(1, 5):
        coord = _coord()
        best = choose_batch(coord.grid, B_NOISE, TrueTime(), 8, min_gain=0.0, b0=64.0)
        prompts = _run(coord, DriftingMachine(seed), 300)
        changes.append(len([c for c in _changes(prompts) if c[0] > 20]))
        rel.append(float(np.mean([choose_batch(coord.grid, B_NOISE, TrueTime(), p, min_gain=0.0, b0=64.0).current_goodput
                                  / best.goodput for p in prompts[20:]])))  # fmt: skip
        assert coord.metrics()["coord/time_eras"] >= (4 if detect else 0)
    return changes, rel


def test_a_machine_whose_speed_changes_does_not_flip_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drifting machine, 4 seeds. Fitting one era's times of one size against another era's
    of another (what the time model did) swung the fit between all-fixed and all-marginal cost
    and moved the batch 5-10 times a run (the demo: 512 <-> 1024 three times). Detecting each
    change of speed, dropping the other sizes' old times and keeping the last fit's shape
    alpha/beta (which a change of speed leaves alone): no change after the first settling, and
    the run's goodput stays within 1 % of the optimum's."""
    before, before_rel = _drift_runs(monkeypatch, detect=False)
    after, after_rel = _drift_runs(monkeypatch, detect=True)
    print("changes after step 20, per seed: without eras", before, "with", after)
    print("mean goodput / optimum: without", np.round(before_rel, 3), "with", np.round(after_rel, 3))
    assert min(before) >= 3  # the failure is there to be fixed
    assert max(after) <= 1
    assert min(after_rel) > 0.98 and np.mean(after_rel) > np.mean(before_rel) + 0.03
