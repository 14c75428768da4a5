"""The per-micro-batch objectives the trainer hands to megatron's schedules.

Each returns ``loss_fn(micro_batch, last_stage_output) -> (loss, stats)`` where the loss is
already divided by its GLOBAL denominator (``megarl.algo.aggregation``), so summing over
micro-batches and DP ranks gives the full-batch objective. The math itself lives in
``megarl.algo``; this module only wires it to the model output.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl import algo
from megarl.config import RunConfig
from megarl.model.forward import LossFn, labels_of, vocab_parallel_entropy, vocab_parallel_logprobs


def value_loss_fn(cfg: RunConfig, denom: float) -> LossFn:
    """Clipped value loss of the critic (PPO), aggregated with the global denominator."""
    a, clip = cfg.algo, cfg.critic.value_clip

    def loss_fn(mb: dict[str, torch.Tensor], out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = out[..., 0].float()
        mask = mb["mask"]
        per_tok = algo.value_loss(values, mb["old_values"], mb["returns"], mask, clip=clip or None)
        loss = algo.aggregate(per_tok, mask, mode=a.loss_agg, global_denominator=denom)
        err = ((values.detach() - mb["returns"]) ** 2 * mask).sum()
        return loss, {
            "loss": loss.detach(),
            "tokens": mask.sum(),
            "value_mse_sum": err,
            "value_mean_sum": (values.detach() * mask).sum(),
        }

    return loss_fn


def policy_loss_fn(cfg: RunConfig, tp_group: Any, denom: float) -> LossFn:
    """PPO-clip (+ TIS, KL-as-loss, entropy bonus) on vocab-parallel log-probs.

    Off-policy samples (``rollout.max_staleness`` > 0): ``old_logprobs`` is the trainer's policy
    at this step and the engine's log-probs are the (older) behaviour policy, so the clipped ratio
    is taken against the proximal policy and the TIS weight min(π_prox/π_behav, tis_cap) corrects
    for the lag — decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy
    optimization", eq. 2; AReaL, Fu et al. 2025, eq. 5). Config validation requires tis_cap > 0.

    Stats are sums (``*_sum``, ``tokens``) or maxima (``*_max``) so they reduce exactly over
    micro-batches and DP ranks (``megarl.model.forward.train_step``)."""
    a, temp = cfg.algo, cfg.rollout.temperature

    def loss_fn(mb: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb["mask"]
        lp = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), temp)
        old = mb["old_logprobs"] if "old_logprobs" in mb else lp.detach()
        tis = None
        stats: dict[str, torch.Tensor] = {}
        if a.tis_cap > 0:
            tis, _ = algo.tis_weights(old, mb["engine_logprobs"], mask, cap=a.tis_cap)
        adv_tok = algo.sequence_to_token(mb["adv"], mask) if mb["adv"].dim() == 1 else mb["adv"]
        per_tok, pstats = algo.policy_loss(
            lp,
            old,
            adv_tok,
            mask,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            dual_clip=a.dual_clip or None,
            tis_weights=tis,
        )
        n = mask.sum()
        if "ref_logprobs" in mb and a.kl_mode == "loss":
            kl = algo.kl_estimate(lp, mb["ref_logprobs"], a.kl_estimator)
            per_tok = per_tok + a.kl_coef * kl
            stats["kl_sum"] = (kl.detach() * mask).sum()
        if a.entropy_coef > 0:
            ent = vocab_parallel_entropy(logits, temp, tp_group)
            per_tok = per_tok - a.entropy_coef * ent
            stats["entropy_sum"] = (ent.detach() * mask).sum()
        loss = algo.aggregate(per_tok, mask, mode=a.loss_agg, global_denominator=denom)
        stats.update({"loss": loss.detach(), "tokens": n, "clipfrac_sum": pstats["clipfrac"] * n})
        if "engine_logprobs" in mb:  # this step asked the engines (rollout.engine_logprobs_every)
            delta = (lp.detach() - mb["engine_logprobs"]) * mask
            stats["engine_logprob_absdiff_sum"] = delta.abs().sum()
            stats["engine_prob_ratio_max"] = torch.where(mask.bool(), delta.exp(), torch.zeros_like(delta)).max()
        return loss, stats

    return loss_fn
