"""The per-micro-batch objectives the update hands to ``megarl.model.train.train_step``.

Each returns ``loss_fn(rows, last_stage_output) -> (loss, terms)`` where ``rows`` is a
micro-batch of :class:`~megarl.types.UpdateRows`, the loss is already divided by its GLOBAL
denominator (``megarl.algo.aggregation``), so summing over micro-batches and DP ranks gives the
full-batch objective, and ``terms`` are typed sums (and maxima) that reduce exactly
(:class:`~megarl.types.PolicyTerms`, :class:`~megarl.types.ValueTerms`). The math itself
lives in ``megarl.algo``; this module only wires it to the model output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megarl import algo
from megarl.config import AlgoConfig
from megarl.model.forward import labels_of, vocab_parallel_entropy, vocab_parallel_logprobs
from megarl.types import PolicyTerms, UpdateRows, ValueTerms

PolicyLossFn = Callable[[UpdateRows, torch.Tensor], tuple[torch.Tensor, PolicyTerms]]
"""(micro-batch rows, vocab-parallel logits) -> (loss / global denominator, terms)."""
ValueLossFn = Callable[[UpdateRows, torch.Tensor], tuple[torch.Tensor, ValueTerms]]
"""(micro-batch rows, value-head output (b, s, 1)) -> (loss / global denominator, terms)."""


def value_loss_fn(a: AlgoConfig, value_clip: float, denom: float) -> ValueLossFn:
    """Clipped value loss of the critic (PPO; ``critic.value_clip``, 0 = off), aggregated with
    the global denominator."""

    def loss_fn(mb: UpdateRows, out: torch.Tensor) -> tuple[torch.Tensor, ValueTerms]:
        values = out[..., 0].float()
        mask = mb.mask
        old_values, returns = mb.critic_targets()
        per_tok = algo.value_loss(values, old_values, returns, mask, clip=value_clip or None)
        loss = algo.aggregate(per_tok, mask, mode=a.loss_agg, global_denominator=denom)
        err = ((values.detach() - returns) ** 2 * mask).sum()
        return loss, ValueTerms(
            loss=loss.detach(),
            tokens=mask.sum(),
            value_mean=(values.detach() * mask).sum(),
            value_mse=err,
        )

    return loss_fn


def policy_loss_fn(a: AlgoConfig, temperature: float, tp_group: Any, denom: float) -> PolicyLossFn:
    """PPO-clip (+ TIS, KL-as-loss, entropy bonus) on vocab-parallel log-probs at the sampling
    ``temperature`` (``rollout.temperature``); ``tp_group``: the actor's TP group (entropy).

    Off-policy samples (``rollout.max_staleness`` > 0): ``old_logprobs`` is the trainer's policy
    at this step and the engine's log-probs are the (older) behaviour policy, so the clipped ratio
    is taken against the proximal policy and the TIS weight min(π_prox/π_behav, tis_cap) corrects
    for the lag — decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy
    optimization", eq. 2; AReaL, Fu et al. 2025, eq. 5). Config validation requires tis_cap > 0.

    Terms are sums over tokens (or maxima, ``engine_prob_ratio_max``) so they reduce exactly
    over micro-batches and DP ranks (``megarl.model.train.train_step``)."""

    def loss_fn(mb: UpdateRows, logits: torch.Tensor) -> tuple[torch.Tensor, PolicyTerms]:
        mask = mb.mask
        lp = vocab_parallel_logprobs(logits, labels_of(mb.tokens), temperature)
        old = mb.old_logprobs if mb.old_logprobs is not None else lp.detach()
        tis = None
        if a.tis_cap > 0:
            if mb.engine_logprobs is None:
                raise ValueError(f"algo.tis_cap={a.tis_cap} needs the engines' log-probs on every step")
            tis, _ = algo.tis_weights(old, mb.engine_logprobs, mask, cap=a.tis_cap)
        adv_tok = algo.sequence_to_token(mb.adv, mask) if mb.adv.dim() == 1 else mb.adv
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
        kl_sum = ent_sum = None
        if mb.ref_logprobs is not None and a.kl_mode == "loss":
            kl = algo.kl_estimate(lp, mb.ref_logprobs, a.kl_estimator)
            per_tok = per_tok + a.kl_coef * kl
            kl_sum = (kl.detach() * mask).sum()
        if a.entropy_coef > 0:
            ent = vocab_parallel_entropy(logits, temperature, tp_group)
            per_tok = per_tok - a.entropy_coef * ent
            ent_sum = (ent.detach() * mask).sum()
        loss = algo.aggregate(per_tok, mask, mode=a.loss_agg, global_denominator=denom)
        terms = PolicyTerms(loss=loss.detach(), tokens=n, clipfrac=pstats["clipfrac"] * n, kl=kl_sum, entropy=ent_sum)
        if mb.old_logprobs is not None:  # how far the update's forward is from π_old's (samples ~ π_old)
            terms.old_kl_k3 = (algo.kl_estimate(mb.old_logprobs, lp.detach(), "k3") * mask).sum()
        if mb.engine_logprobs is not None:  # this step asked the engines (rollout.engine_logprobs_every)
            delta = (lp.detach() - mb.engine_logprobs) * mask
            terms.engine_logprob_absdiff = delta.abs().sum()
            terms.engine_prob_ratio_max = torch.where(mask.bool(), delta.exp(), torch.zeros_like(delta)).max()
        return loss, terms

    return loss_fn
