"""Glue between the trainer and the (pure) coordinator: what the next step does.

:class:`Planner` returns each step's :class:`StepPlan` (prompts, samples, per-model LR, DP
shares) — fixed by config, or chosen by :class:`megarl.coordinator.Coordinator` from the
gradient-noise statistics that the grad probes (``megarl.model.grad_stats``) measured on the
first mini-batch of the previous rollout and from the step's own phase timings. The planner
owns the probes: it attaches them to the trained models, switches them on for the update it
measures, and turns what they saw into :class:`ModelGradStats`. The LR schedule
(:func:`lr_at`: warm-up, cosine) multiplies the planned LR, so the two compose.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from megarl.config import OptimConfig, RunConfig
from megarl.coordinator import Coordinator, CoordinatorRun, ModelGradStats, StepPlan, StepTimings
from megarl.distributed import ParallelDims
from megarl.model.builder import Model
from megarl.model.grad_stats import GradProbe, rescale


def lr_at(step: int, ocfg: OptimConfig, total_steps: int, base_lr: float | None = None) -> float:
    """Warm-up then constant or cosine; ``step`` counts optimizer steps from 0."""
    peak = ocfg.lr if base_lr is None else base_lr
    if ocfg.warmup_steps and step < ocfg.warmup_steps:
        return peak * (step + 1) / ocfg.warmup_steps
    if ocfg.schedule == "constant":
        return peak
    span = max(1, total_steps - ocfg.warmup_steps)
    progress = min(1.0, (step - ocfg.warmup_steps) / span)
    return ocfg.min_lr + 0.5 * (peak - ocfg.min_lr) * (1 + math.cos(math.pi * progress))


class Planner:
    def __init__(self, cfg: RunConfig, dp: int, models: list[str], critic_dp: int | None = None) -> None:
        """``dp``: the actor's DP size (the plan's per-rank shares are the actor's);
        ``critic_dp``: the critic's, when it has its own layout (batches must split over both)."""
        self.cfg = cfg
        c, r = cfg.coordinator, cfg.rollout
        self.lr_ref = {"actor": cfg.optim.lr, "critic": cfg.critic.lr}
        self.coord: Coordinator | None = None
        self.dp = dp
        self._grads: list[ModelGradStats] = []  # measured in this step's update, observed after it
        self._ahead: dict[int, StepPlan] = {}
        """Plans made before an earlier update, for the batches generated ahead (rollout.max_staleness)."""
        self.unit = "tokens" if cfg.algo.loss_agg == "token-mean" else "responses"
        """What the loss averages over, and so the unit of the batch the noise is measured in."""
        if c.enabled:
            run = CoordinatorRun(
                samples_per_prompt=r.samples_per_prompt,
                initial_prompts=r.num_prompts,
                batch_divisor=math.lcm(dp, critic_dp or dp) * cfg.parallel.micro_batch_size * cfg.algo.mini_batches,
                dp_size=dp,
                lr_ref={m: self.lr_ref[m] for m in models},
            )
            self.coord = Coordinator(c, run)

    def plan(self, step: int) -> StepPlan:
        """The plan of ``step``: the one made ahead for its batch (:meth:`plan_ahead`), else now."""
        if step in self._ahead:
            return self._ahead.pop(step)
        return self._make(step)

    def plan_ahead(self, step: int) -> StepPlan:
        """The plan of a later ``step`` whose batch is generated now, before the current update:
        made with what the coordinator has observed so far, kept (and checkpointed) so the step
        trains with the batch size and LR its batch was generated for."""
        self._ahead[step] = self._make(step)
        return self._ahead[step]

    def _make(self, step: int) -> StepPlan:
        r, o = self.cfg.rollout, self.cfg.optim
        schedule = lr_at(step, o, self.cfg.train.steps) / o.lr  # warm-up / cosine factor
        if self.coord is None:
            return StepPlan(
                step=step,
                num_prompts=r.num_prompts,
                samples_per_prompt=r.samples_per_prompt,
                lr={m: v * schedule for m, v in self.lr_ref.items()},
                dp_shares=None,
                predicted_goodput=None,
                b_noise={},
                reason="fixed by config (coordinator.enabled=false)",
            )
        p = self.coord.next_plan()  # for the step after the last observed one (= step without pipelining)
        return dataclasses.replace(p, step=step, lr={m: v * schedule for m, v in p.lr.items()})

    # ------------------------------------------------------------------ grad probes

    def attach_probe(self, model: Model) -> None:
        """Give ``model`` a grad probe when the coordinator measures noise (no-op otherwise):
        DP ranks are the small batches, or micro-batches when DP = 1 (which needs PP = 1)."""
        if self.coord is None:
            return
        dims = model.dims
        if dims.dp == 1 and dims.pp > 1:
            raise ValueError(
                "coordinator.enabled needs data_parallel > 1 or pipeline_parallel = 1 "
                "(the micro-batch noise estimator needs PP = 1)"
            )
        model.probe = GradProbe(dims, microbatch=dims.dp == 1)

    def start_probe(self, model: Model, update_index: int) -> bool:
        """Switch ``model``'s probe on for this update if it is measured: the first update of
        each rollout only (later PPO epochs reuse the samples and would bias tr(Σ) low)."""
        if self.coord is None or update_index != 0:
            return False
        model.probe.start()
        return True

    def record_probe(
        self, name: str, model: Model, grad_norm: float, mask: torch.Tensor, mine: slice, every: list[slice], mbs: int
    ) -> float:
        """Turn the probe's reading of this update into ModelGradStats; returns its cost, s."""
        model.probe.active = False
        units = mask.sum(1) if self.unit == "tokens" else (mask.sum(1) > 0).float()  # per row
        rank_units = [float(units[sl].sum()) for sl in every]
        mb_units = [float(u.sum()) for u in units[mine].split(mbs)]
        self._grads.append(grad_stats(name, model.probe, grad_norm, self.unit, rank_units, mb_units))
        return float(model.probe.seconds)

    # ------------------------------------------------------------------ phase 6

    def observe(
        self, step: int, batch_size: int, batch_tokens: int, times: dict[str, float], dims: ParallelDims
    ) -> None:
        """Feed the coordinator this step's gradient statistics and phase timings (collective)."""
        grads, self._grads = self._grads, []
        if self.coord is None:
            return
        other = sum(v for k, v in times.items() if k not in ("generate", "update"))
        # every rank must plan identically: use rank 0's clock
        t = torch.tensor([times["generate"], times["update"], other], dtype=torch.float64)
        dist.broadcast(t, src=0)
        # each DP rank's own update time (shares follow measured per-rank throughput)
        mine = torch.tensor([times["update"]], dtype=torch.float64)
        ranks = [torch.zeros_like(mine) for _ in range(dims.dp)]
        dist.all_gather(ranks, mine, group=dims.dp_group)
        gathered = torch.cat(ranks)
        dist.broadcast(gathered, src=0)  # identical on every rank (other DP groups time differently)
        timings = StepTimings(
            generate_s=float(t[0]),
            train_s=float(t[1]),
            other_s=float(t[2]),
            rollout_responses=batch_size,
            rollout_tokens=batch_tokens,
            rank_train_s=[float(x) for x in gathered] if dims.dp > 1 else None,
        )
        self.coord.observe(step, grads, timings)

    def metrics(self) -> dict[str, float]:
        return self.coord.metrics() if self.coord is not None else {}

    def state_dict(self) -> dict[str, Any]:
        out = self.coord.state_dict() if self.coord is not None else {}
        if self._ahead:  # only when pipelining: other checkpoints keep their exact form
            out = {**out, "plans_ahead": {str(s): p.to_dict() for s, p in self._ahead.items()}}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self._ahead = {int(s): StepPlan.from_dict(d) for s, d in state.pop("plans_ahead", {}).items()}
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
