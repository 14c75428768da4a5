"""Glue between the trainer and the (pure) coordinator: what the next step does.

:class:`Planner` returns each step's :class:`StepPlan` (prompts, samples, per-model LR, DP
shares) — fixed by config, or chosen by :class:`megarl.coordinator.Coordinator` from the
gradient-noise statistics that the grad probes (``megarl.model.grad_stats``) measured on the
first mini-batch of the previous rollout and from the step's own phase timings. The planner
owns the probes: it attaches them to the trained models, switches them on for the update it
measures, and turns what they saw into :class:`ModelGradStats` — parts are the micro-batches
of every DP rank (PP = 1) or the DP ranks, counting only responses with reward signal for the
policy loss, and at EP > 1 the experts' parts their unions over each EP group
(``megarl.grad_parts``; docs/COORDINATOR.md §1). The LR schedule
(:func:`schedule_lr`: warm-up, cosine) multiplies the planned LR, so the two compose; its
progress is counted in responses trained, not steps, so a batch change does not stretch or
shrink the warm-up and the decay (issue #41 D.5). The planner reads the run config as a
:class:`PlanSettings` (``PlanSettings.of(cfg)``), not the whole of it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from megarl.config import CoordinatorConfig, OptimConfig, RunConfig
from megarl.config.cross import probe_min_batch, probe_part_rows
from megarl.coordinator import Coordinator, CoordinatorRun, ModelGradStats, StepPlan, StepTimings, clock
from megarl.coordinator.samples import samples_layouts
from megarl.distributed import ParallelDims
from megarl.grad_parts import grad_stats, read_parts, read_split, split_unreadable
from megarl.model.adam_state import adam_preconditioner
from megarl.model.builder import Model
from megarl.model.grad_stats import GradProbe

log = logging.getLogger("megarl")


def schedule_lr(
    done: float, batch: float, ocfg: OptimConfig, b0: float, total_steps: int, base_lr: float | None = None
) -> float:
    """Warm-up then constant or cosine, with progress in samples: ``done`` trained before this
    step, ``batch`` trained by it. The config's step counts are converted at the starting batch
    ``b0`` (what they meant when it was fixed): the warm-up spans ``warmup_steps``·b0 samples and
    reaches (done + batch)/(warmup_steps·b0) of the peak, the cosine decays over
    (total_steps − warmup_steps)·b0 samples after it. At a fixed batch b0 this is the step
    schedule exactly (done = step·b0); when the coordinator changes the batch, a step schedule
    would warm up and decay over a different number of samples (4× the batch: 4× the samples)."""
    peak = ocfg.lr if base_lr is None else base_lr
    warm = ocfg.warmup_steps * b0
    if warm and done < warm:
        return peak * min(1.0, (done + batch) / warm)
    if ocfg.schedule == "constant":
        return peak
    span = max(b0, (total_steps - ocfg.warmup_steps) * b0)
    progress = min(1.0, (done - warm) / span)
    return ocfg.min_lr + 0.5 * (peak - ocfg.min_lr) * (1 + math.cos(math.pi * progress))


def lr_at(step: int, ocfg: OptimConfig, total_steps: int, base_lr: float | None = None) -> float:
    """Warm-up then constant or cosine over steps (``step`` from 0): :func:`schedule_lr` at a
    fixed batch (the supervised warm start)."""
    return schedule_lr(step, 1, ocfg, 1, total_steps, base_lr)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """What the :class:`Planner` reads of the run config, derived once by :meth:`of`: the
    coordinator's section, the actor's optimizer section (its LR schedule) and a few facts of
    the other sections."""

    coordinator: CoordinatorConfig
    """The coordinator's settings (``coordinator``)."""
    optim: OptimConfig
    """The actor's optimizer: peak LR and the schedule every planned LR follows (``optim``)."""
    critic_lr: float
    """The critic's peak LR (``critic.lr``)."""
    num_prompts: int
    """Prompts per step at the start (``rollout.num_prompts``)."""
    samples_per_prompt: int
    """Responses per prompt, the GRPO group size (``rollout.samples_per_prompt``)."""
    mini_batches: int
    """Optimizer steps per rollout and epoch (``algo.mini_batches``)."""
    loss_agg: str
    """What the loss averages over (``algo.loss_agg``)."""
    micro_batch_size: int
    """Rows per micro-batch on one DP rank (``parallel.micro_batch_size``)."""
    max_tokens_per_micro_batch: int
    """The token budget of a micro-batch, tokens; 0 = off (``parallel.max_tokens_per_micro_batch``)."""
    steps: int
    """RL steps of the run, which the LR schedule spans (``train.steps``)."""
    part_rows: int
    """Rows of the grad probe's smallest part (``megarl.config.cross.probe_part_rows``)."""
    expert_parallel: int = 1
    """Expert-parallel ranks per group (``parallel.expert_parallel``): the DP shares stay equal,
    and at DP = EP the probe needs two runs a rank."""

    @property
    def batch_size(self) -> int:
        """Responses per step at the start."""
        return self.num_prompts * self.samples_per_prompt

    @classmethod
    def of(cls, cfg: RunConfig) -> PlanSettings:
        return cls(
            coordinator=cfg.coordinator,
            optim=cfg.optim,
            critic_lr=cfg.critic.lr,
            num_prompts=cfg.rollout.num_prompts,
            samples_per_prompt=cfg.rollout.samples_per_prompt,
            mini_batches=cfg.algo.mini_batches,
            loss_agg=cfg.algo.loss_agg,
            micro_batch_size=cfg.parallel.micro_batch_size,
            max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
            steps=cfg.train.steps,
            part_rows=probe_part_rows(cfg),
            expert_parallel=cfg.parallel.expert_parallel,
        )


class Planner:
    def __init__(self, cfg: PlanSettings, dp: int, models: list[str], critic_dp: int | None = None) -> None:
        """``cfg``: the run config as the planner reads it (``PlanSettings.of(run_config)``);
        ``dp``: the actor's DP size (the plan's per-rank shares are the actor's);
        ``critic_dp``: the critic's, when it has its own layout (batches must split over both)."""
        self.cfg = cfg
        c = cfg.coordinator
        self.lr_ref = {"actor": cfg.optim.lr, "critic": cfg.critic_lr}
        self.coord: Coordinator | None = None
        self.dp = dp
        self._grads: list[ModelGradStats] = []  # measured in this step's update, observed after it
        self._norms: dict[str, list[float]] = {}  # per model: each optimizer step's pre-clip grad norm
        self._ahead: dict[int, StepPlan] = {}
        """Plans made before an earlier update, for the batches generated ahead (rollout.max_staleness)."""
        self._prompts: int | None = None
        """Prompts of the last coordinator plan (a change is logged with its reason)."""
        self._samples: int | None = None
        """Responses planned before the next plan is made (plans are made once per step, in step
        order): the LR schedule's progress. None until the first plan, or a resume from a
        checkpoint without it: then step × the configured batch (exact at a fixed batch)."""
        self.unit = "tokens" if cfg.loss_agg == "token-mean" else "responses"
        self.vclock = clock.from_env()
        """A virtual clock (``MEGARL_VIRTUAL_CLOCK``, benchmarks): the coordinator sees its phase
        times instead of this machine's, and each step logs its ``vclock/step_s``."""
        self._vstep_s: float | None = None
        """What the loss averages over, and so the unit of the batch the noise is measured in."""
        self._split_said = False  # why the noise split is not measured was logged (once)
        if c.enabled:
            run = CoordinatorRun(
                samples_per_prompt=cfg.samples_per_prompt,
                initial_prompts=cfg.num_prompts,
                # every DP rank's share of the measured mini-batch: whole probe parts (whole groups)
                batch_divisor=math.lcm(dp, critic_dp or dp) * cfg.part_rows * cfg.mini_batches,
                dp_size=dp,
                lr_ref={m: self.lr_ref[m] for m in models},
                b_ref={m: float(c.lr_reference_batch or cfg.batch_size) for m in models},
                min_batch=probe_min_batch(cfg.part_rows, cfg.mini_batches, dp, critic_dp, cfg.expert_parallel),
                equal_shares=cfg.expert_parallel > 1,
                mini_batches=cfg.mini_batches,
                clip_grad=cfg.optim.clip_grad,  # (the critic's optimizer clips alike)
                samples_layouts=samples_layouts(
                    c,
                    cfg.samples_per_prompt,
                    cfg.micro_batch_size,
                    cfg.mini_batches,
                    dp,
                    critic_dp,
                    cfg.expert_parallel,
                ),
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
        if self._samples is None:
            self._samples = step * self.cfg.batch_size
        if self.coord is None:
            schedule = self._schedule(self.cfg.batch_size)
            return StepPlan(
                step=step,
                num_prompts=self.cfg.num_prompts,
                samples_per_prompt=self.cfg.samples_per_prompt,
                lr={m: v * schedule for m, v in self.lr_ref.items()},
                dp_shares=None,
                predicted_goodput=None,
                b_noise={},
                reason="fixed by config (coordinator.enabled=false)",
            )
        p = self.coord.next_plan()  # for the step after the last observed one (= step without pipelining)
        schedule = self._schedule(p.batch_responses)
        if p.num_prompts != self._prompts:  # a user sees why the batch moved (megarl report plots where)
            if self._prompts is not None:
                lr = ", ".join(f"{m} {v * schedule:.3g}" for m, v in p.lr.items())
                log.info(
                    "coordinator: step %d: %d -> %d prompts (lr %s): %s",
                    step + 1,  # numbered as in metrics.jsonl and the step lines
                    self._prompts,
                    p.num_prompts,
                    lr,
                    p.reason,
                )
            self._prompts = p.num_prompts
        return dataclasses.replace(p, step=step, lr={m: v * schedule for m, v in p.lr.items()})

    def _schedule(self, batch: int) -> float:
        """The warm-up / cosine factor of the next plan, which trains ``batch`` responses."""
        assert self._samples is not None
        o = self.cfg.optim
        factor = schedule_lr(self._samples, batch, o, self.cfg.batch_size, self.cfg.steps) / o.lr
        self._samples += batch
        return factor

    # ------------------------------------------------------------------ grad probes

    def attach_probe(self, model: Model) -> None:
        """Give ``model`` a grad probe when the coordinator measures noise (no-op otherwise):
        the small batches are the micro-batches of every DP rank (PP = 1, and with DP > 1 only
        when ``coordinator.microbatch_parts``), joined into runs that hold whole GRPO groups
        (``probe_part_rows``), else the DP ranks."""
        if self.coord is None:
            return
        dims = model.dims
        if dims.dp == 1 and dims.pp > 1:
            raise ValueError(
                "coordinator.enabled needs data_parallel > 1 or pipeline_parallel = 1 "
                "(the micro-batch noise estimator needs PP = 1)"
            )
        budget = bool(self.cfg.max_tokens_per_micro_batch)
        if dims.dp == 1 and budget:
            raise ValueError(
                "coordinator.enabled with parallel.max_tokens_per_micro_batch needs data_parallel > 1: "
                "at DP = 1 the noise estimate's small batches are micro-batches, which the budget groups by "
                "length (not random samples of the batch)"
            )
        # with a budget, micro-batches are grouped by length: only whole DP ranks are random parts
        microbatch = not budget and dims.pp == 1 and (dims.dp == 1 or self.cfg.coordinator.microbatch_parts)
        model.probe = GradProbe(
            dims,
            microbatch=microbatch,
            microbatches_per_part=self.cfg.part_rows // self.cfg.micro_batch_size,
            split=self._split(microbatch, dims.ep, self.cfg.samples_per_prompt),
        )

    def _split(self, microbatch: bool, ep: int, samples: int) -> bool:
        """Whether the probe reads the noise split by prompt at ``samples`` per prompt: asked for
        (``coordinator.noise_split`` or ``choose=prompts_and_samples``) and possible — each part one
        GRPO group whose halves are whole micro-batches; else why not, logged once."""
        c, mbs = self.cfg.coordinator, self.cfg.micro_batch_size
        if not (c.noise_split or c.choose == "prompts_and_samples"):
            return False
        why = split_unreadable(microbatch, ep, samples, mbs)
        if why is not None and not self._split_said:
            log.info("coordinator: the noise split by prompt is not measured: %s", why)
            self._split_said = True
        return why is None

    def start_probe(self, model: Model, update_index: int, samples: int | None = None) -> bool:
        """Switch ``model``'s probe on for this update if it is measured: the first update of
        each rollout only (later PPO epochs reuse the samples and would bias tr(Σ) low).
        ``samples``: the update's samples per prompt (the plan's; default the configured), which
        sets the probe's parts (whole groups) and whether it reads their halves."""
        if self.coord is None or update_index != 0:
            return False
        if samples is not None and samples != self.cfg.samples_per_prompt:  # choose=prompts_and_samples moved S
            model.probe.microbatches_per_part = (
                math.lcm(self.cfg.micro_batch_size, samples) // self.cfg.micro_batch_size
            )
            model.probe.split = self._split(model.probe.microbatch, model.dims.ep, samples)
        weights = None
        if self.cfg.coordinator.noise_kind == "adam":  # Adam's P = 1/(√v̂+ε) of the steps so far
            weights = adam_preconditioner(model.optimizer, model.module, model.probe.weights)
            if weights is None:  # before Adam's first step there is no preconditioner: no reading
                return False
        model.probe.start(weights)
        return True

    def record_probe(
        self,
        name: str,
        model: Model,
        grad_norm: float,
        mask: torch.Tensor,
        every: list[slice],
        mbs: int,
        adv: torch.Tensor | None = None,
    ) -> float:
        """Turn the probe's reading of this update into ModelGradStats; returns its cost, s.

        ``mask``: (B, S) the mini-batch's loss mask; ``every``: each DP rank's rows of it;
        ``adv``: its advantages ((B, S) or (B,))
        for a policy loss, whose rows with zero advantage carry no gradient, None for a loss
        where every row counts (value loss)."""
        model.probe.active = False
        units = mask.sum(1) if self.unit == "tokens" else (mask.sum(1) > 0).float()  # per row
        answered = mask.sum(1) > 0
        signal = answered if adv is None else answered & ((adv * mask).abs().sum(1) > 0 if adv.dim() == 2 else adv != 0)
        parts, rows, experts = read_parts(model.probe, every, mbs)
        source = "microbatch" if model.probe.microbatch else "dp"
        if model.probe.weights is not None or experts is not None:  # |P·G|², or EP's dense |G|²: the probe's
            assert model.probe.global_sq is not None, "the probe saw no DP reduction"
            grad_norm = math.sqrt(model.probe.global_sq)
        split = read_split(model.probe)
        stats = grad_stats(name, parts, rows, units, signal, grad_norm, self.unit, source, experts, split)
        if stats is not None:
            self._grads.append(stats)
        return float(model.probe.seconds)

    def record_grad_norm(self, name: str, grad_norm: float) -> None:
        """The optimizer's pre-clip global grad norm of one of ``name``'s steps (every step of
        the rollout: Adam's second moments see them all, clipped). A skipped step (a non-finite
        norm) handed Adam nothing and is left out."""
        if self.coord is not None and math.isfinite(grad_norm):
            self._norms.setdefault(name, []).append(grad_norm)

    # ------------------------------------------------------------------ phase 6

    def observe(
        self,
        step: int,
        batch_size: int,
        batch_tokens: int,
        times: dict[str, float],
        dims: ParallelDims,
        work: dict[str, float],
    ) -> None:
        """Feed the coordinator this step's gradient statistics and phase timings (collective).
        ``work``: the seconds of the "update" and "logprobs" phases spent on micro-batch work;
        the rest of each phase is its measured fixed cost."""
        grads, self._grads = self._grads, []
        norms, self._norms = self._norms, {}
        if self.vclock is not None:  # the same on every rank: a function of (batch, step) alone
            virtual = self.vclock.phase_times(batch_size, step)
            self._vstep_s = sum(virtual[k] for k in clock.PHASES)
            shown = self.vclock.shown(virtual, step)
            times = {k: shown[k] for k in clock.PHASES}
            work = {k: shown[k] - shown[f"{k}_fixed"] for k in ("update", "logprobs")}
        if self.coord is None:
            return
        # the log-prob forward passes are linear in B: their own term of t(B), not a constant
        other = sum(v for k, v in times.items() if k not in ("generate", "update", "logprobs"))
        # every rank must plan identically: use rank 0's clock
        fixed = [max(0.0, times.get(k, 0.0) - work[k]) for k in ("update", "logprobs")]
        t = torch.tensor(
            [times["generate"], times["update"], other, times.get("logprobs", 0.0), *fixed], dtype=torch.float64
        )
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
            logprobs_s=float(t[3]),
            train_fixed_s=float(t[4]),
            logprobs_fixed_s=float(t[5]),
            rollout_responses=batch_size,
            rollout_tokens=batch_tokens,
            rank_train_s=[float(x) for x in gathered] if dims.dp > 1 else None,
        )
        self.coord.observe(step, grads, timings, norms)

    def metrics(self) -> dict[str, float]:
        out = self.coord.metrics() if self.coord is not None else {}
        if self._vstep_s is not None:
            out["vclock/step_s"] = self._vstep_s
        return out

    def state_dict(self) -> dict[str, Any]:
        out = self.coord.state_dict() if self.coord is not None else {}
        if self.coord is not None and self._samples is not None:  # (fixed batch: step × batch)
            out = {**out, "lr_samples": self._samples}
        if self._ahead:  # only when pipelining: other checkpoints keep their exact form
            out = {**out, "plans_ahead": {str(s): p.to_dict() for s, p in self._ahead.items()}}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self._ahead = {int(s): StepPlan.from_dict(d) for s, d in state.pop("plans_ahead", {}).items()}
        samples = state.pop("lr_samples", None)
        self._samples = None if samples is None else int(samples)
        if self.coord is not None and state:
            self.coord.load_state_dict(state)
