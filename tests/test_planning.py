"""The planner's glue: the LR anchor reaches the plan, and the probe's parts become
ModelGradStats over responses with reward signal (exact numbers from explicit per-row
gradients), with every micro-batch of every DP rank a part."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.config import load_config
from megarl.grad_parts import chunks as _chunks
from megarl.grad_parts import grad_stats
from megarl.planning import Planner, PlanSettings


def _planner(*overrides: str) -> Planner:
    cfg = load_config(
        None,
        [
            "coordinator.enabled=true",
            "coordinator.min_prompts=4",
            "rollout.num_prompts=8",
            "rollout.samples_per_prompt=16",
            "parallel.micro_batch_size=16",
            "optim.lr=1e-4",
            *overrides,
        ],
    )
    return Planner(PlanSettings.of(cfg), dp=1, models=["actor"])


def test_lr_is_anchored_at_the_reference_batch() -> None:
    """optim.lr validated at 512 responses, run at 8 × 16 = 128: lr = 1e-4·√(128/512) = 5e-5
    from the first step (before: the starting batch was the anchor, lr = 1e-4)."""
    assert _planner("coordinator.lr_reference_batch=512").plan(0).lr["actor"] == pytest.approx(5e-5, rel=1e-12)
    assert _planner().plan(0).lr["actor"] == pytest.approx(1e-4, rel=1e-12)  # default: the configured batch


def test_micro_batches_of_every_rank_are_the_parts() -> None:
    every = [slice(0, 6), slice(6, 10)]  # uneven DP shares: 6 and 4 rows
    assert _chunks(every[0], 2) + _chunks(every[1], 2) == [
        slice(0, 2),
        slice(2, 4),
        slice(4, 6),
        slice(6, 8),
        slice(8, 10),
    ]


def test_parts_count_only_responses_with_reward_signal() -> None:
    """8 responses, 4 micro-batches of 2; the first group (rows 0-1) has no reward signal, so
    its rows add no gradient. The loss divides by all D = 8 responses: a part holds
    Σ_i g_i / 8. grad_stats must return each remaining part's mean over its signal rows and
    the step's mean over the 6 signal rows, and drop the empty part."""
    gen = torch.Generator().manual_seed(0)
    per_row = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    adv = torch.tensor([0.0, 0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    per_row[adv == 0] = 0.0  # no advantage, no policy gradient
    signal = adv != 0
    rows = _chunks(slice(0, 8), 2)
    part_sq = [float((per_row[r].sum(0) / 8).pow(2).sum()) for r in rows]
    step = per_row.sum(0) / 8
    stats = grad_stats("actor", part_sq, rows, torch.ones(8), signal, float(step.norm()), "responses", "microbatch")
    assert stats is not None
    assert stats.local_batches == [2.0, 2.0, 2.0]
    want_parts = [float(per_row[r].mean(0).pow(2).sum()) for r in rows[1:]]
    assert stats.local_sq_norms == pytest.approx(want_parts, rel=1e-9)
    assert stats.global_sq_norm == pytest.approx(float(per_row[2:].mean(0).pow(2).sum()), rel=1e-9)
    assert stats.signal_fraction == pytest.approx(0.75)
    assert stats.source == "microbatch"
    # one part with signal is no estimate
    only = torch.tensor([False] * 6 + [True, True])
    assert grad_stats("actor", part_sq, rows, torch.ones(8), only, 1.0, "responses", "dp") is None


def test_a_batch_change_is_logged_with_its_reason_and_the_predicted_step_times(caplog) -> None:
    """The coordinator fed a synthetic trainer whose optimum lies far above 8 prompts: the
    planner's plan moves, and the log says from where to where, at which LR, why, and the step
    times the move was planned on; steps that keep the batch log nothing."""
    from tests.coordinator.test_decisions import PartsTrainer

    planner = _planner()
    assert planner.coord is not None
    trainer = PartsTrainer(1, parts=16, b_noise=4000.0)
    prompts = []
    with caplog.at_level("INFO", logger="megarl"):
        for step in range(30):
            plan = planner.plan(step)
            prompts.append(plan.num_prompts)
            planner.coord.observe(step, *trainer.step(plan))
    moves = sum(a != b for a, b in zip(prompts, prompts[1:], strict=False))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("coordinator:")]
    assert moves >= 1 and len(lines) == moves
    first = next(i for i, (a, b) in enumerate(zip(prompts, prompts[1:], strict=False), start=1) if a != b)
    assert lines[0].startswith(f"coordinator: step {first + 1}: 8 -> {prompts[first]} prompts (lr actor ")
    assert "b_noise=" in lines[0] and "predicted step" in lines[0] and f"at {prompts[first] * 16} responses" in lines[0]


def test_the_coordinator_is_told_the_clip_and_the_optimizer_steps_per_rollout() -> None:
    """What Adam's rescale and the per-step efficiency need reaches the coordinator: the clip of
    optim.clip_grad, algo.mini_batches, and every optimizer step's pre-clip norm (a skipped step's
    non-finite norm handed Adam nothing and is left out)."""
    planner = _planner("optim.clip_grad=0.5", "algo.mini_batches=2")
    assert planner.coord is not None
    assert (planner.coord.run.clip_grad, planner.coord.run.mini_batches) == (0.5, 2)
    for norm in (3.0, float("nan"), 0.25):
        planner.record_grad_norm("actor", norm)
    assert planner._norms == {"actor": [3.0, 0.25]}


def _scheduled(planner: Planner, steps: int, start: int = 0, trainer=None) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    """(responses, schedule factor) of each plan: the plan's LR over the coordinator's own."""
    from tests.coordinator.test_decisions import PartsTrainer

    assert planner.coord is not None
    trainer = trainer or PartsTrainer(1, parts=16, b_noise=4000.0)
    out = []
    for step in range(start, start + steps):
        plan = planner.plan(step)
        out.append((plan.batch_responses, plan.lr["actor"] / planner.coord.next_plan().lr["actor"]))
        planner.coord.observe(step, *trainer.step(plan))
    return out


def test_the_lr_schedule_progresses_in_samples() -> None:
    """optim.warmup_steps = 20 at the configured 128 responses is a warm-up over 2560 responses,
    and the cosine decays over (60 - 20) × 128 after it. When the coordinator moves the batch up
    (B_noise 4000: far above 8 prompts; at step 11 here) the warm-up ends after 2560 responses,
    not 20 steps: each step's factor is the samples trained through it over 2560, then the
    cosine of the samples trained before it. A step schedule would warm up over ~3x the samples."""
    planner = _planner("optim.warmup_steps=20", "optim.schedule=cosine", "optim.min_lr=0", "train.steps=60")
    seen = _scheduled(planner, 30)
    assert len({b for b, _ in seen}) > 1  # the batch moved
    done = 0
    for b, factor in seen:
        if done < 2560:
            want = min(1.0, (done + b) / 2560)
        else:
            want = 0.5 * (1 + math.cos(math.pi * min(1.0, (done - 2560) / (40 * 128))))
        assert factor == pytest.approx(want, rel=1e-9), (done, b)
        done += b
    warm = next(i for i, (_, f) in enumerate(seen) if f == pytest.approx(1.0))
    assert warm < 19  # warmed up within 2560 responses, in fewer than 20 steps
    fixed = _planner("optim.warmup_steps=10", "optim.schedule=cosine", "train.steps=40", "coordinator.enabled=false")
    for step in range(12):  # at a fixed batch it is the step schedule
        want = (step + 1) / 10 if step < 10 else 0.5 * (1 + math.cos(math.pi * (step - 10) / 30))
        assert fixed.plan(step).lr["actor"] == pytest.approx(1e-4 * want, rel=1e-12)


def test_the_schedule_resumes_where_it_was() -> None:
    """A planner restored from its checkpointed state plans the uninterrupted run's LRs after a
    batch change: the schedule's progress in samples is part of the state."""
    import json

    from tests.coordinator.test_decisions import PartsTrainer

    overrides = ("optim.warmup_steps=40", "optim.schedule=cosine", "train.steps=80")
    trainer = PartsTrainer(2, parts=16, b_noise=4000.0)
    a = _planner(*overrides)
    _scheduled(a, 16, trainer=trainer)
    assert a._samples != 16 * 128  # the batch did move before the checkpoint
    state = json.loads(json.dumps(a.state_dict()))
    b = _planner(*overrides)
    b.load_state_dict(state)
    assert b.plan(16).lr == a.plan(16).lr


def test_probe_parts_are_whole_groups_of_micro_batches() -> None:
    """examples/qwen_math_gpu.yaml's layout (micro-batch 4, 8 samples per prompt) at DP = 1: a
    part is two micro-batches, one whole group; the coordinator's batches stay whole parts and
    never fewer than two (16 responses). The probe's 8 readings of a 64-row mini-batch become 8
    parts of 8 rows each (before: 16 parts of 4 rows, half-groups, negatively correlated)."""
    from types import SimpleNamespace

    from tests.model.test_grad_probe import _dims

    cfg = load_config(None, ["coordinator.enabled=true", "coordinator.min_prompts=2", "rollout.num_prompts=8",
                             "rollout.samples_per_prompt=8", "parallel.micro_batch_size=4"])  # fmt: skip
    planner = Planner(PlanSettings.of(cfg), dp=1, models=["actor"])
    assert planner.coord is not None
    assert (planner.coord.run.batch_divisor, planner.coord.run.min_batch) == (8, 16)
    model = SimpleNamespace(dims=_dims(), probe=None)
    planner.attach_probe(model)  # type: ignore[arg-type]
    assert model.probe is not None and model.probe.microbatches_per_part == 2
    gen = torch.Generator().manual_seed(0)
    model.probe.mb_sq = torch.rand(8, generator=gen, dtype=torch.float64).tolist()
    mask = torch.ones(64, 1)  # one token a response (the default token-mean loss counts tokens)
    adv = torch.tensor([1.0, -1.0] * 32)
    planner.record_probe("actor", model, 1.0, mask, [slice(0, 64)], 4, adv)  # type: ignore[arg-type]
    (stats,) = planner._grads
    assert stats.local_batches == [8.0] * 8
    # each part's sum-scaled gradient over its mean: × (D/n)² = (64/8)²
    assert stats.local_sq_norms == pytest.approx([64 * x for x in model.probe.mb_sq], rel=1e-12)


def test_the_probe_follows_the_plans_samples_and_reads_the_split_where_it_can(caplog) -> None:  # type: ignore[no-untyped-def]
    """choose=prompts_and_samples at micro-batch 2, 8 samples per prompt: the S on offer are the
    multiples of 4 in [2, 32] on the coordinator's grid, each with its own batch divisor (a part is
    one group); the probe reads each group's halves, and an update at another S re-cuts its parts.
    noise_split at micro-batch 8 with 8 samples (a group is one micro-batch): nothing to split,
    said once."""
    from types import SimpleNamespace

    from tests.model.test_grad_probe import _dims

    cfg = load_config(None, ["coordinator.enabled=true", "coordinator.choose=prompts_and_samples",
                             "coordinator.min_prompts=2", "coordinator.max_samples_per_prompt=32",
                             "rollout.num_prompts=8", "rollout.samples_per_prompt=8",
                             "parallel.micro_batch_size=2"])  # fmt: skip
    planner = Planner(PlanSettings.of(cfg), dp=1, models=["actor"])
    assert planner.coord is not None
    layouts = {x.samples: (x.batch_divisor, x.min_batch) for x in planner.coord.run.samples_layouts}
    assert layouts == {4: (4, 8), 8: (8, 16), 12: (12, 24), 16: (16, 32), 24: (24, 48), 32: (32, 64)}
    model = SimpleNamespace(dims=_dims(), probe=None)
    planner.attach_probe(model)  # type: ignore[arg-type]
    assert model.probe.split and model.probe.microbatches_per_part == 4
    assert planner.start_probe(model, 0, samples=16)  # type: ignore[arg-type]
    assert model.probe.split and model.probe.microbatches_per_part == 8
    with caplog.at_level("INFO", logger="megarl"):
        cfg = load_config(None, ["coordinator.enabled=true", "coordinator.noise_split=true", "coordinator.min_prompts=2",
                                 "rollout.num_prompts=8", "rollout.samples_per_prompt=8",
                                 "parallel.micro_batch_size=8"])  # fmt: skip
        other = Planner(PlanSettings.of(cfg), dp=1, models=["actor"])
        for _ in range(2):
            other.attach_probe(model)  # type: ignore[arg-type]
            assert not model.probe.split
    said = [r.message for r in caplog.records if "noise split" in r.message]
    assert said == ["coordinator: the noise split by prompt is not measured: parallel.micro_batch_size=8 does not "
                    "divide samples_per_prompt/2=4"]  # fmt: skip
