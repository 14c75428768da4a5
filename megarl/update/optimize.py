"""Phase 4: PPO epochs × mini-batches over one rollout, actor (after the critic's warm-up) and
critic, each on its own layout; the planner measures the first update of each rollout with its
grad probes (later PPO epochs reuse the samples and would bias the noise estimate low).

Loss normalisers are global (``algo.global_denominator`` over the whole mini-batch), so each
DP rank's share of rows — equal, the coordinator's uneven ``dp_shares``, or balanced by tokens
with ``parallel.max_tokens_per_micro_batch`` — and each micro-batch, of any size or width,
sums to the full-batch objective.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch

from megarl import algo
from megarl.config import AlgoConfig, CriticConfig, ParallelConfig, RunConfig
from megarl.coordinator import StepPlan
from megarl.distributed import ParallelDims
from megarl.model.adam_state import scale_adam_second_moments
from megarl.model.builder import Model
from megarl.model.expert_load import DeadExpertWatch, ExpertLoad, load_metrics
from megarl.model.microbatch import row_lengths
from megarl.model.routes import attach as attach_routes
from megarl.model.train import train_step
from megarl.planning import Planner
from megarl.types import Advantages, LossStats, LossTerms, PolicyEval, RolloutBatch, UpdateRows
from megarl.update.losses import policy_loss_fn, value_loss_fn
from megarl.update.rows import update_rows

log = logging.getLogger("megarl")

LossFnOf = Callable[[float], Callable[[UpdateRows, torch.Tensor], tuple[torch.Tensor, LossTerms]]]
"""A mini-batch's global loss denominator -> its loss function."""


@dataclass(frozen=True, kw_only=True)
class UpdateSettings:
    """What the update reads from the run config: its sections and two derived numbers."""

    algo: AlgoConfig
    parallel: ParallelConfig
    critic: CriticConfig
    temperature: float
    """``rollout.temperature``: the log-probs are taken at the sampling temperature."""
    max_response_len: int
    """``rollout.max_response_len``, tokens: the fixed normaliser of ``seq-mean-token-sum-norm``."""
    dead_expert_steps: int = 0
    """``model.moe_dead_expert_steps``: updates without a token before an expert is reported."""

    @classmethod
    def of(cls, cfg: RunConfig) -> UpdateSettings:
        return cls(
            algo=cfg.algo,
            parallel=cfg.parallel,
            critic=cfg.critic,
            temperature=cfg.rollout.temperature,
            max_response_len=cfg.rollout.max_response_len,
            dead_expert_steps=cfg.model.moe_dead_expert_steps,
        )


@dataclass(kw_only=True)
class Learner:
    """One model this step updates, built once per step."""

    name: str
    """``actor`` | ``critic``: its entries in the plan and the planner."""
    prefix: str
    """Its metrics' prefix: ``train`` (actor) | ``critic``."""
    model: Model
    lr: float
    loss_fn: LossFnOf
    value_model: bool = False
    """Its last stage outputs values (the critic's value head), not logits."""
    stats: LossStats = field(default_factory=LossStats)
    probe_s: float | None = None
    """Seconds the grad probe's reading cost, when it measured this step."""


class PolicyUpdater:
    """Phase 4 for one rollout: ``updater(batch, adv, ev, plan, step)`` runs the step's updates
    and returns its metrics (``train/*`` actor, ``critic/*``, ``coord/probe_s/*``, and with
    MoE routing replay ``moe/route_mismatch*``)."""

    def __init__(
        self, settings: UpdateSettings, dims: ParallelDims, actor: Model, critic: Model | None, planner: Planner
    ) -> None:
        self.s, self.dims, self.actor, self.critic, self.planner = settings, dims, actor, critic, planner
        self.dead_experts = DeadExpertWatch(settings.dead_expert_steps)
        if settings.algo.router_replay != "off":  # phase 2 records or takes the routes, the update replays them
            attach_routes(actor)

    def learners(self, plan: StepPlan, update_actor: bool) -> list[Learner]:
        """The actor (unless the critic is still warming up) and the critic, at the plan's LRs."""
        s, out = self.s, []
        if update_actor:
            policy = partial(policy_loss_fn, s.algo, s.temperature, self.dims.tp_group)
            out.append(Learner(name="actor", prefix="train", model=self.actor, lr=plan.lr["actor"], loss_fn=policy))
        if self.critic is not None:
            value = partial(value_loss_fn, s.algo, s.critic.value_clip)
            lr = plan.lr.get("critic", s.critic.lr)
            out.append(
                Learner(name="critic", prefix="critic", model=self.critic, lr=lr, loss_fn=value, value_model=True)
            )
        return out

    def __call__(
        self, batch: RolloutBatch, adv: Advantages, ev: PolicyEval, plan: StepPlan, step: int
    ) -> dict[str, float]:
        a = self.s.algo
        update_actor = self.critic is None or step >= self.s.critic.warmup_steps
        learners = self.learners(plan, update_actor)
        for name, model in (("actor", self.actor), ("critic", self.critic)):
            if model is not None and name in plan.adam_v_scale:  # a batch change: v follows E[g²]
                scale_adam_second_moments(model.optimizer, plan.adam_v_scale[name])
        load = self.actor.expert_load if update_actor else None
        if load is not None:
            load.reset()
        rows = UpdateRows.of(batch, adv, ev)
        per = batch.size // a.mini_batches
        n_updates = 0
        for _epoch in range(a.ppo_epochs):
            for mb_idx in range(a.mini_batches):
                mini = rows.select(slice(mb_idx * per, (mb_idx + 1) * per))
                denom = algo.global_denominator(a.loss_agg, mini.mask, fixed_normalizer=float(self.s.max_response_len))
                for learner in learners:
                    self.update(learner, mini, denom, plan, n_updates)
                n_updates += 1
        out: dict[str, float] = {"train/lr": plan.lr["actor"], "train/actor_updated": float(update_actor)}
        if self.actor.routes is not None:  # MoE routing replay: live choices that differed (collective)
            out.update(self.actor.routes.mismatch(self.dims))
        # the probe's own cost
        out.update({f"coord/probe_s/{ln.name}": ln.probe_s for ln in learners if ln.probe_s is not None})
        for ln in learners:
            means = ln.stats.means()
            if ln.value_model:  # the critic logs its LR (the actor's is train/lr, logged always)
                out[f"{ln.prefix}/lr"] = ln.lr
                means["value_loss"] = means.pop("loss")
            out.update({f"{ln.prefix}/{k}": v for k, v in means.items()})
        if load is not None:
            out.update(self.expert_health(load))
        return out

    def expert_health(self, load: ExpertLoad) -> dict[str, float]:
        """``moe/*`` metrics of the update's routing (collective over DP and PP); rank 0 logs
        when the experts without tokens for ``model.moe_dead_expert_steps`` updates change."""
        counts = load.read()
        said = self.dead_experts.observe(counts)
        if said is not None and self.dims.is_rank0:
            log.log(*said)
        return load_metrics(counts, load.topk)

    def update(self, learner: Learner, mini: UpdateRows, denom: float, plan: StepPlan, n_updates: int) -> None:
        """One optimizer step of ``learner`` on this DP rank's rows of the mini-batch ``mini``."""
        p, model = self.s.parallel, learner.model
        mbs = p.micro_batch_size
        # the plan's uneven DP shares are the actor's ranks; a critic on its own layout splits
        # its rows equally over its DP ranks
        shares = plan.dp_shares if model.dims is self.dims else None
        measuring = self.planner.start_probe(model, n_updates, plan.samples_per_prompt)
        mine, every, groups = update_rows(
            row_lengths(mini.mask),
            mbs,
            p.max_tokens_per_micro_batch,
            model.dims,
            shares,
            probed=measuring,
            pack=p.pack_sequences,
            part_rows=math.lcm(mbs, plan.samples_per_prompt),  # the probe's parts: whole groups (probe_part_rows)
        )
        terms, gnorm = train_step(
            model,
            mini.select(mine),
            learner.loss_fn(denom),
            micro_batch_size=mbs,
            lr=learner.lr,
            value_model=learner.value_model,
            groups=groups,
        )
        learner.stats.add(terms, gnorm)
        self.planner.record_grad_norm(learner.name, gnorm)  # what Adam saw, for its rescale
        if measuring:
            every_rows = cast(list[slice], every)
            adv = None if learner.value_model else mini.adv
            learner.probe_s = self.planner.record_probe(learner.name, model, gnorm, mini.mask, every_rows, mbs, adv)
