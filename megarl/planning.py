"""Glue between the trainer and the (pure) coordinator: what the next step does.

:class:`Planner` returns each step's prompts, samples and per-model LR — fixed by config, or
chosen by :class:`megarl.coordinator.Coordinator` from the gradient-noise statistics that
the grad probes (``megarl.model.grad_stats``) measured on the first mini-batch of the
previous rollouts and from the step's own phase timings. The LR schedule (warm-up, cosine)
multiplies the planned LR, so the two compose.
"""

from __future__ import annotations

import math
from typing import Any

from megarl.config import RunConfig
from megarl.coordinator import Coordinator, CoordinatorConfig, ModelGradStats, StepTimings
from megarl.model.builder import lr_at
from megarl.model.grad_stats import GradProbe, rescale
from megarl.types import StepPlan


class Planner:
    def __init__(self, cfg: RunConfig, dp: int, models: list[str], critic_dp: int | None = None) -> None:
        """``dp``: the actor's DP size (the plan's per-rank shares are the actor's);
        ``critic_dp``: the critic's, when it has its own layout (batches must split over both)."""
        self.cfg = cfg
        c, r = cfg.coordinator, cfg.rollout
        self.lr_ref = {"actor": cfg.optim.lr, "critic": cfg.critic.lr}
        self.coord: Coordinator | None = None
        if c.enabled:
            self.coord = Coordinator(
                CoordinatorConfig(
                    enabled=c.adapt,
                    samples_per_prompt=r.samples_per_prompt,
                    initial_prompts=r.num_prompts,
                    min_prompts=c.min_prompts,
                    max_prompts=c.max_prompts,
                    grid_factor=c.grid_factor,
                    batch_divisor=math.lcm(dp, critic_dp or dp) * cfg.parallel.micro_batch_size * cfg.algo.mini_batches,
                    dp_size=dp,
                    min_gain=c.min_gain,
                    warmup_steps=c.warmup_steps,
                    cooldown_steps=c.cooldown_steps,
                    ema_beta=c.ema_beta,
                    noise_kind=c.noise_kind,
                    noise_calibration=c.noise_calibration,
                    lr_rule=c.lr_rule,
                    lr_min=c.lr_min,
                    lr_max=c.lr_max,
                    lr_ref={m: self.lr_ref[m] for m in models},
                )
            )

    def plan(self, step: int) -> StepPlan:
        r, o = self.cfg.rollout, self.cfg.optim
        schedule = lr_at(step, o, self.cfg.train.steps) / o.lr  # warm-up / cosine factor
        if self.coord is None:
            return StepPlan(r.num_prompts, r.samples_per_prompt, {m: v * schedule for m, v in self.lr_ref.items()})
        p = self.coord.next_plan()
        return StepPlan(
            p.num_prompts, p.samples_per_prompt, {m: v * schedule for m, v in p.lr.items()}, dp_shares=p.dp_shares
        )

    def observe(self, step: int, grads: list[ModelGradStats], timings: StepTimings) -> None:
        if self.coord is not None:
            self.coord.observe(step, grads, timings)

    def metrics(self) -> dict[str, float]:
        return self.coord.metrics() if self.coord is not None else {}

    def state_dict(self) -> dict[str, Any]:
        return self.coord.state_dict() if self.coord is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.coord is not None and state:
            self.coord.load_state_dict(state)


def grad_stats(
    name: str, probe: GradProbe, grad_norm: float, unit: str, rank_units: list[float], mb_units: list[float]
) -> ModelGradStats:
    """ModelGradStats from a probe: DP ranks as the small batches, or (DP = 1) micro-batches."""
    total = float(sum(rank_units))
    if len(rank_units) > 1:
        parts, units, source = probe.gather_local(), rank_units, "dp"
    else:
        parts, units, source = probe.mb_sq, mb_units, "microbatch"
        if len(parts) != len(units):
            raise RuntimeError(f"grad probe saw {len(parts)} micro-batches, expected {len(units)}")
    return ModelGradStats(
        model=name,
        local_sq_norms=[rescale(s, n, total) for s, n in zip(parts, units)],
        local_batches=units,
        global_sq_norm=grad_norm**2,
        batch_unit=unit,  # type: ignore[arg-type]
        source=source,  # type: ignore[arg-type]
        grad_average="samples",
    )
