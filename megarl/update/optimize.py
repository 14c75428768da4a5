"""Phase 4: PPO epochs × mini-batches over one rollout, actor (after the critic's warm-up) and
critic, each on its own layout; the planner measures the first update of each rollout with its
grad probes (later PPO epochs reuse the samples and would bias the noise estimate low).

Loss normalisers are global (``algo.global_denominator`` over the whole mini-batch), so each
DP rank's share of rows — equal, the coordinator's uneven ``dp_shares``, or balanced by tokens
with ``parallel.max_tokens_per_micro_batch`` — and each micro-batch, of any size or width,
sums to the full-batch objective.
"""

from __future__ import annotations

from typing import cast

from megarl import algo, objectives
from megarl.config import RunConfig
from megarl.config.cross import probe_part_rows
from megarl.coordinator import StepPlan
from megarl.distributed import ParallelDims
from megarl.model.adam_state import scale_adam_second_moments
from megarl.model.builder import Model
from megarl.model.forward import train_step
from megarl.model.microbatch import row_lengths
from megarl.planning import Planner
from megarl.types import Advantages, LossStats, PolicyEval, RolloutBatch
from megarl.update.rows import update_rows


class PolicyUpdater:
    def __init__(
        self, cfg: RunConfig, dims: ParallelDims, actor: Model, critic: Model | None, planner: Planner
    ) -> None:
        self.cfg, self.dims, self.actor, self.critic, self.planner = cfg, dims, actor, critic, planner

    def __call__(
        self, batch: RolloutBatch, adv: Advantages, ev: PolicyEval, plan: StepPlan, step: int
    ) -> dict[str, float]:
        a, mbs, budget = self.cfg.algo, self.cfg.parallel.micro_batch_size, self.cfg.parallel.max_tokens_per_micro_batch
        lr, critic_lr = plan.lr["actor"], plan.lr.get("critic", self.cfg.critic.lr)
        rows = {"tokens": batch.tokens, **adv.rows(), **ev.rows()}
        if batch.engine_logprobs is not None:
            rows["engine_logprobs"] = batch.engine_logprobs
        update_actor = self.critic is None or step >= self.cfg.critic.warmup_steps
        actor_stats, critic_stats = LossStats(), LossStats()
        probe_s: dict[str, float] = {}
        for name, model in (("actor", self.actor), ("critic", self.critic)):
            if model is not None and name in plan.adam_v_scale:  # a batch change: v follows E[g²]
                scale_adam_second_moments(model.optimizer, plan.adam_v_scale[name])
        per = batch.size // a.mini_batches
        n_updates = 0
        for _epoch in range(a.ppo_epochs):
            for mb_idx in range(a.mini_batches):
                mini = {k: v[mb_idx * per : (mb_idx + 1) * per] for k, v in rows.items()}
                denom = algo.global_denominator(
                    a.loss_agg, mini["mask"], fixed_normalizer=float(self.cfg.rollout.max_response_len)
                )
                lengths = row_lengths(mini["mask"])
                for name, model, loss_fn, model_lr, is_value, acc in (
                    (
                        "actor",
                        self.actor if update_actor else None,
                        objectives.policy_loss_fn(self.cfg, self.dims.tp_group, denom),
                        lr,
                        False,
                        actor_stats,
                    ),
                    ("critic", self.critic, objectives.value_loss_fn(self.cfg, denom), critic_lr, True, critic_stats),
                ):
                    if model is None:
                        continue
                    # the plan's uneven DP shares are the actor's ranks; a critic on its own
                    # layout splits its rows equally over its DP ranks
                    shares = plan.dp_shares if model.dims is self.dims else None
                    measuring = self.planner.start_probe(model, n_updates)
                    mine, every, groups = update_rows(
                        lengths,
                        mbs,
                        budget,
                        model.dims,
                        shares,
                        probed=measuring,
                        pack=self.cfg.parallel.pack_sequences,
                        part_rows=probe_part_rows(self.cfg),  # the probe's parts hold whole groups
                    )
                    stats, gnorm = train_step(
                        model,
                        {k: v[mine] for k, v in mini.items()},
                        loss_fn,
                        micro_batch_size=mbs,
                        lr=model_lr,
                        value_model=is_value,
                        groups=groups,
                    )
                    acc.add(stats, gnorm)
                    self.planner.record_grad_norm(name, gnorm)  # what Adam saw, for its rescale
                    if measuring:
                        probe_s[name] = self.planner.record_probe(
                            name,
                            model,
                            gnorm,
                            mini["mask"],
                            cast(list[slice], every),
                            mbs,
                            None if is_value else mini["adv"],
                        )
                n_updates += 1
        out: dict[str, float] = {"train/lr": lr, "train/actor_updated": float(update_actor)}
        out.update({f"coord/probe_s/{name}": s for name, s in probe_s.items()})  # the probe's own cost
        if update_actor:
            out.update({f"train/{k}": v for k, v in actor_stats.means().items()})
        if self.critic is not None:
            out["critic/lr"] = critic_lr
            means = critic_stats.means()
            means["value_loss"] = means.pop("loss")
            out.update({f"critic/{k}": v for k, v in means.items()})
        return out
