"""Choosing prompts and samples per prompt together (coordinator.choose=prompts_and_samples):
the pure choice on a known step-time model, and the coordinator end to end on synthetic
gradient statistics whose split is known."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from megarl.config import CoordinatorConfig
from megarl.coordinator import Coordinator, CoordinatorRun, ModelGradStats, StepTimings
from megarl.coordinator.goodput import BatchGrid, choose_batch
from megarl.coordinator.samples import SamplesLayout, best_prompts_and_samples
from megarl.errors import ConfigError

SAMPLES = (2, 4, 8, 16, 32)


class Affine:
    """t(B) = alpha + beta·B seconds."""

    def __init__(self, alpha: float, beta: float) -> None:
        self.alpha, self.beta = alpha, beta

    def predict(self, b: float) -> float:
        return self.alpha + self.beta * b


def _grids(max_prompts: int = 512) -> dict[int, BatchGrid]:
    return {s: BatchGrid(samples_per_prompt=s, min_prompts=2, max_prompts=max_prompts) for s in SAMPLES}


def _best(share: float, prompt_s: float) -> tuple[int, int]:
    c = best_prompts_and_samples(
        _grids(), 400.0, share, Affine(2.0, 0.01), (16, 8), b0=128.0, min_gain=0.0, prompt_s=prompt_s
    )
    return c.prompts, c.samples


def test_between_prompt_noise_asks_for_prompts_within_for_samples() -> None:
    # noise between prompts: the fewest samples per prompt, many prompts
    p, s = _best(share=0.05, prompt_s=0.02)
    assert s == 2 and p > 16, (p, s)
    # noise within prompts and a prompt costing two responses: the most samples the bounds allow
    p, s = _best(share=0.98, prompt_s=0.02)
    assert s == 32 and p <= 16, (p, s)
    # all within, no prompt cost: only P·S matters, and of equal goodputs the larger S wins
    assert _best(share=1.0, prompt_s=0.0)[1] == 32
    # some between noise and no prompt cost: fewer samples always win (same P·S, less variance)
    assert _best(share=0.9, prompt_s=0.0)[1] == 2


def test_a_settled_move_stays_within_the_track_factor() -> None:
    """After the first decision a move changes the batch P·S by at most ``factor`` (as for prompts)."""
    free = best_prompts_and_samples(_grids(), 400.0, 0.05, Affine(2.0, 0.01), (4, 8), b0=128.0, min_gain=0.0)
    held = best_prompts_and_samples(
        _grids(), 400.0, 0.05, Affine(2.0, 0.01), (4, 8), b0=128.0, min_gain=0.0, factor=1.5
    )
    assert free.prompts * free.samples > 1.5 * 32  # the free argmax lies farther than 1.5x
    assert 32 / 1.5 <= held.prompts * held.samples <= 1.5 * 32 and held.samples < 8


def test_at_one_samples_value_it_is_the_total_choice() -> None:
    """One S on offer (its B_noise measured there): the same prompt count as choose_batch picks."""
    grids = {8: BatchGrid(samples_per_prompt=8, min_prompts=2, max_prompts=512)}
    for b_noise in (50.0, 400.0, 5000.0):
        both = best_prompts_and_samples(grids, b_noise, 0.4, Affine(2.0, 0.01), (16, 8), b0=128.0, min_gain=0.0)
        total = choose_batch(grids[8], b_noise, Affine(2.0, 0.01), 16, min_gain=0.0, b0=128.0)
        assert both.prompts == total.num_prompts and both.goodput == pytest.approx(total.goodput)


# ---------------------------------------------------------------- the coordinator end to end

DIM = 8


def _run() -> CoordinatorRun:
    return CoordinatorRun(
        samples_per_prompt=8,
        initial_prompts=16,
        lr_ref={"actor": 1e-3},
        min_batch=16,
        samples_layouts=[SamplesLayout(samples=s, batch_divisor=s, min_batch=2 * s) for s in SAMPLES],
    )


def _stats(rng: np.random.Generator, prompts: int, samples: int, between: float, within: float) -> ModelGradStats:
    """What the probe reports for one step: parts are groups, halves their two halves."""
    g = np.full(DIM, 0.1)
    a = rng.normal(size=(prompts, DIM)) * np.sqrt(between / DIM)
    h = samples // 2
    e1 = rng.normal(size=(prompts, DIM)) * np.sqrt(h * within / DIM)
    e2 = rng.normal(size=(prompts, DIM)) * np.sqrt(h * within / DIM)
    s1, s2 = h * (g + a) + e1, h * (g + a) + e2
    big = (s1 + s2).sum(0) / (prompts * samples)
    return ModelGradStats(
        model="actor",
        local_sq_norms=[float(x) for x in ((s1 + s2) ** 2).sum(1) / samples**2],
        local_batches=[float(samples)] * prompts,
        global_sq_norm=float(big @ big),
        source="microbatch",
        split_sq_norms=[float(x) for x in ((s1 - s2) ** 2).sum(1) / samples**2],
        split_halves=[[float(h), float(h)]] * prompts,
    )


def _drive(config: CoordinatorConfig, between: float, within: float, steps: int = 12) -> Coordinator:
    coord = Coordinator(config, _run())
    rng = np.random.default_rng(3)
    for step in range(steps):
        plan = coord.next_plan()
        b = plan.batch_responses
        timings = StepTimings(
            generate_s=1.0 + 0.004 * b, train_s=0.5 + 0.004 * b, rollout_responses=b, rollout_tokens=8 * b
        )
        grads = [_stats(rng, plan.num_prompts, plan.samples_per_prompt, between, within)]
        coord.observe(step, grads, timings)
    return coord


def test_the_coordinator_moves_samples_with_the_split() -> None:
    cfg = CoordinatorConfig(
        enabled=True, choose="prompts_and_samples", min_dof=0, prompt_cost_s=0.01, min_prompts=2, max_prompts=512
    )
    within = _drive(cfg, between=0.01, within=60.0)
    between = _drive(cfg, between=6.0, within=1.0)
    assert within.next_plan().samples_per_prompt == 32, within.next_plan().reason
    assert between.next_plan().samples_per_prompt == 2, between.next_plan().reason
    m = within.metrics()
    assert m["coord/noise_within/actor"] == pytest.approx(60.0, rel=0.3)
    assert m["coord/samples_per_prompt"] == 32.0
    # the LR follows the effective batch: at S = 32 with the noise all within, P·S counts in full
    assert m["coord/effective_batch"] == pytest.approx(m["coord/batch"], rel=0.02)
    eff = between.metrics()["coord/effective_batch"]
    assert eff > between.metrics()["coord/batch"]  # 2 samples a prompt at S0 = 8: each counts more


def test_choose_total_plans_as_before_with_the_split_measured() -> None:
    cfg = CoordinatorConfig(enabled=True, min_dof=0, min_prompts=2, max_prompts=512)
    with_split = _drive(cfg, between=1.0, within=20.0)
    coord = Coordinator(cfg, _run())
    rng = np.random.default_rng(3)
    for step in range(12):
        plan = coord.next_plan()
        b = plan.batch_responses
        timings = StepTimings(
            generate_s=1.0 + 0.004 * b, train_s=0.5 + 0.004 * b, rollout_responses=b, rollout_tokens=8 * b
        )
        stats = _stats(rng, plan.num_prompts, plan.samples_per_prompt, 1.0, 20.0)
        coord.observe(step, [dataclasses.replace(stats, split_sq_norms=None, split_halves=None)], timings)
    a, b = with_split.next_plan(), coord.next_plan()
    assert (a.num_prompts, a.samples_per_prompt, a.lr) == (b.num_prompts, 8, b.lr)
    assert "coord/noise_between/actor" in with_split.metrics() and "coord/noise_between/actor" not in coord.metrics()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"choose": "both"}, "coordinator.choose"),
        ({"min_samples_per_prompt": 1}, "coordinator.min_samples_per_prompt"),
        ({"max_samples_per_prompt": 3, "min_samples_per_prompt": 4}, "coordinator.max_samples_per_prompt"),
        ({"prompt_cost_s": -1.0}, "coordinator.prompt_cost_s"),
    ],
)
def test_bad_fields_name_themselves(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CoordinatorConfig(**fields).validate()


def test_a_restored_coordinator_plans_the_same_samples() -> None:
    """The split's EMAs and the current S are in the state: a coordinator restored mid-run makes
    the same next plan (S, P, LR) as the one it was saved from."""
    cfg = CoordinatorConfig(
        enabled=True, choose="prompts_and_samples", min_dof=0, prompt_cost_s=0.01, min_prompts=2, max_prompts=512
    )
    a = _drive(cfg, between=0.01, within=60.0, steps=6)
    b = Coordinator(cfg, _run())
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    rng = np.random.default_rng(9)
    for step in range(6, 10):
        plans = [c.next_plan() for c in (a, b)]
        assert plans[0].to_dict() == plans[1].to_dict()
        p = plans[0]
        n = p.batch_responses
        timings = StepTimings(generate_s=1.0 + 0.004 * n, train_s=0.5, rollout_responses=n, rollout_tokens=8 * n)
        stats = _stats(rng, p.num_prompts, p.samples_per_prompt, 0.01, 60.0)
        for c in (a, b):
            c.observe(step, [stats], timings)
    assert a.next_plan().samples_per_prompt != 8  # it did move S
